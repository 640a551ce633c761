"""The deployment files: ``serve_config.yaml`` and the KubeRay manifest build the app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema

from pdserve.deploy.app import build_app
from pdserve.deploy.config import PDServeConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECURITY_ARGS = ("kv_tls_dir", "ssl_certfile", "ssl_keyfile")
CERTS_MOUNT = "/etc/pdserve/certs"


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
    security = {key: application["args"].pop(key) for key in SECURITY_ARGS}
    assert application["args"] == reference["args"]
    assert all(path.startswith(CERTS_MOUNT) for path in security.values())
    assert serve_config["http_options"] == {
        "ssl_certfile": security["ssl_certfile"],
        "ssl_keyfile": security["ssl_keyfile"],
    }
    application["args"] |= security
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
    probe = {"port": 8000, "scheme": "HTTPS"}
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", **probe}
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", **probe}


def test_every_kuberay_pod_mounts_the_certificates_and_runs_ray_with_token_auth():
    manifest = yaml.safe_load((DEPLOY / "kuberay_rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]
    ]
    for pod in pods:
        (volume,) = pod["volumes"]
        assert volume["secret"]["secretName"] == "pdserve-certs"
        (container,) = pod["containers"]
        assert {"name": volume["name"], "mountPath": CERTS_MOUNT, "readOnly": True} in container[
            "volumeMounts"
        ]
        env = {entry["name"]: entry for entry in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and "valueFrom" in env["RAY_AUTH_TOKEN"]
    head_env = {entry["name"] for entry in pods[0]["containers"][0]["env"]}
    assert "PDSERVE_API_KEY" in head_env  # the app is built on the head


def test_a_scale_step_reconfigures_the_gateway_and_a_settings_change_replaces_it():
    """The worker set is the gateway's ``user_config`` and not its version, so Serve keeps a
    running gateway through a scale step and calls its ``reconfigure``; other settings are
    a new version, a new replica."""

    def gateway(**settings):
        return build_app({"model": "tiny", **settings})._bound_deployment

    small, large = gateway(num_prefill=1, num_decode=1), gateway(num_prefill=3, num_decode=2)
    assert small._version == large._version
    assert large._deployment_config.user_config == {
        "prefill": ["prefill-0", "prefill-1", "prefill-2"],
        "decode": ["decode-0", "decode-1"],
        "retiring": [],
    }
    assert gateway(num_prefill=1, num_decode=1, worker_timeout_s=9.0)._version != small._version


def test_a_replaced_gateway_lets_its_open_streams_run_for_drain_timeout_s():
    """A redeploy that replaces the gateway: Serve stopped the old replica after its default
    20 s, cutting a stream still running then with no [DONE] and no error event (the
    reviewer's repro: 90 tokens at 0.5 s a step, cut at 21 s)."""
    for settings, drain_s in (({}, 300.0), ({"drain_timeout_s": 42.0}, 42.0)):
        gateway = build_app({"model": "tiny", **settings})._bound_deployment
        assert gateway.name == "gateway"
        assert gateway._deployment_config.graceful_shutdown_timeout_s == drain_s


def test_a_declared_serve_config_refuses_autoscaling_naming_the_way_that_keeps_it():
    """A RayService puts its declared app back: the autoscaler's steps would be undone."""
    with pytest.raises(ValueError, match="pdserve up"):
        build_app({"model": "tiny", "autoscaling": {"ttft_p90_ms": 500, "itl_p90_ms": 40}})
