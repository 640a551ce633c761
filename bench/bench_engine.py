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
4. ``smollm2`` at long contexts: one decode step at batch 1 and 8 x 2k and 8k tokens of
   context (random K/V in shuffled pages: a step's cost does not depend on what the K/V
   hold, and prefilling 64k tokens here would take minutes), against (a) the same attention
   over a contiguous cache, one layer, (b) transformers' forward of one token per row over
   its own cache (``DynamicCache`` holding the same context) and (c) the floor: the bytes
   that step must read (weights + K/V once) at the read bandwidth measured in the run;
   then the same steps with a float16 KV cache under the float32 model.
5. ``smollm2``: one layer's attention for a prefill chunk of ``CONTINUATION_QUERIES`` tokens
   continuing a 2k and an 8k prefix: read in place from the pages (split-KV) against the
   former way (gather the chunk's blocks, then one SDPA) and SDPA over a contiguous cache.
6. The engine's per-step overhead at batch 16: the share of ``step()`` spent outside the
   model runner's ``execute`` (scheduling, sampling, outputs), tiny and smollm2.

On a GPU, ``--device cuda`` runs 4 and 6 for a bfloat16 model of smollm2's shape with random
weights, where decodes read their pages through the Triton kernel; the long-context rows add
that kernel against the gather-then-SDPA path it replaces.

Run: python bench/bench_engine.py   (about 15 s for tiny on 2 idle cores, 4 min with smollm2;
6 GiB of memory for the 8 x 8k caches)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from random_checkpoint import save_random_checkpoint
from transformers import DynamicCache, LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from pdserve.checkpoint.model_source import builtin_gguf_path
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.model_input import ScheduledChunk
from pdserve.model.attention import AttentionMetadata, build_attention_metadata, paged_attention
from pdserve.model.model_config import ModelConfig

OUTPUT_TOKENS = 64
PROMPT_LENGTHS = (24, 40)  # each prompt's length is drawn from this range
ROUNDS = 8
PREFIX_TOKENS = 2048
SUFFIX_TOKENS = 32
SMOLLM2_PROMPT_TOKENS = 128
SMOLLM2_OUTPUT_TOKENS = 32
SMOLLM2_ROUNDS = 2
LONG_CONTEXT_SHAPES = ((1, 2048), (8, 2048), (1, 8192), (8, 8192))  # (batch, context tokens)
LONG_CONTEXT_BLOCK_SIZE = 16
# SmolLM2-135M's shape, for the GPU run's random weights.
SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192 + LONG_CONTEXT_BLOCK_SIZE,
    tie_word_embeddings=True,
)
LONG_CONTEXT_ROUNDS = 3
OVERHEAD_BATCH = 16
CONTINUATION_QUERIES = 512
CONTINUATION_PREFIXES = (2048, 8192)


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
    return model.to(engine.runner.device, engine.runner.dtype)


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
            if torch.cuda.is_initialized():  # CUDA runs asynchronously: time the work itself
                torch.cuda.synchronize()
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


def read_bandwidth(
    device: torch.device | str = "cpu", num_bytes: int = 512 * 2**20, rounds: int = 5
) -> float:
    """Bytes read per second summing a tensor much larger than the caches (one thread on CPU,
    the whole device on CUDA)."""
    source = torch.ones(num_bytes // 4, device=device)
    best = best_of(rounds, {"sum": source.sum})["sum"]
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


def bench_long_context(
    engine: LLMEngine, model: HFLlamaForCausalLM
) -> dict[tuple[int, int], dict[str, float]]:
    """Decode step at long contexts: engine vs contiguous attention, transformers and the floor;
    returns the best times by shape."""
    config, runner = engine.model_config, engine.runner
    runner.kv_cache.uniform_(-1, 1)  # any K/V: the step's cost does not depend on the values
    bandwidth, weights = read_bandwidth(runner.device), weight_bytes(engine)
    kv_token_bytes = (
        2 * config.num_layers * config.num_kv_heads * config.head_dim * runner.kv_cache.itemsize
    )
    where = "1 torch thread" if runner.device.type == "cpu" else str(runner.device)
    print(
        f"smollm2 long-context decode step, {runner.dtype} model, {LONG_CONTEXT_BLOCK_SIZE}-token "
        f"pages shuffled, {where}, best of {LONG_CONTEXT_ROUNDS}; floor = (weights + K/V) / "
        f"{bandwidth / 2**30:.1f} GiB/s"
    )
    generator = torch.Generator().manual_seed(0)
    results = {}
    for batch, context in LONG_CONTEXT_SHAPES:
        best = results[batch, context] = long_context_step(engine, batch, context, generator, model)
        floor = (weights + batch * context * kv_token_bytes) / bandwidth
        print(
            f"  {batch} x {context:5d}: engine step {best['engine'] * 1e3:7.1f} ms   "
            f"transformers {best['hf'] * 1e3:7.1f} ms ({best['hf'] / best['engine']:4.2f}x faster)   "
            f"floor {floor * 1e3:6.1f} ms ({floor / best['engine']:4.0%} of it)   attention/layer "
            f"paged {best['paged'] * 1e3:6.2f} ms vs contiguous {best['contiguous'] * 1e3:6.2f} ms "
            f"({best['paged'] / best['contiguous']:4.2f}x)"
        )
        if "gathered" in best:
            print(
                f"           in place vs gathered then SDPA (the path it replaces on "
                f"{runner.device.type}): {best['paged'] * 1e3:6.3f} vs {best['gathered'] * 1e3:6.3f} "
                f"ms ({best['gathered'] / best['paged']:4.2f}x faster)"
            )
        if all(f"{name} on the GPU" in best for name in ("paged", "gathered", "contiguous")):
            paged, gathered, contiguous = (
                best[f"{name} on the GPU"] for name in ("paged", "gathered", "contiguous")
            )
            print(
                f"           GPU time per layer (CUDA graph replays): in place {paged * 1e6:6.1f} us, "
                f"gathered {gathered * 1e6:6.1f} us ({gathered / paged:4.2f}x), contiguous SDPA "
                f"{contiguous * 1e6:6.1f} us (in place {paged / contiguous:4.2f}x)"
            )
    return results


def bench_half_kv(engine: LLMEngine, wide: dict[tuple[int, int], dict[str, float]]) -> None:
    """The same decode steps with a float16 KV cache under the float32 model, against the
    float32 cache's times from ``bench_long_context`` (half the K/V bytes read)."""
    engine.runner.kv_cache.uniform_(-1, 1)
    print("  float16 KV cache (model float32), against the float32 cache above:")
    generator = torch.Generator().manual_seed(0)
    for batch, context in LONG_CONTEXT_SHAPES:
        best = long_context_step(engine, batch, context, generator)
        float32 = wide[batch, context]
        print(
            f"  {batch} x {context:5d}: engine step {best['engine'] * 1e3:7.1f} ms "
            f"({float32['engine'] / best['engine']:4.2f}x the float32 cache's speed)   "
            f"attention/layer {best['paged'] * 1e3:6.2f} ms "
            f"({float32['paged'] / best['paged']:4.2f}x)"
        )


def step_metadata(
    engine: LLMEngine, token_counts: list[int], start_positions: list[int], tables: list[list[int]]
) -> AttentionMetadata:
    """One layer's attention metadata for chunks over ``tables``, as the engine's runner
    builds it (its split-KV budget, its dtype)."""
    runner = engine.runner
    return build_attention_metadata(
        token_counts,
        start_positions,
        tables,
        LONG_CONTEXT_BLOCK_SIZE,
        engine.model_config.num_layers,
        runner.device,
        dtype=runner.dtype,
        split_kv_keys=runner.split_kv_keys,
    )


def long_context_step(
    engine: LLMEngine,
    batch: int,
    context: int,
    generator: torch.Generator,
    model: HFLlamaForCausalLM | None = None,
) -> dict[str, float]:
    """Best times of one decode step (engine; transformers' when ``model`` is given) and one
    layer's attention (paged; over a contiguous cache when ``model`` is given) at ``batch``
    rows of ``context`` tokens each."""
    config, runner = engine.model_config, engine.runner
    position = context - 1  # the step's token; the context before it is cached
    blocks = (
        torch.randperm(runner.num_blocks - 1, generator=generator)[
            : batch * (context // LONG_CONTEXT_BLOCK_SIZE)
        ]
        + 1
    )
    tables = blocks.view(batch, -1).tolist()
    chunks = [
        ScheduledChunk(f"r{row}", [row + 3], position, table, True)
        for row, table in enumerate(tables)
    ]
    metadata = step_metadata(engine, [1] * batch, [position] * batch, tables)
    tensor = dict(device=runner.device, dtype=runner.dtype)
    query = torch.randn(batch, config.num_heads, config.head_dim, **tensor)
    key_value = torch.randn(batch, 2, config.num_kv_heads, config.head_dim, **tensor)

    def layer(metadata: AttentionMetadata) -> Callable[[], object]:
        def attend() -> None:
            with torch.inference_mode():
                paged_attention(query, key_value, runner.kv_cache, 0, metadata)

        return attend

    runs: dict[str, Callable[[], object]] = {
        "engine": lambda: runner.execute(chunks),
        "paged": layer(metadata),
    }
    if metadata.decode is not None and metadata.decode.device_key_ranges is not None:
        gathered = step_metadata(engine, [1] * batch, [position] * batch, tables)
        assert gathered.decode is not None
        gathered.decode.device_key_ranges = None  # the gather-then-SDPA path
        runs["gathered"] = layer(gathered)
    if model is not None:
        runs |= reference_runs(model, config, batch, context, query)
    best = best_of(LONG_CONTEXT_ROUNDS, runs)
    if runner.device.type == "cuda":  # the layer's GPU time alone, launches left out
        for name in ("paged", "gathered", "contiguous"):
            try:
                best[f"{name} on the GPU"] = gpu_time(runs[name])
            except (KeyError, RuntimeError) as error:  # not run here, or not capturable
                print(f"  {name}: no GPU time ({error!r})")
    return best


def gpu_time(run: Callable[[], object], replays: int = 50) -> float:
    """Seconds one call of ``run`` keeps the GPU busy: captured in a CUDA graph and replayed,
    so the host's launch overhead, which dominates a small model's step, is left out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # first call's allocations happen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def reference_runs(
    model: HFLlamaForCausalLM, config: ModelConfig, batch: int, context: int, query: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """transformers' decode step over its own cache holding ``context - 1`` tokens per row,
    and SDPA of ``query`` over a contiguous cache of ``context`` keys."""
    position = context - 1
    hf_cache = DynamicCache()
    shape = (batch, config.num_kv_heads, position, config.head_dim)
    tensor = dict(device=query.device, dtype=query.dtype)
    for layer in range(config.num_layers):
        hf_cache.update(torch.randn(shape, **tensor), torch.randn(shape, **tensor), layer)
    input_ids = torch.arange(3, 3 + batch, device=query.device)[:, None]
    position_ids = torch.full((batch, 1), position, device=query.device)

    def hf_step() -> None:
        with torch.inference_mode():
            model(input_ids, past_key_values=hf_cache, position_ids=position_ids)
        hf_cache.crop(-1)  # the next round sees the same context

    grouped = query.view(batch, config.num_kv_heads, -1, config.head_dim)
    contiguous = torch.randn(2, batch, config.num_kv_heads, context, config.head_dim, **tensor)
    return {
        "hf": hf_step,
        "contiguous": lambda: F.scaled_dot_product_attention(grouped, contiguous[0], contiguous[1]),
    }


def bench_prefill_continuation(engine: LLMEngine) -> None:
    """One layer's attention for a prefill chunk continuing a long prefix, three ways."""
    print(
        f"  prefill chunk of {CONTINUATION_QUERIES} tokens continuing a prefix, one layer, "
        f"best of {LONG_CONTEXT_ROUNDS}:"
    )
    generator = torch.Generator().manual_seed(0)
    for prefix in CONTINUATION_PREFIXES:
        best = best_of(LONG_CONTEXT_ROUNDS, continuation_runs(engine, prefix, generator))
        print(
            f"  prefix {prefix:5d}: in place {best['paged'] * 1e3:7.2f} ms   "
            f"gathered {best['gathered'] * 1e3:7.2f} ms ({best['gathered'] / best['paged']:4.2f}x slower)   "
            f"contiguous {best['contiguous'] * 1e3:7.2f} ms (in place {best['paged'] / best['contiguous']:4.2f}x)"
        )


def continuation_runs(
    engine: LLMEngine, prefix: int, generator: torch.Generator
) -> dict[str, Callable[[], object]]:
    """A chunk of ``CONTINUATION_QUERIES`` at ``prefix`` over shuffled pages: read in place
    (``paged_attention``), the former path (its blocks gathered, then one SDPA), and SDPA
    over a contiguous cache of the same keys."""
    config, runner = engine.model_config, engine.runner
    count, end = CONTINUATION_QUERIES, prefix + CONTINUATION_QUERIES
    num_blocks = end // LONG_CONTEXT_BLOCK_SIZE
    blocks = torch.randperm(runner.num_blocks - 1, generator=generator)[:num_blocks] + 1
    metadata = step_metadata(engine, [count], [prefix], [blocks.tolist()])
    query = torch.randn(count, config.num_heads, config.head_dim)
    key_value = torch.randn(count, 2, config.num_kv_heads, config.head_dim)
    visible = torch.arange(end)[None, :] <= torch.arange(prefix, end)[:, None]
    heads_first = query.transpose(0, 1)[None]
    contiguous = torch.randn(2, 1, config.num_kv_heads, end, config.head_dim)
    layer_cache = runner.kv_cache[:, 0]

    def paged() -> None:
        with torch.inference_mode():
            paged_attention(query, key_value, runner.kv_cache, 0, metadata)

    def gathered() -> None:
        keys = layer_cache[:, 0].index_select(0, blocks).flatten(0, 1).transpose(0, 1)
        values = layer_cache[:, 1].index_select(0, blocks).flatten(0, 1).transpose(0, 1)
        F.scaled_dot_product_attention(
            heads_first, keys[None], values[None], attn_mask=visible, enable_gqa=True
        )

    def over_contiguous() -> None:
        F.scaled_dot_product_attention(
            heads_first, contiguous[0], contiguous[1], attn_mask=visible, enable_gqa=True
        )

    return {"paged": paged, "gathered": gathered, "contiguous": over_contiguous}


def bench_step_overhead(engine: LLMEngine, name: str, vocab: int, rng: random.Random) -> None:
    """Share of ``engine.step()`` spent outside the runner's forward, at batch 16 decode."""
    inside = 0.0
    execute = engine.runner.execute

    def timed_execute(chunks: list[ScheduledChunk]) -> torch.Tensor:
        nonlocal inside
        start = time.perf_counter()
        logits = execute(chunks)
        inside += time.perf_counter() - start
        return logits

    prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(OVERHEAD_BATCH)]
    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        engine_generate(engine, prompts, OUTPUT_TOKENS)
        whole = time.perf_counter() - start
    finally:
        del engine.runner.execute
    print(
        f"{name}: per-step overhead outside the forward at batch {OVERHEAD_BATCH}: "
        f"{(whole - inside) / whole:5.1%} of {whole:.2f} s"
    )


def bench_smollm2() -> None:
    try:
        builtin_gguf_path("smollm2")
    except FileNotFoundError as error:
        print(f"smollm2 skipped: {error}")
        return
    longest = max(batch * context for batch, context in LONG_CONTEXT_SHAPES)
    engine = LLMEngine.from_pretrained(
        "smollm2",
        torch_threads=1,
        max_num_batched_tokens=4096,
        block_size=LONG_CONTEXT_BLOCK_SIZE,
        num_kv_blocks=longest // LONG_CONTEXT_BLOCK_SIZE + 1,
    )
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
    bench_step_overhead(engine, "smollm2", vocab, rng)
    wide = bench_long_context(engine, model)
    bench_prefill_continuation(engine)
    del engine, model  # their 3 GiB of caches and weights, before the float16-KV engine's
    half = LLMEngine.from_pretrained(
        "smollm2",
        torch_threads=1,
        block_size=LONG_CONTEXT_BLOCK_SIZE,
        num_kv_blocks=longest // LONG_CONTEXT_BLOCK_SIZE + 1,
        kv_cache_dtype="float16",
    )
    bench_half_kv(half, wide)


def bench_cuda(device: str) -> None:
    """Sections 4 and 6 on a GPU: smollm2's shape in bfloat16 with random weights (its GGUF
    is not installed there; a step's time does not depend on the weights' values)."""
    longest = max(batch * context for batch, context in LONG_CONTEXT_SHAPES)
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        checkpoint = save_random_checkpoint(HFLlamaForCausalLM(SMOLLM2_SHAPE), Path(directory))
        engine = LLMEngine.from_pretrained(
            checkpoint,
            device=device,
            dtype="bfloat16",
            max_num_batched_tokens=4096,
            block_size=LONG_CONTEXT_BLOCK_SIZE,
            num_kv_blocks=longest // LONG_CONTEXT_BLOCK_SIZE + 1,
        )
    if engine.runner.device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    model = hf_model(engine)
    engine_generate(engine, [[1, 2, 3]], 2)  # warm up (and compile the Triton kernel)
    bench_long_context(engine, model)
    vocab = engine.model_config.vocab_size
    bench_step_overhead(engine, "smollm2-shaped, bfloat16", vocab, random.Random(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu: every section; cuda: the long-context steps and the step overhead on a GPU",
    )
    device = parser.parse_args().device
    if device != "cpu":
        bench_cuda(device)
        return
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
    bench_step_overhead(engine, "tiny", engine.model_config.vocab_size, rng)
    bench_smollm2()


if __name__ == "__main__":
    main()
