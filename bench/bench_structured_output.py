"""Structured outputs' cost: decode tokens/s with a JSON-schema request against an
unconstrained one, on smollm2, at batch 1 and 16, in the same run; and grammar compile
time cold against cached.

Both sides decode exactly ``--tokens`` tokens per request (``ignore_eos``), and the schema
is an array of at least 1,000 objects, so the grammar never completes early and the batch
stays full: the difference is the mask (llguidance's fill, the unpack and the -inf fill in
the sampler, the matcher's advance). Repetitions alternate the two sides; medians print
with the ratio constrained / unconstrained (1.0 = free; the aim is ≥ 0.90 at batch 16).

Run: python bench/bench_structured_output.py [--tokens 48] [--repeat 3] [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.grammar import GrammarCompiler, GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "ok"],
            },
        }
    },
    "required": ["rows"],
}
PROMPT = "List the rows of the inventory table as JSON: "


def decode_tokens_per_s(engine: LLMEngine, batch: int, tokens: int, structured: bool) -> float:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA)) if structured else None
    params = [
        SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True, structured=spec)
        for i in range(batch)
    ]
    # Distinct prompts (no prefix sharing between sides); the prefill is timed apart.
    prompts = [f"{PROMPT}#{i} {'s' if structured else 'u'}" for i in range(batch)]
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(batch)]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    generated = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if all(len(o.output_token_ids) > 1 for o in outputs):  # a decode step
            decode_s += elapsed
            generated += len(outputs)
    return generated / decode_s


def compile_times(engine: LLMEngine) -> tuple[float, float]:
    """Seconds to compile the schema into a fresh compiler, then to fetch it cached."""
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(
        tokenizer.backend, engine.model_config.vocab_size, tokenizer.eos_token_ids
    )
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiler.matcher(GrammarSpec("regex", "a"))  # builds the llguidance tokenizer first
    start = time.perf_counter()
    compiler.matcher(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(spec)
    return cold, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engine = LLMEngine.from_pretrained(args.model, num_kv_blocks=1024)
    print(f"model {args.model}: {args.tokens} decode tokens per request, {args.repeat} repetitions")
    for batch in (1, 16):
        decode_tokens_per_s(engine, batch, 4, True)  # warm both paths
        decode_tokens_per_s(engine, batch, 4, False)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeat):
            for structured in (False, True):
                runs[structured].append(decode_tokens_per_s(engine, batch, args.tokens, structured))
        free, masked = statistics.median(runs[False]), statistics.median(runs[True])
        print(
            f"batch {batch:2d}: unconstrained {free:7.1f} tok/s   json schema {masked:7.1f} tok/s"
            f"   ratio {masked / free:.3f}"
        )
    cold, cached = compile_times(engine)
    print(
        f"grammar compile: cold {1000 * cold:.2f} ms, cached {1000 * cached:.3f} ms "
        f"(ratio {cold / cached:.0f}x)"
    )


if __name__ == "__main__":
    main()
