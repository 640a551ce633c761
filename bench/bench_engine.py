"""pdserve engine benchmark: output tokens/s of ``LLMEngine.generate`` beside transformers.

Both sides run the same weights (transformers' ``LlamaForCausalLM`` gets the engine's),
greedy, EOS ignored, one torch thread, in the same process:

1. ``tiny``, ``OUTPUT_TOKENS`` tokens per request, batch 1 and batch 16 (transformers: left
   padding plus attention mask), measured alternately engine / transformers, best of
   ``ROUNDS``; prints tokens/s and ratios, and whether the batch-1 greedy tokens are identical.
2. ``tiny``: prefill of a prompt behind a 2,048-token shared prefix: cold (nothing cached)
   vs a prefix-cache hit (only the suffix is computed).
3. ``smollm2`` (SmolLM2-135M from its GGUF, float32; skipped when not installed): the same
   comparison with 128-token prompts and 32 new tokens, then batch-1 decode tokens/s
   against the memory-bandwidth limit: every decode step reads all weights once, so it
   cannot beat ``read bandwidth / weight bytes``. The bandwidth is measured here, by one
   thread summing a tensor larger than the caches: a copy (read + write + write-allocate)
   under-states what a read-only pass such as decode can reach.

Run: python bench/bench_engine.py   (about 15 s for tiny on 2 idle cores, 90 s with smollm2)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from pdserve.checkpoint.model_source import builtin_gguf_path
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.model.model_config import ModelConfig

OUTPUT_TOKENS = 64
PROMPT_LENGTHS = (24, 40)  # each prompt's length is drawn from this range
ROUNDS = 8
PREFIX_TOKENS = 2048
SUFFIX_TOKENS = 32
SMOLLM2_PROMPT_TOKENS = 128
SMOLLM2_OUTPUT_TOKENS = 32
SMOLLM2_ROUNDS = 2


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


def hf_generate(
    model: HFLlamaForCausalLM, prompts: list[list[int]], output_tokens: int
) -> list[list[int]]:
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
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, width:].tolist()


def engine_generate(
    engine: LLMEngine, prompts: list[list[int]], output_tokens: int
) -> list[list[int]]:
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
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


def bench_throughput(
    engine: LLMEngine,
    model: HFLlamaForCausalLM,
    prompts_of_batch: Callable[[int], list[list[int]]],
    output_tokens: int,
    rounds: int,
) -> None:
    """Engine vs transformers at batch 1 and 16, side by side."""
    for batch in (1, 16):
        prompts = prompts_of_batch(batch)
        if batch == 1:
            ours = engine_generate(engine, prompts, output_tokens)
            identical = ours == hf_generate(model, prompts, output_tokens)
        best = best_of(
            rounds,
            {
                "engine": lambda prompts=prompts: engine_generate(engine, prompts, output_tokens),
                "hf": lambda prompts=prompts: hf_generate(model, prompts, output_tokens),
            },
        )
        tokens = batch * output_tokens
        ours_tps, hf_tps = tokens / best["engine"], tokens / best["hf"]
        print(
            f"batch {batch:2d}: engine {ours_tps:8.1f} tok/s   transformers {hf_tps:8.1f} tok/s   "
            f"ratio {ours_tps / hf_tps:5.2f}x"
        )
        if batch == 1:
            print(f"  batch-1 greedy tokens identical: {identical} (first: {ours[0][:12]})")


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


def read_bandwidth(num_bytes: int = 512 * 2**20, rounds: int = 5) -> float:
    """Bytes read per second by one thread summing a tensor much larger than the caches."""
    source = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        source.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every distinct weight tensor (a tied LM head is the embedding, counted once)."""
    tensors = {
        tensor.untyped_storage().data_ptr(): tensor for tensor in engine.model.state_dict().values()
    }
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def bench_decode_bandwidth(engine: LLMEngine, prompt: list[int]) -> None:
    """Batch-1 decode tokens/s (a 32-token run minus its 1-token prefill run) vs the bandwidth limit."""
    prefill = best_of(SMOLLM2_ROUNDS, {"run": lambda: engine_generate(engine, [prompt], 1)})["run"]
    whole = best_of(
        SMOLLM2_ROUNDS, {"run": lambda: engine_generate(engine, [prompt], SMOLLM2_OUTPUT_TOKENS)}
    )["run"]
    decode_tps = (SMOLLM2_OUTPUT_TOKENS - 1) / (whole - prefill)
    bandwidth, weights = read_bandwidth(), weight_bytes(engine)
    limit_tps = bandwidth / weights
    print(
        f"batch-1 decode: {decode_tps:5.1f} tok/s; limit {limit_tps:5.1f} tok/s "
        f"({weights / 2**20:.0f} MiB of weights per token at {bandwidth / 2**30:.1f} GiB/s read bandwidth): "
        f"{decode_tps / limit_tps:4.0%} of it"
    )


def bench_smollm2() -> None:
    try:
        builtin_gguf_path("smollm2")
    except FileNotFoundError as error:
        print(f"smollm2 skipped: {error}")
        return
    engine = LLMEngine.from_pretrained("smollm2", torch_threads=1, max_num_batched_tokens=4096)
    model = hf_model(engine)
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size

    def prompts_of_batch(batch: int) -> list[list[int]]:
        return [
            [rng.randrange(3, vocab) for _ in range(SMOLLM2_PROMPT_TOKENS)] for _ in range(batch)
        ]

    engine_generate(engine, [[1, 2, 3]], 2)  # warm both up
    hf_generate(model, [[1, 2, 3]], 2)
    print(
        f"smollm2 (SmolLM2-135M, GGUF dequantized to float32), {SMOLLM2_PROMPT_TOKENS}-token prompts, "
        f"{SMOLLM2_OUTPUT_TOKENS} output tokens, ignore_eos, 1 torch thread, best of {SMOLLM2_ROUNDS}"
    )
    bench_throughput(engine, model, prompts_of_batch, SMOLLM2_OUTPUT_TOKENS, SMOLLM2_ROUNDS)
    bench_decode_bandwidth(engine, prompts_of_batch(1)[0])


def main() -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    engine = LLMEngine.from_pretrained("tiny", torch_threads=1, max_num_batched_tokens=4096)
    model = hf_model(engine)
    engine_generate(engine, [[1, 2, 3]], OUTPUT_TOKENS)  # warm both up
    hf_generate(model, [[1, 2, 3]], OUTPUT_TOKENS)

    def prompts_of_batch(batch: int) -> list[list[int]]:
        return [
            [rng.randrange(256) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(batch)
        ]

    print(
        f"tiny model, greedy, {OUTPUT_TOKENS} output tokens, ignore_eos, 1 torch thread, best of {ROUNDS}"
    )
    bench_throughput(engine, model, prompts_of_batch, OUTPUT_TOKENS, ROUNDS)
    bench_prefix(engine, rng)
    bench_smollm2()


if __name__ == "__main__":
    main()
