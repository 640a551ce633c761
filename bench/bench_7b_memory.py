"""Does a 7B model's 4-bit GGUF fit a small worker? Load it packed, measure its memory, decode.

The file: a Llama-2-7B-shaped GGUF (32 layers, hidden 4096, intermediate 11008, vocabulary
32,000, 32 KV heads: 6.7 B weights), every 2-D weight Q4_K (embedding tied to the head), written by the test suite's own generator and
filled with random blocks (``tests/deploy/small_gguf.py``): no download. A child process
loads it with ``--quantization auto`` (the packed planes of ``model/quantization/``) and a
64-block KV pool, then decodes; its memory comes from ``/proc/self/status`` (peak ``VmHWM``;
``RssAnon``: what the process itself holds; ``RssFile``: the file's pages it has mapped,
which the kernel may drop). Dequantized to float32 the same weights would need ≈ 27 GB,
more than this 24 GiB machine has. Aim (issue 52): a worker of at most 8 GiB RSS that
decodes.

Run: python bench/bench_7b_memory.py   (≈ 4 minutes and 4 GB of disk in /tmp)

Measured (2026-12-06, this 2-core box, one torch thread, one run):
    | file     | load  | RSS after load (anon + file) | peak RSS | decode tok/s (batch 1) |
    | 3.46 GiB | 118 s | 5.12 GiB (5.02 + 0.09)       | 7.86 GiB | 0.79                   |
The anonymous 5.02 GiB: the packed planes (≈ 3.85 GiB: 4 bits a weight and a float16 scale
and offset per 32) and the 64-block KV pool (1.0 GiB: 32 layers x 32 KV heads x 128 x fp32
x 1,024 tokens). The peak adds the file's pages, mapped while the tensors are read. Before
``model/freed_memory.py`` the load also kept its freed temporaries: an 8-KV-head variant of
this file (3.04 GiB) held 5.72 GiB anonymous after its load, about 1.9 GiB of them freed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo: tests' generator

from gguf import GGMLQuantizationType as Quant

from tests.deploy.small_gguf import fill_q4_k_blocks, write_sparse_gguf

SHAPE = dict(num_layers=32, hidden=4096, intermediate=11008, vocab=32000, num_kv_heads=32)
GIB = 1 << 30


def memory() -> dict[str, int]:
    """This process's VmHWM, VmRSS, RssAnon and RssFile in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def child(path: str, num_tokens: int) -> None:
    """Loads the model, decodes ``num_tokens`` greedy tokens at batch 1, prints a JSON line."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.messages.sampling_params import SamplingParams

    started = time.perf_counter()
    engine = LLMEngine.from_pretrained(path, num_kv_blocks=64, block_size=16)
    loaded_s = time.perf_counter() - started
    after_load = memory()
    prompt = list(range(10, 42))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    (output,) = engine.generate(
        [prompt], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    )
    decode_s = time.perf_counter() - started
    print(
        json.dumps(
            {
                "load_s": loaded_s,
                "after_load": after_load,
                "after_decode": memory(),
                "tokens": len(output.output_token_ids),
                "decode_s": decode_s,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama-7b-shaped-q4_k.gguf"
        started = time.perf_counter()
        write_sparse_gguf(path, weight_type=Quant.Q4_K, **SHAPE)
        fill_q4_k_blocks(path)
        file_bytes = path.stat().st_size
        print(f"wrote {file_bytes / GIB:.2f} GiB in {time.perf_counter() - started:.0f} s")
        run = subprocess.run(
            [sys.executable, __file__, "--child", str(path), "--tokens", str(args.tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    loaded, decoded = report["after_load"], report["after_decode"]
    print("| file | load | RSS after load (anon + file) | peak RSS | decode tok/s (batch 1) |")
    print("|---|---|---|---|---|")
    print(
        f"| {file_bytes / GIB:.2f} GiB | {report['load_s']:.0f} s | "
        f"{loaded['VmRSS'] / GIB:.2f} GiB ({loaded['RssAnon'] / GIB:.2f} + "
        f"{loaded['RssFile'] / GIB:.2f}) | {decoded['VmHWM'] / GIB:.2f} GiB | "
        f"{report['tokens'] / report['decode_s']:.2f} |"
    )
    print(f"aim: peak RSS <= 8 GiB: {'met' if decoded['VmHWM'] <= 8 * GIB else 'not met'}")


if __name__ == "__main__":
    main()
