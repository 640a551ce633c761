"""Decode speed of ``smollm2`` with its weights packed (``--quantization auto``: Q4_1 layers,
the Q8_0 embedding tied to the LM head) against the same file dequantized to float32
(``none``), one torch thread each, engines side by side in one process, alternating.

Printed per batch size: generated tokens per second (median of ``--repeats``) and the
ratio packed / float32, and a 512-token prefill's time. Then ``--quantization int8`` on a
float32 checkpoint (smollm2 converted by transformers from the same file and saved as an HF
folder in a temporary directory) against that checkpoint in float32, batch 1.

Then the packed engine against llama.cpp on the same file at batch 1, one thread, when
``llama-cpp-python`` is installed (``pip install -e '.[llamacpp]'``, a compile of minutes).

Measured (2026-12-05, a 2-core Sapphire Rapids with AVX-512 and AMX, one thread, 64 new
tokens, 3 repeats, other work on the second core; float16 scales, ``int4_planes.py``)::

    batch  1: auto   36.6 tok/s  none   18.3 tok/s  ratio 2.00x
    batch 16: auto  171.2 tok/s  none  106.9 tok/s  ratio 1.60x
    512-token prefill: packed 92 ms  float32 136 ms  ratio 0.68x
    a float32 checkpoint of smollm2:
    batch  1: int8   24.4 tok/s  none   17.7 tok/s  ratio 1.38x

(With bfloat16 scales, on a quieter box: 43.3 against 20.4 tok/s, 2.12x; 2.00x at batch
16.) Issue 52 quoted llama.cpp at about 58 tok/s there.

Measured (2026-12-06, a 2-core AMD EPYC with AVX2 only: no AVX-512, no AMX; the kernel's
AVX2 variant; llama.cpp 0.3.36 built here)::

    batch  1: auto   39.8 tok/s  none   23.7 tok/s  ratio 1.68x
    batch 16: auto   99.7 tok/s  none  105.7 tok/s  ratio 0.94x
    batch  1: auto   42.7 tok/s  llama.cpp   76.3 tok/s  ratio 0.56x
    512-token prefill: packed 137 ms  float32 138 ms  ratio 0.99x
    a float32 checkpoint of smollm2:
    batch  1: int8   28.9 tok/s  none   25.6 tok/s  ratio 1.13x

Measured (2026-12-06, a 2-core AMD Zen 5 with AVX-512 VNNI and VBMI, no AMX: the
integer-dot kernel over activations rounded to 16 bits, ``int4_tiles_kernel.py``)::

    batch  1: auto  101.5 tok/s  none   31.1 tok/s  ratio 3.26x
    batch 16: auto  474.8 tok/s  none  173.2 tok/s  ratio 2.74x
    batch  1: auto  106.2 tok/s  llama.cpp  125.2 tok/s  ratio 0.85x
    512-token prefill: packed 616 ms  float32 1371 ms  ratio 0.45x
    a float32 checkpoint of smollm2:
    batch  1: int8   71.9 tok/s  none   32.5 tok/s  ratio 2.21x

(With one int8 digit, as llama.cpp rounds activations, batch 1 reached 1.05x llama.cpp
and batch 16 2.74x in one run, but smollm2's perplexity rose 3.4 %: the kernel's docstring.)

Measured (2026-12-06, the same Zen 5, after the RMSNorm kernel, the scale prefetch, the
two-plane select, the int8 dot kernel and less Python per matmul; the last of four runs,
the others' ranges in brackets)::

    batch  1: auto  120.3 tok/s  none   30.4 tok/s  ratio 3.96x   [3.77-4.33x]
    batch 16: auto  497.9 tok/s  none  166.2 tok/s  ratio 3.00x   [2.96-3.03x]
    batch  1: auto  116.7 tok/s  llama.cpp  115.1 tok/s  ratio 1.01x   [0.95-1.06x]
    512-token prefill: packed 644 ms  float32 1447 ms  ratio 0.45x
    a float32 checkpoint of smollm2:
    batch  1: int8  101.4 tok/s  none   32.7 tok/s  ratio 3.10x   [2.96-3.13x]

Aims, on the Zen 5: batch 1 >= 1.0x llama.cpp (met, 1.01x, by a margin the machine's noise
crosses; 0.56x on AVX2; 0.35x when filed), batch 16 >= 3x float32 (met, 3.00x, as thinly; 1.6x
with AMX, 0.94x on AVX2, where widening every weight to float32 is the bound at 16 rows),
prefill no slower (met), int8 on a float32 checkpoint >= 2.5x (met, 3.10x, with the int8 dot
kernel; 1.1-2.2x through torch's ``_weight_int8pack_mm``).

Run: python bench/bench_packed_decode.py   (≈ 3 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.checkpoint.model_source import builtin_gguf_path
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams


def tokens_per_second(engine: LLMEngine, batch: int, new_tokens: int) -> float:
    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.generate(prompts, params)
    return batch * new_tokens / (time.perf_counter() - started)


def prefill_seconds(engine: LLMEngine, length: int, seed: int) -> float:
    """One prompt of ``length`` tokens that no earlier call sent (the prefix cache would
    serve a repeat)."""
    prompt = [1 + (13 * j + 7 * seed) % 4000 for j in range(length)]
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - started


def llama_cpp_tokens_per_second(new_tokens: int) -> float | None:
    """llama.cpp (``llama-cpp-python``, the ``llamacpp`` extra) decoding the same file from
    the same 16-token prompt at batch 1 on one thread; None where it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        model_path=str(builtin_gguf_path("smollm2")),
        n_ctx=256,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
    )
    prompt = [1 + (7 * 0 + j) % 4000 for j in range(16)]
    started = time.perf_counter()
    for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
        if count == new_tokens:
            break
    return new_tokens / (time.perf_counter() - started)


def float_checkpoint(folder: Path) -> Path:
    """smollm2 as transformers dequantizes it, saved as an HF folder (safetensors)."""
    import safetensors.torch
    import transformers

    gguf = builtin_gguf_path("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype="float32"
    )
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embedding
    safetensors.torch.save_file(state, str(folder / "model.safetensors"))
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(str(folder / "config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(str(folder))
    return folder


def compare(engines: dict[str, LLMEngine], batch: int, args: argparse.Namespace) -> None:
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            speeds[name].append(tokens_per_second(engine, batch, args.new_tokens))
    (packed_name, packed), (dense_name, dense) = (
        (name, statistics.median(values)) for name, values in speeds.items()
    )
    print(
        f"batch {batch:>2}: {packed_name} {packed:6.1f} tok/s  {dense_name} {dense:6.1f} tok/s  "
        f"ratio {packed / dense:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = dict(
        num_kv_blocks=512,
        block_size=16,
        max_num_seqs=16,
        torch_threads=1,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=512,
    )
    engines = {
        name: LLMEngine.from_pretrained("smollm2", quantization=name, **common)
        for name in ("auto", "none")
    }
    print(f"smollm2, one thread, {args.new_tokens} new tokens, median of {args.repeats}")
    for batch in (1, 16):
        compare(engines, batch, args)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(tokens_per_second(engines["auto"], 1, args.new_tokens))
        theirs.append(llama_cpp_tokens_per_second(args.new_tokens) or 0.0)
    if all(theirs):
        packed, reference = statistics.median(ours), statistics.median(theirs)
        print(
            f"batch  1: auto {packed:6.1f} tok/s  llama.cpp {reference:6.1f} tok/s  "
            f"ratio {packed / reference:.2f}x"
        )
    else:
        print("llama.cpp: not installed (pip install -e '.[llamacpp]', a compile of minutes)")
    times: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            times[name].append(prefill_seconds(engine, 512, repeat))
    packed, dense = (statistics.median(times[name]) for name in ("auto", "none"))
    print(
        f"512-token prefill: packed {1e3 * packed:.0f} ms  float32 {1e3 * dense:.0f} ms  "
        f"ratio {packed / dense:.2f}x"
    )
    del engines
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = str(float_checkpoint(Path(folder)))
        float_engines = {
            name: LLMEngine.from_pretrained(checkpoint, quantization=name, **common)
            for name in ("int8", "none")
        }
        print("a float32 checkpoint of smollm2:")
        compare(float_engines, 1, args)


if __name__ == "__main__":
    main()
