"""A worker that fails to start fails the deploy at once, with the worker's own error.

``pdserve up`` refuses what it can see before deploying (``tests/deploy/test_preflight.py``);
this deploys past those checks (``deploy`` alone runs none) a model the worker refuses as it
loads. Serve's own wait retried the worker 3 times and then said only "Failed to update the
deployments ['prefill-0']".
"""

from __future__ import annotations

import pytest
from ray import serve

from pdserve.deploy.cluster import WorkerStartError, delete_app, deploy
from pdserve.deploy.config import PDServeConfig
from tests.deploy.small_gguf import write_small_gguf
from tests.service.service_apps import SERVE_PORT


def test_a_worker_that_fails_to_start_fails_the_deploy_at_once_with_its_error(
    ray_cluster, tmp_path
) -> None:
    phi3 = write_small_gguf(tmp_path / "phi-3-mini.gguf", architecture="phi3")
    config = PDServeConfig(
        model=str(phi3),
        num_prefill=1,
        num_decode=0,
        port=SERVE_PORT,
        app_name="refused",
        route_prefix="/refused",
    )
    try:
        with pytest.raises(WorkerStartError) as failed:
            deploy(config)
        assert str(failed.value) == (
            "prefill-0 failed to start: ValueError: GGUF architecture 'phi3' is not "
            "supported; supported: llama, qwen2, qwen3, gemma3, qwen3moe, "
            "deepseek2"
        )
        # At once: Serve is still retrying the worker, and had not given the app up.
        assert serve.status().applications["refused"].status == "DEPLOYING"
    finally:
        delete_app(config.app_name)
