"""The decode step three ways, side by side: eager, static buffers, and (on CUDA) graphs.

For each batch, one decode step of ``batch`` rows, each over ``context`` tokens of random K/V
in shuffled pages, timed through the runner's ``execute`` (what the engine calls):

* **eager**: the step built afresh (``model/attention.py``: index tensors from lists, plans);
* **static**: the persistent buffers of ``engine/static_decode_batch.py`` (one packed copy),
  the forward run eagerly over them;
* **graph** (CUDA): the same buffers, the forward replayed from its CUDA graph
  (``engine/decode_graphs.py``).

Each also runs its forward alone (the metadata built beforehand), so the share of a step
spent outside the forward, the host's own work, is printed: the issue's aim is at most 3 %
on CPU. On CUDA the step is set against the floor (weights and K/V read once at the read
bandwidth measured here, ``bench_engine.read_bandwidth``) and transformers' forward over its static cache; a bfloat16 model of
smollm2's shape and one of Llama-3.2-1B's, random weights. On CPU the model is smollm2 from
its GGUF (float32), skipped when not installed.

Run: python bench/bench_decode_step.py [--device cuda]   (CPU: about a minute)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_engine import SMOLLM2_SHAPE, best_of, read_bandwidth, weight_bytes
from random_checkpoint import save_random_checkpoint
from transformers import LlamaConfig, StaticCache
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from pdserve.checkpoint.model_source import builtin_gguf_path
from pdserve.engine import LLMEngine
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner

BLOCK_SIZE = 16
CPU_SHAPES = ((1, 512), (16, 512))  # (batch, context tokens)
CUDA_SHAPES = ((1, 2048), (8, 2048), (32, 2048), (64, 2048))
ROUNDS = 5
STEPS_PER_ROUND = 20
SHAPES = {
    "smollm2": SMOLLM2_SHAPE,
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}


def decode_chunks(runner: ModelRunner, batch: int, context: int) -> list[ScheduledChunk]:
    """``batch`` decode rows at position ``context - 1`` over shuffled pages (none is block
    0, the null block padded rows use)."""
    per_row = context // BLOCK_SIZE
    generator = torch.Generator().manual_seed(batch)
    blocks = torch.randperm(runner.num_blocks - 1, generator=generator)[: batch * per_row] + 1
    return [
        ScheduledChunk(f"r{row}", [row + 3], context - 1, table, True)
        for row, table in enumerate(blocks.view(batch, per_row).tolist())
    ]


def best_per_step(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best seconds per call of each run: ``bench_engine.best_of`` (alternating, CUDA
    synchronised) over ``ROUNDS`` rounds of ``STEPS_PER_ROUND`` calls each, each call waited
    for, after one warm-up call (a step is short: one call alone would time the timer)."""
    for run in runs.values():
        run()

    def repeated(run: Callable[[], object]) -> Callable[[], None]:
        def calls() -> None:
            for _ in range(STEPS_PER_ROUND):
                run()
                if torch.cuda.is_initialized():  # as the engine's sampling waits each step
                    torch.cuda.synchronize()

        return calls

    best = best_of(ROUNDS, {name: repeated(run) for name, run in runs.items()})
    return {name: seconds / STEPS_PER_ROUND for name, seconds in best.items()}


def step_runs(runner: ModelRunner, chunks: list[ScheduledChunk]) -> dict[str, Callable[[], object]]:
    """The step and its forward alone, eager, static and (where captured) replayed."""
    static, graphs = runner.static_decode, runner.decode_graphs
    assert static is not None, "the bench needs the runner's static decode batch"

    def eager_step() -> None:
        runner.static_decode, runner.decode_graphs = None, None
        try:
            runner.execute(chunks)
        finally:
            runner.static_decode, runner.decode_graphs = static, graphs

    eager_forward = eager_forward_of(runner, chunks)
    padded = static.padded_size(len(chunks))

    def static_step() -> None:
        runner.decode_graphs = None
        try:
            runner.execute(chunks)
        finally:
            runner.decode_graphs = graphs

    def static_forward() -> None:
        runner.padded_decode_forward(padded, 1)

    def static_fill() -> None:
        static.fill(chunks)

    runs = {
        "eager step": eager_step,
        "eager forward": eager_forward,
        "static step": static_step,
        "static forward": static_forward,
        "static fill": static_fill,
    }
    if graphs is not None:
        runs["graph step"] = lambda: runner.execute(chunks)
        runs["graph replay"] = lambda: graphs.replay(padded, 1)
    return runs


def eager_forward_of(runner: ModelRunner, chunks: list[ScheduledChunk]) -> Callable[[], None]:
    """The eager step's forward, its metadata and inputs built once beforehand."""
    captured: dict[str, tuple] = {}
    forward = runner._forward

    def capture(*args: object) -> torch.Tensor:
        captured["args"] = args
        return forward(*args)  # type: ignore[arg-type]

    static, graphs = runner.static_decode, runner.decode_graphs
    runner.static_decode, runner.decode_graphs = None, None
    runner._forward = capture  # type: ignore[method-assign]
    try:
        runner.execute(chunks)
    finally:
        del runner._forward
        runner.static_decode, runner.decode_graphs = static, graphs
    args = captured["args"]
    return lambda: forward(*args)


def report(name: str, batch: int, context: int, best: dict[str, float]) -> None:
    line = f"  {name} {batch:2d} x {context}:"
    for mode in ("eager", "static", "graph"):
        if f"{mode} step" not in best:
            continue
        step = best[f"{mode} step"]
        # The static step's host work is its fill (the same for a replay), timed alone:
        # smaller than the noise of a difference of two step times.
        outside = best["static fill"] if mode != "eager" else step - best["eager forward"]
        line += f"  {mode} {step * 1e3:7.3f} ms (outside the forward {outside / step:5.1%})"

    line += f"   static {best['eager step'] / best['static step']:4.2f}x eager"
    if "graph step" in best:
        line += f", graph {best['eager step'] / best['graph step']:4.2f}x eager"
    print(line)


def bench_cpu() -> None:
    torch.set_num_threads(1)
    try:
        builtin_gguf_path("smollm2")
    except FileNotFoundError as error:
        print(f"smollm2 skipped: {error}")
        return
    longest = max(batch * context for batch, context in CPU_SHAPES)
    engine = LLMEngine.from_pretrained(
        "smollm2", torch_threads=1, block_size=BLOCK_SIZE, num_kv_blocks=longest // BLOCK_SIZE + 2
    )
    runner = engine.runner
    runner.kv_cache.uniform_(-1, 1)
    print(
        "smollm2 (GGUF, float32), CPU, 1 torch thread: one decode step, best of "
        f"{ROUNDS} x {STEPS_PER_ROUND}"
    )
    for batch, context in CPU_SHAPES:
        report(
            "smollm2",
            batch,
            context,
            best_per_step(step_runs(runner, decode_chunks(runner, batch, context))),
        )


def bench_cuda(device: str) -> None:
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    longest = max(batch * context for batch, context in CUDA_SHAPES)
    for name, shape in SHAPES.items():
        with tempfile.TemporaryDirectory() as directory:
            torch.manual_seed(0)
            checkpoint = save_random_checkpoint(HFLlamaForCausalLM(shape), Path(directory))
            started = time.perf_counter()
            engine = LLMEngine.from_pretrained(
                checkpoint,
                device=device,
                dtype="bfloat16",
                block_size=BLOCK_SIZE,
                num_kv_blocks=longest // BLOCK_SIZE + 2,
            )
            print(f"{name}: engine up in {time.perf_counter() - started:.1f} s", end="")
        runner = engine.runner
        graphs = runner.decode_graphs
        if graphs is not None:
            print(
                f", graphs captured in {graphs.capture_seconds:.1f} s, "
                f"{graphs.memory_bytes / 2**20:.0f} MiB"
            )
        else:
            print(", no graphs")
        runner.kv_cache.uniform_(-1, 1)
        bandwidth = read_bandwidth(runner.device)
        weights = weight_bytes(engine)
        reference = HFLlamaForCausalLM(shape).to(device=device, dtype=torch.bfloat16).eval()
        for batch, context in CUDA_SHAPES:
            chunks = decode_chunks(runner, batch, context)
            runs = step_runs(runner, chunks)
            try:  # transformers' cache API moves between releases
                runs["transformers"] = hf_static_step(reference, batch, context)
                runs["transformers"]()
            except (TypeError, ValueError, RuntimeError) as error:
                runs.pop("transformers", None)
                print(f"  transformers' static cache: not run ({error!r})")
            best = best_per_step(runs)
            report(name, batch, context, best)
            kv_bytes = batch * context * runner.kv_cache[0, :, :, 0].nbytes
            floor = (weights + kv_bytes) / bandwidth
            fastest = min(best.get("graph step", float("inf")), best["static step"])
            line = f"      floor {floor * 1e3:6.3f} ms (step {fastest / floor:4.1f}x it)"
            if "transformers" in best:
                hf = best["transformers"]
                line += f", transformers static cache {hf * 1e3:7.3f} ms ({hf / fastest:4.1f}x)"
            print(line)
        del engine, runner, reference
        torch.cuda.empty_cache()


def hf_static_step(model: HFLlamaForCausalLM, batch: int, context: int) -> Callable[[], object]:
    """transformers' one-token step per row over its static cache holding ``context - 1``."""
    cache = StaticCache(config=model.config, max_cache_len=context)
    device = model.device
    input_ids = torch.full((batch, 1), 3, device=device)
    position = torch.full((batch, 1), context - 1, device=device)
    cache_position = torch.tensor([context - 1], device=device)

    def step() -> None:
        with torch.inference_mode():
            model(
                input_ids,
                past_key_values=cache,
                position_ids=position,
                cache_position=cache_position,
                use_cache=True,
            )

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n]")
    device = parser.parse_args().device
    if device == "cpu":
        bench_cpu()
    else:
        bench_cuda(device)


if __name__ == "__main__":
    main()
