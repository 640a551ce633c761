"""A decode worker refuses, at the gateway's prewarm handshake, a prefill worker whose blocks
it could not read as its own: another KV dtype, block size, layer count or model. The
refusal names both sides' values, and the gateway's ``/ready`` carries it (``Readiness``,
tests/gateway/test_readiness.py). The workers run here without Ray, over real gRPC."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import transformers

from pdserve.decode.worker import DecodeWorker
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.engine.hf_models import save_hf_model
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

SECRET = "a-test-secret-of-enough-length"


def _spec(worker_id: str, role: str, **engine: object) -> WorkerSpec:
    config = EngineConfig(engine_id=worker_id, hash_seed=0, **ENGINE_KWARGS)
    return WorkerSpec(
        worker_id,
        dataclasses.replace(config, **engine),
        KVConnectorConfig(role=role, secret=SECRET),
    )


@pytest.mark.parametrize(
    "decode_engine, expected",
    [
        pytest.param(
            {"kv_cache_dtype": "float16"}, "dtype: local='float16' remote='float32'", id="dtype"
        ),
        pytest.param({"block_size": 8}, "block_size: local=8 remote=16", id="block-size"),
        pytest.param({"model": "3-layers"}, "num_layers: local=3 remote=2", id="layers"),
    ],
)
def test_a_mismatched_prefill_worker_is_refused_with_both_values(tmp_path, decode_engine, expected):
    model_dirs = {}
    for layers in (2, 3):
        directory = tmp_path / f"{layers}-layers"
        save_hf_model(directory, transformers.LlamaConfig, num_hidden_layers=layers)
        model_dirs[f"{layers}-layers"] = str(directory)
    decode_engine = {
        key: model_dirs.get(value, value) if key == "model" else value
        for key, value in decode_engine.items()
    }
    prefill = PrefillWorker(_spec("prefill-0", "producer", model=model_dirs["2-layers"]))
    matching = DecodeWorker(_spec("decode-0", "consumer", model=model_dirs["2-layers"]))
    mismatched = DecodeWorker(
        _spec("decode-1", "consumer", **{"model": model_dirs["2-layers"], **decode_engine})
    )
    try:
        address = prefill.kv_transfer_address()
        assert address is not None
        good = asyncio.run(matching.connect_prefill_workers([address]))
        assert good.connected == [address] and good.refused == {}
        bad = asyncio.run(mismatched.connect_prefill_workers([address]))
        assert bad.connected == [] and list(bad.refused) == [address]
        assert expected in bad.refused[address], bad.refused[address]
    finally:
        for worker in (mismatched, matching, prefill):
            worker.engine.shutdown()
