"""The deployment files: ``serve_config.yaml`` and the KubeRay manifest build the app."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema

from pdserve.deploy.config import PDServeConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _build(application: dict) -> Application:
    """What ``serve deploy`` does with one application entry, short of running it."""
    builder = import_attr(application["import_path"])
    return call_user_app_builder_with_args_if_necessary(builder, application["args"])


def test_serve_config_yaml_validates_and_builds_the_app():
    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert isinstance(_build(application), Application)
    settings = PDServeConfig.model_validate(application["args"])
    assert (settings.num_prefill, settings.num_decode, settings.hash_seed) == (2, 2, None)


def test_the_kuberay_rayservice_runs_the_same_import_path_and_args():
    manifest = yaml.safe_load((DEPLOY / "kuberay_rayservice.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (application,) = serve_config["applications"]
    (reference,) = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())["applications"]
    assert application["import_path"] == reference["import_path"]
    assert application["args"] == reference["args"]
    assert isinstance(_build(application), Application)
    ports = {
        p["containerPort"]
        for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for c in group["template"]["spec"]["containers"]
        for p in c["ports"]
    }
    assert {8000, 9000, 7100, 7101} <= ports


def test_the_kuberay_head_probes_liveness_on_health_and_readiness_on_ready():
    manifest = yaml.safe_load((DEPLOY / "kuberay_rayservice.yaml").read_text())
    (head,) = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ]
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
