"""Mixture-of-experts step cost: grouped expert compute against a dense model of the same
active width, side by side in one process.

A Qwen3-MoE model (``NUM_EXPERTS`` experts of width ``EXPERT_WIDTH``, ``TOP_K`` per token)
and a dense Qwen3 whose MLP is ``TOP_K × EXPERT_WIDTH`` wide (the parameters a token
actually uses), same attention and layers, random weights saved by transformers and loaded
by ``LLMEngine.from_pretrained``. Timed alternately, best of ``ROUNDS``: a 512-token prefill
step and a decode step at batch 16. Grouped compute should cost near the dense model (the
router and the grouping on top); computing every expert for every token would cost
``NUM_EXPERTS / TOP_K`` times the dense MLP.

On a GPU (``--device cuda``), both in bfloat16: the decode step replays its CUDA graph
(``engine/decode_graphs.py``; the experts' grouped matmul inside it), the issue's aim being
MoE/dense at most 2 there.

Run: python bench/bench_moe.py [--device cuda]   (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
import transformers
from random_checkpoint import save_random_checkpoint

from pdserve.engine import LLMEngine, SamplingParams

NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 256
SHAPE = dict(
    vocab_size=2048,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    eos_token_id=1,
)
ROUNDS = 5
PREFILL_TOKENS, DECODE_BATCH = 512, 16


def save(directory: Path, moe: bool) -> str:
    if moe:
        config = transformers.Qwen3MoeConfig(
            **SHAPE,
            intermediate_size=TOP_K * EXPERT_WIDTH,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH)
        model = transformers.Qwen3ForCausalLM(config)
    return save_random_checkpoint(model, directory)


def step_times(engine: LLMEngine) -> tuple[float, float]:
    """(one prefill step of PREFILL_TOKENS, one decode step at DECODE_BATCH), seconds."""
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("prefill", [rng.randrange(2048) for _ in range(PREFILL_TOKENS)], greedy)
    started = time.perf_counter()
    engine.step()
    prefill_s = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(DECODE_BATCH):
        engine.add_request(f"d{i}", [rng.randrange(2048) for _ in range(16)], greedy)
    engine.step()  # the prompts
    started = time.perf_counter()
    engine.step()  # one decode step for all 16
    decode_s = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return prefill_s, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (float32), or cuda (bfloat16)")
    device = parser.parse_args().device
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        engines = {
            name: LLMEngine.from_pretrained(
                save(Path(root) / name, moe=name == "moe"),
                num_kv_blocks=512,
                max_num_batched_tokens=PREFILL_TOKENS,
                enable_prefix_caching=False,
                device=device,
                dtype="float32" if device == "cpu" else "bfloat16",
            )
            for name in ("moe", "dense")
        }
        for name, engine in engines.items():
            graphs = engine.runner.decode_graphs
            print(f"{name}: decode step {'replayed from CUDA graphs' if graphs else 'eager'}")
        best = {name: [float("inf")] * 2 for name in engines}
        for _ in range(ROUNDS):
            for name, engine in engines.items():
                best[name] = [min(a, b) for a, b in zip(best[name], step_times(engine))]
    print(
        f"Qwen3-MoE {NUM_EXPERTS} experts x {EXPERT_WIDTH}, top-{TOP_K}, vs dense Qwen3 with a "
        f"{TOP_K * EXPERT_WIDTH}-wide MLP ({SHAPE['num_hidden_layers']} layers, hidden "
        f"{SHAPE['hidden_size']}, {device})"
    )
    print(f"{'step':28} {'MoE ms':>8} {'dense ms':>9} {'MoE/dense':>10}")
    for index, step in enumerate(
        (f"prefill {PREFILL_TOKENS} tokens", f"decode batch {DECODE_BATCH}")
    ):
        moe, dense = best["moe"][index] * 1e3, best["dense"][index] * 1e3
        print(f"{step:28} {moe:8.2f} {dense:9.2f} {moe / dense:10.2f}")
    print(f"(every expert for every token would be ~{NUM_EXPERTS // TOP_K}x the dense MLP)")


if __name__ == "__main__":
    main()
