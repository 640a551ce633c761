"""The model's tensor-parallel slices over NCCL, one CUDA device per rank, give one device's
greedy tokens: the GPU half of ``tests/model/test_tensor_parallel.py`` (which runs gloo on CPU).

Only the model's slices and collectives are checked: an engine of degree > 1 is refused on
CUDA (its ranks would share one host mapping of the KV pages; per-rank GPU pages are not
built, docs/deploy.md "Tensor-parallel workers"). Skipped without two CUDA devices.
"""

from __future__ import annotations

import datetime
import socket
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.tensor_parallel import Collectives, TensorParallel
from tests.model.test_tensor_parallel import PROMPT, STEPS, _config, _model

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL tensor parallelism)"
)


def _greedy_on(device: str, tensor_parallel: TensorParallel | None) -> list[int]:
    config = _config("qwen2")
    model = _model(config).to(device)
    runner = ModelRunner(model, config, 8, 16, device=device, tensor_parallel=tensor_parallel)
    chunk = ScheduledChunk("r", PROMPT, 0, [1, 2, 3], sample=True)
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(runner.execute([chunk]).argmax()))
        chunk = ScheduledChunk(
            "r", [tokens[-1]], len(PROMPT) + len(tokens) - 1, [1, 2, 3], sample=True
        )
    return tokens


def _rank(rank: int, port: int, results: dict) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    group = dist.ProcessGroupNCCL(store, rank, 2, datetime.timedelta(seconds=60))
    tokens = _greedy_on(f"cuda:{rank}", TensorParallel(rank, 2, cast(Collectives, group)))
    if rank == 0:
        results["tokens"] = tokens


def test_nccl_ranks_give_one_devices_tokens() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, results), nprocs=2)
        tokens = results["tokens"]
    assert tokens == _greedy_on("cuda:0", None)
