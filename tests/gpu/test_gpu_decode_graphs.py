"""CUDA graphs of the decode step (``engine/decode_graphs.py``) give the eager step's tokens.

Three engines over the same random checkpoint on the GPU, greedy: graphs replayed
(``cuda_graphs: auto``), the static buffers run eagerly (``off``), and the step built afresh
(the runner's static batch removed). Every family the CPU suite checks
(``tests/engine/test_static_decode.py``), float32 and bfloat16, with speculative decoding's
verification rows. The capture's time and memory are the benchmark's to report
(``bench/bench_decode_step.py --device cuda``, which run_gpu_checks.sh runs after this suite).
Needs torch with CUDA: tests/gpu/run_gpu_checks.sh.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.decode_graphs import DecodeGraphs
from tests.engine.hf_models import DECODE_FAMILIES, save_hf_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
)


def engine(directory, dtype: str, graphs: str, **config) -> LLMEngine:
    return LLMEngine.from_pretrained(
        str(directory),
        device="cuda",
        dtype=dtype,
        cuda_graphs=graphs,
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=16,
        **config,
    )


def greedy(built: LLMEngine, prompts: list[list[int]], tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [output.token_ids for output in built.generate(prompts, params)]


def prompts(count: int = 5) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 96) for _ in range(rng.randint(3, 40))] for _ in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config_class, overrides", DECODE_FAMILIES)
def test_graph_replays_give_the_eager_steps_tokens(tmp_path, config_class, overrides, dtype):
    """Replays run the kernels the static step runs, at the same padded shapes: the same
    tokens in either dtype. The step built afresh reads its pages through other plans (its
    own table widths and splits): the same tokens in float32; in bfloat16 its sums' other
    order may move a near tie, so there it is not compared."""
    save_hf_model(tmp_path, config_class, **overrides)
    replayed = engine(tmp_path, dtype, "auto")
    if replayed.runner.decode_graphs is None:
        # Only a model whose experts torch's grouped matmul does not run as one kernel here
        # (anything but bfloat16 on Hopper or Blackwell) may go without: any other missing
        # capture is a failure, not a skip.
        assert not DecodeGraphs.can_capture(replayed.model), "the capture failed: see the log"
        pytest.skip(f"experts without a one-kernel grouped matmul in {dtype} on this GPU")
    static = engine(tmp_path, dtype, "off")
    expected = greedy(static, prompts())
    assert greedy(replayed, prompts()) == expected
    if dtype == "float32":
        afresh = engine(tmp_path, dtype, "off")
        afresh.runner.static_decode = None
        assert greedy(afresh, prompts()) == expected


def test_verification_rows_replay_from_their_own_graphs(tmp_path):
    save_hf_model(tmp_path, transformers.LlamaConfig)
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_min_acceptance=0)
    replayed = engine(tmp_path, "float32", "auto", **spec)
    afresh = engine(tmp_path, "float32", "off", **spec)
    afresh.runner.static_decode = None
    graphs = replayed.runner.decode_graphs
    assert graphs is not None and (1, 4) in graphs.captured
    repetitive = [[5, 6, 7, 8] * 6 for _ in range(3)]
    assert greedy(replayed, repetitive) == greedy(afresh, repetitive)
