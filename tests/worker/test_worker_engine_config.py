"""What engine a worker runs, from its spec: the deployment's settings per role."""

from __future__ import annotations

from pdserve.deploy.config import PDServeConfig
from pdserve.worker.engine_host import worker_engine_config


def test_prefill_workers_capture_no_cuda_graphs_decode_and_colocated_ones_do():
    disaggregated = PDServeConfig(model="tiny").resolve_deployment_secrets()
    prefill = worker_engine_config(disaggregated.worker_spec("producer", 0), "a1b2c3d4e5")
    decode = worker_engine_config(disaggregated.worker_spec("consumer", 0), "a1b2c3d4e5")
    assert (prefill.cuda_graphs, decode.cuda_graphs) == ("off", "auto")
    assert prefill.engine_id.endswith("-a1b2c3d4") and prefill.device == "cpu"
    off = PDServeConfig(model="tiny", cuda_graphs="off").resolve_deployment_secrets()
    assert worker_engine_config(off.worker_spec("consumer", 0), "x" * 8).cuda_graphs == "off"
