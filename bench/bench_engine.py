"""pdserve engine benchmark: output tokens/s of ``LLMEngine.generate`` beside transformers.

Both sides run the built-in ``tiny`` model (transformers' ``LlamaForCausalLM`` gets the
same weights), greedy, ``OUTPUT_TOKENS`` tokens per request with EOS ignored, one torch
thread, in the same process:

1. batch 1 and batch 16 (transformers: left padding plus attention mask), measured
   alternately engine / transformers, best of ``ROUNDS``; prints tokens/s and ratios,
   and whether the batch-1 greedy tokens are identical.
2. prefill of a prompt behind a 2,048-token shared prefix: cold (nothing cached) vs a
   prefix-cache hit (only the suffix is computed).

Run: python bench/bench_engine.py   (about 15 s on 2 idle cores, 40 s on a busy machine)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.model_config import ModelConfig

OUTPUT_TOKENS = 64
PROMPT_LENGTHS = (24, 40)  # each prompt's length is drawn from this range
ROUNDS = 8
PREFIX_TOKENS = 2048
SUFFIX_TOKENS = 32


def hf_model(engine: LLMEngine) -> HFLlamaForCausalLM:
    """transformers' Llama holding the engine's weights (same HF parameter names)."""
    config: ModelConfig = engine.model_config
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = HFLlamaForCausalLM(hf_config).eval()
    # The engine fused its projections at load, but its state_dict keeps the HF names.
    model.load_state_dict(engine.model.state_dict(), strict=True)
    return model


def hf_generate(model: HFLlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy generation of a left-padded batch; the new tokens of each row."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=OUTPUT_TOKENS,
            min_new_tokens=OUTPUT_TOKENS,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, width:].tolist()


def engine_generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.output_token_ids for out in engine.generate(prompts, params)]


def best_of(rounds: int, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best wall time of each run, measured alternately so noise hits both sides alike."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_throughput(engine: LLMEngine, model: HFLlamaForCausalLM, rng: random.Random) -> None:
    first_rows = []
    for batch in (1, 16):
        prompts = [
            [rng.randrange(256) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(batch)
        ]
        if batch == 1:
            ours, theirs = engine_generate(engine, prompts), hf_generate(model, prompts)
            first_rows = [ours[0] == theirs[0], ours[0][:12]]
        best = best_of(
            ROUNDS,
            {"engine": lambda: engine_generate(engine, prompts), "hf": lambda: hf_generate(model, prompts)},
        )
        tokens = batch * OUTPUT_TOKENS
        ours_tps, hf_tps = tokens / best["engine"], tokens / best["hf"]
        print(
            f"batch {batch:2d}: engine {ours_tps:8.0f} tok/s   transformers {hf_tps:8.0f} tok/s   "
            f"ratio {ours_tps / hf_tps:5.2f}x"
        )
        if batch == 1:
            print(f"  batch-1 greedy tokens identical: {first_rows[0]} (first: {first_rows[1]})")


def bench_prefix(engine: LLMEngine, rng: random.Random) -> None:
    """Cold prefill of prefix+suffix vs the same prefix cached and a new suffix."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold, hit = float("inf"), float("inf")
    for _ in range(ROUNDS):
        prefix = [rng.randrange(256) for _ in range(PREFIX_TOKENS)]
        suffixes = [[rng.randrange(256) for _ in range(SUFFIX_TOKENS)] for _ in range(2)]
        start = time.perf_counter()
        engine.generate([prefix + suffixes[0]], params)
        cold = min(cold, time.perf_counter() - start)
        start = time.perf_counter()
        out = engine.generate([prefix + suffixes[1]], params)[0]
        hit = min(hit, time.perf_counter() - start)
        cached = out.num_cached_tokens
    print(
        f"prefill {PREFIX_TOKENS}+{SUFFIX_TOKENS} tokens: cold {cold * 1e3:7.1f} ms   "
        f"prefix hit {hit * 1e3:6.1f} ms ({cached} cached)   speedup {cold / hit:5.1f}x"
    )


def main() -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    engine = LLMEngine.from_pretrained("tiny", torch_threads=1, max_num_batched_tokens=4096)
    model = hf_model(engine)
    engine_generate(engine, [[1, 2, 3]])  # warm both up
    hf_generate(model, [[1, 2, 3]])
    print(f"tiny model, greedy, {OUTPUT_TOKENS} output tokens, ignore_eos, 1 torch thread, best of {ROUNDS}")
    bench_throughput(engine, model, rng)
    bench_prefix(engine, rng)


if __name__ == "__main__":
    main()
