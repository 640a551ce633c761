"""What LoRA adapters cost a decode step: ``smollm2`` at batch 16, every row under one of 4
adapters of rank 16 (all seven projections of every layer), against the same 16 rows on the
base model alone, one engine, alternating, one thread; on the packed base (``auto``: Q4_1)
and on the float32 one (``none``); and the time to load an adapter.

The adapters are random PEFT folders written here (``lora_A`` / ``lora_B`` tensors under
PEFT's names, an ``adapter_config.json``): a step's cost does not depend on the values.
Issue 55's aim: the adapters' step at most 1.3x the base's.

Measured (2026-12-06, a 2-core AMD Zen 5, one thread, 32 new tokens, medians of 3; two runs)::

    auto base, batch 16, 4 adapters of rank 16: 413.7 tok/s; base alone 514.6 tok/s; step
        time 1.24x the base's (1.22x in the other run); loading an adapter 21 ms
    none base, batch 16, 4 adapters of rank 16: 145.0 tok/s; base alone 158.3 tok/s; step
        time 1.09x the base's (1.04x); loading an adapter 21 ms

The aim is met over both bases since the CPU kernel (``model/lora/lora_kernel.py``) runs a
site's products in one call; with torch's batched matmuls (a site's A side by side) the
packed base's step was 1.34x-1.51x, with one batched matmul per part 1.44x, with one small
matmul per adapter and part 1.69x. 4 adapters of rank 16 on every projection are 29 MB each in
float32, together more bytes than smollm2's 4-bit weights: what is left is mostly their
streaming from memory.

Run: python bench/bench_lora.py   (≈ 1 minute)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model.lora.peft_adapter import TARGETS, LoRAAdapter


def write_adapter(folder: Path, model: torch.nn.Module, rank: int, seed: int) -> Path:
    """A random rank-``rank`` PEFT adapter of every target of every layer of ``model``."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for target in TARGETS:
            holder = (
                layer.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            )
            linear = getattr(holder, target)
            name = f"base_model.model.model.layers.{index}.{'self_attn' if holder is layer.self_attn else 'mlp'}.{target}"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, linear.in_features, generator=generator) / 30
            )
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(linear.out_features, rank, generator=generator) / 30
            )
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def tokens_per_second(engine: LLMEngine, names: list[str | None], new_tokens: int) -> float:
    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(len(names))]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.generate(prompts, params, lora_names=names)
    return len(names) * new_tokens / (time.perf_counter() - started)


def compare(quantization: str, args: argparse.Namespace) -> None:
    """The adapters' step against the base's, on smollm2 held as ``quantization`` says."""
    common = dict(
        num_kv_blocks=512,
        torch_threads=1,
        max_num_seqs=16,
        max_lora_rank=args.rank,
        quantization=quantization,
    )
    base = LLMEngine.from_pretrained("smollm2", **common)
    with tempfile.TemporaryDirectory() as directory:
        folders = {
            f"a{i}": write_adapter(Path(directory) / f"a{i}", base.model, args.rank, i)
            for i in range(4)
        }
        started = time.perf_counter()
        LoRAAdapter.load("a0", folders["a0"], base.model, args.rank)
        load_s = time.perf_counter() - started
        engine = LLMEngine.from_pretrained(
            "smollm2", lora_modules={n: str(p) for n, p in folders.items()}, **common
        )
    del base
    adapters = [f"a{i % 4}" for i in range(16)]
    speeds: dict[str, list[float]] = {"adapters": [], "base": []}
    for _ in range(args.repeats):
        speeds["adapters"].append(tokens_per_second(engine, adapters, args.new_tokens))
        speeds["base"].append(tokens_per_second(engine, [None] * 16, args.new_tokens))
    with_adapters, alone = (statistics.median(speeds[k]) for k in ("adapters", "base"))
    print(
        f"{quantization:>4} base, batch 16, 4 adapters of rank {args.rank}: "
        f"{with_adapters:.1f} tok/s; base alone {alone:.1f} tok/s; step time "
        f"{alone / with_adapters:.2f}x the base's; loading an adapter {1e3 * load_s:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    for quantization in ("auto", "none"):
        compare(quantization, args)


if __name__ == "__main__":
    main()
