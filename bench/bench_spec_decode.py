"""Speculative decoding's gain: decode tokens/s and inter-token latency with speculation
on against off, on smollm2, at batch 1 and 8, in the same run: ngram (prompt lookup) by
default, or a draft model (``--speculative-model PATH``, named as ``--model`` is).

Two workloads. *Input-grounded*: the answer quotes a passage the prompt gives (copy it,
rewrite one name in it, extract its sentences), greedy, as summaries, edits and
extractions do: prompt lookup finds what comes next in the context. *Free text*: a story
from a one-line premise at temperature 0.8, seeded, where the context rarely predicts the
next token; the adaptive pause must keep speculation from costing time there.

Both sides decode exactly the same tokens (verification keeps speculation-off's output,
engine/spec_decode/verification.py; the script checks it) up to ``--tokens`` per request.
Decode time excludes each request's first step (its prefill). ITL is the time between a
request's successive emissions (a verified run arrives as one emission, as vLLM's
benchmark counts it); p50 / p99 over every gap. Repetitions alternate which side runs
first; medians print, with the median of the repetitions' on / off ratios. Aims (issue
28): >= 1.8x decode tokens/s at batch 1 input-grounded, >= 0.97x on free text.

With ``--early-exit-draft N`` the draft is the model's own first ``N`` layers (with its
embeddings, final norm and head), written to a temporary directory: an untrained draft,
which shows what drafting costs when its guesses are poor (the adaptive pause's job).

Then one verification forward (a last token and 4 drafts) at long contexts, on the
runner: read in place as decode rows (what the engine runs) against the same 5 tokens as
a prefill chunk continuing the context (its own split-KV plan, every row a logits row),
and one plain decode.

Run: python bench/bench_spec_decode.py [--tokens 128] [--repeat 3] [--model smollm2]
         [--speculative-model PATH | --early-exit-draft N] [--set FIELD=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_engine import hf_model

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.model_input import ScheduledChunk

PASSAGES = [
    "The river town of Alder Ford grew up around a wooden bridge built in 1820 by a miller "
    "named Tomas Greer. Barges carried wheat and timber downstream to the coast, and every "
    "spring the floods rose to the steps of the chapel. In 1891 the wooden bridge burned, "
    "and the town raised a stone one with five arches, paid for by a tax on every barrel "
    "of flour that crossed it. The mill closed in 1932, but the bridge still carries the "
    "main road, and the chapel steps still show the marks of the highest floods.",
    "To reset the controller, first switch off the main power and wait thirty seconds. "
    "Open the front panel with the hex key, locate the blue reset button beside the fuse "
    "holder, and hold it down while you switch the power back on. Keep holding the button "
    "until the status light blinks green three times, then release it. The controller "
    "restores its factory settings, so enter the network address and the schedule again "
    "before closing the panel. If the light blinks red instead, replace the fuse and repeat.",
]
GROUNDED_TASKS = [
    "Copy the passage above exactly, word for word.\nCopy:",
    "Rewrite the passage above exactly, changing nothing but the first sentence.\nRewrite:",
    "Extract the passage's sentences, one per line, unchanged.\nSentences:\n",
    "Repeat the passage above, then stop.\nRepeated passage:",
]
PREMISES = [
    "Write a short story about a lighthouse keeper who finds a map.",
    "Write a short story about a robot learning to paint.",
    "Write a short story about two rival bakers in a small town.",
    "Write a short story about a lost dog finding its way home.",
]


def grounded_prompts(count: int) -> list[str]:
    return [
        f"Passage:\n{PASSAGES[i % len(PASSAGES)]}\n\n{GROUNDED_TASKS[i % len(GROUNDED_TASKS)]}"
        for i in range(count)
    ]


def free_text_prompts(count: int) -> list[str]:
    return [PREMISES[i % len(PREMISES)] + f" (Story {i}.)" for i in range(count)]


@dataclass
class Run:
    tokens: list[list[int]]
    decode_tokens: int = 0
    decode_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


def run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> Run:
    """Runs the batch; times every step after each request's first."""
    ids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for request_id, prompt, request_params in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, request_params)
    seen = dict.fromkeys(ids, 0)
    last_emission: dict[str, float] = {}
    result = Run(tokens=[])
    finished = {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        decoded = 0
        for output in outputs:
            new = output.num_output_tokens - seen[output.request_id]
            seen[output.request_id] = output.num_output_tokens
            if output.request_id in last_emission and new:
                decoded += new
                result.gaps_s.append(now - last_emission[output.request_id])
            if new:
                last_emission[output.request_id] = now
            if output.finished:
                finished[output.request_id] = output.output_token_ids
        if decoded:
            result.decode_tokens += decoded
            result.decode_s += now - start
    result.tokens = [finished[request_id] for request_id in ids]
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="*", default=["input-grounded", "free text"])
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 4096, 8000])
    parser.add_argument("--speculative-model", help="a draft model (default: ngram drafts)")
    parser.add_argument(
        "--early-exit-draft",
        type=int,
        metavar="N",
        help="draft with the model's first N layers (written to a temporary directory)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig fields of the speculating engine (num_speculative_tokens=6, ...)",
    )
    args = parser.parse_args()
    engine_args = dict(num_kv_blocks=1024, max_num_batched_tokens=2048)
    off = LLMEngine.from_pretrained(args.model, **engine_args)
    tuning = {
        key: float(value) if "." in value else int(value)
        for key, value in (item.split("=") for item in args.set)
    }
    with tempfile.TemporaryDirectory() as directory:
        draft = args.speculative_model
        if args.early_exit_draft is not None:
            draft = write_early_exit_draft(off, args.early_exit_draft, Path(directory))
        if draft is not None:
            tuning |= dict(speculative_method="draft_model", speculative_model=draft)
        on = LLMEngine.from_pretrained(
            args.model, **{"speculative_method": "ngram", **engine_args, **tuning}
        )
    label = f"a draft model, {draft}" if draft else "ngram"
    if args.early_exit_draft is not None:
        label = f"a draft model, {args.model}'s first {args.early_exit_draft} layers"
    draft_cost = getattr(on.scheduler.proposer, "draft_cost", None)
    if draft_cost is not None:
        label += f" (a draft forward costs {draft_cost:.2f} of a decode step)"
    print(f"speculation: {label}")
    workloads = {
        "input-grounded": (grounded_prompts, dict(temperature=0.0)),
        "free text": (free_text_prompts, dict(temperature=0.8)),
    }
    print(f"{args.model}, {args.tokens} tokens per request, median of {args.repeat}")
    header = (
        f"{'workload':<15} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} "
        f"{'ITL p50 off/on ms':>18} {'ITL p99 off/on ms':>18} {'accept':>7} {'tok/step':>8}"
    )
    print(header)
    for name in args.workloads:
        make_prompts, sampling = workloads[name]
        for batch in args.batches:
            prompts = make_prompts(batch)
            params = [
                SamplingParams(max_tokens=args.tokens, seed=i, ignore_eos=True, **sampling)
                for i in range(batch)
            ]
            run(off, prompts, params), run(on, prompts, params)  # warm: caches, allocator
            runs: dict[str, list[Run]] = {"off": [], "on": []}
            before = on.stats().spec_decode
            sides = [("off", off), ("on", on)]
            for repetition in range(args.repeat):
                for side, engine in sides[:: 1 if repetition % 2 == 0 else -1]:
                    runs[side].append(run(engine, prompts, params))
            after = on.stats().spec_decode
            if runs["off"][-1].tokens != runs["on"][-1].tokens:
                raise SystemExit(f"{name} batch {batch}: speculation changed the tokens")
            rate = {s: statistics.median(r.tokens_per_s for r in runs[s]) for s in runs}
            # Each repetition's on / off, then their median: steadier than a ratio of
            # medians when the machine's speed drifts between repetitions.
            ratio = statistics.median(
                b.tokens_per_s / a.tokens_per_s for a, b in zip(runs["off"], runs["on"])
            )
            gaps = {s: [g for r in runs[s] for g in r.gaps_s] for s in runs}
            drafted = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            steps = after.num_drafts - before.num_drafts
            print(
                f"{name:<15} {batch:>5} {rate['off']:>10.1f} {rate['on']:>10.1f} "
                f"{ratio:>5.2f}x "
                f"{1e3 * percentile(gaps['off'], 0.5):>8.1f}/{1e3 * percentile(gaps['on'], 0.5):<9.1f}"
                f"{1e3 * percentile(gaps['off'], 0.99):>8.1f}/{1e3 * percentile(gaps['on'], 0.99):<9.1f}"
                f"{accepted / drafted if drafted else 0:>7.0%} "
                f"{1 + accepted / steps if steps else 1:>8.2f}"
            )
    if args.contexts:
        verification_at_long_context(args.model, args.contexts, args.repeat)


def write_early_exit_draft(engine: LLMEngine, num_layers: int, directory: Path) -> str:
    """The engine's model cut to its first ``num_layers`` layers, saved as a Hugging Face
    directory (safetensors, config, tokenizer.json) that ``--speculative-model`` loads."""
    model = hf_model(engine)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.config.eos_token_id = list(engine.model_config.eos_token_ids)
    model.save_pretrained(directory)
    engine.tokenizer.backend.save(str(directory / "tokenizer.json"))
    return str(directory)


def verification_at_long_context(model: str, contexts: list[int], repeat: int) -> None:
    """Median ms of one forward at each context: 5 tokens as decode rows, the same 5 tokens
    as a prefill chunk, one token."""
    print(f"\none forward at a long context ({model}, ms, median of {repeat})")
    print(f"{'context':>8} {'verify 1+4':>11} {'prefill':>9} {'ratio':>6} {'one decode':>11}")
    engine = LLMEngine.from_pretrained(model, num_kv_blocks=max(contexts) // 16 + 8)
    runner = engine.runner
    table = list(range(max(contexts) // 16 + 2))

    def median_ms(chunk: ScheduledChunk) -> float:
        runner.execute([chunk])  # warm
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            runner.execute([chunk])
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    tokens = [5, 6, 7, 8, 9]
    for context in contexts:
        verify = median_ms(ScheduledChunk("v", tokens, context, table, True, num_draft_tokens=4))
        prefill = median_ms(ScheduledChunk("p", tokens, context, table, True, all_logits=True))
        one = median_ms(ScheduledChunk("d", tokens[:1], context, table, True))
        print(
            f"{context:>8} {verify:>11.1f} {prefill:>9.1f} {prefill / verify:>5.2f}x {one:>11.1f}"
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
