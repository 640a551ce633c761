"""The chunk-wise hand-off's gain: how long a long prompt's hand-off keeps the second token
waiting, with offers (``chunked_handoff``) against without, with the prompt's last chunk
cut short (``final_chunk_tokens``) against the scheduler's own, and with that chunk's pages
carried in the hand-off (``inline_tail_bytes``) against pulled, in the same run.

1 + 1: a prefill engine (producer) in a child process and a decode engine (consumer) in
this one, one CPU thread each, the KV over gRPC (or ``--transport nixl``) on 127.0.0.1. The prompt is prefilled in
chunks of ``--chunk`` tokens. With offers, each chunk's full blocks are pulled by the decode
engine (as ``DecodeWorker.pull_offer``, one offer at a time, the latest waiting) while the
next chunk computes; without, every block moves after the last chunk. Four sides: *at end*
(no offers), *offers* (the last chunk as the scheduler cuts it, up to ``--chunk`` tokens),
*short end* (offers, and a last chunk of at most ``--final-chunk`` tokens, pulled) and *tail
in* (that, its pages in the hand-off when they come to at most ``--inline-tail`` bytes, the
default: no read after the prefill).

Per prompt length and side (interleaved, ``--repeat`` times, medians print):

- *prefill*: from the prefill's command to the end of its last chunk (TTFT's share here;
  a short last chunk costs one more step);
- *tail*: from the end of the prefill's last chunk (its step returned the first token) to
  the start of the decode engine's first step of the request: checksumming the final
  blocks, the hop, the offer still in flight, admission and the hand-off's pull (or the
  landing of the pages it carried);
- *blocks after*: the blocks the hand-off moved after the prefill finished, pulled or carried
  (aim: at most one chunk's), and one chunk's pull time, measured from the offers;
- *2nd token*: from the end of the last chunk to the decode engine's first token (the
  request's second), against the decode ITL at that context (the mean gap between its
  later tokens, which a colocated engine's decode steps match): aim <= 1.5x at 8k. It is
  the tail plus the first decode step (*1st step*).

The outputs of every side are checked equal.

Run: python bench/bench_chunked_handoff.py [--model tiny] [--lengths 2048 8192 16384]
[--transport grpc] [--final-chunk 64]
(smollm2 serves 8,192 positions: --model smollm2 --lengths 2048 8064). ``--model gemma3``
is a random Gemma 3 saved by transformers (tiny's width; five windowed layers of 512 tokens
to one global, as Gemma 3 has): its windowed groups offer only the window's blocks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from random_checkpoint import save_random_checkpoint

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.worker.engine_host import LEASE_POLL_S

BLOCK_SIZE = 16
GEMMA3_WINDOW = 512


def save_gemma3(directory: Path, max_len: int) -> str:
    """A random Gemma 3 text model (local and global layers, 5:1) with a word per id."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=max_len + 64,
        initializer_range=0.02,
    )
    return save_random_checkpoint(transformers.AutoModelForCausalLM.from_config(config), directory)


def _engine_kwargs(args: dict[str, Any], max_len: int) -> dict[str, Any]:
    """One prompt's blocks and some room; a windowed group's a window and a chunk more."""
    window_blocks = -(-(GEMMA3_WINDOW - 1 + args["chunk"]) // BLOCK_SIZE) + 1
    return dict(
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_len // BLOCK_SIZE + 64 + args["windowed_groups"] * window_blocks,
        max_num_batched_tokens=max(args["chunk"], 2048),
        long_prefill_token_threshold=args["chunk"],
        max_model_len=max_len + 64,
        hash_seed=0,
    )


def _prefill_main(args: dict[str, Any], conn: Any) -> None:
    """The prefill worker: prefills on command, sends each offer and the hand-off."""
    import torch

    torch.set_num_threads(1)
    connector = PDConnector(
        # loopback benchmark: no secret
        KVConnectorConfig(role="producer", transport=args["transport"], allow_insecure=True),
        engine_id="prefill-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    engine = LLMEngine.from_pretrained(
        args["model"],
        connector=connector,
        engine_id="prefill-0",
        **_engine_kwargs(args, args["max_len"]),
    )
    conn.send(connector.address)
    while True:
        # Waits for the next command; while a lease is held, steps as often as a prefill
        # worker does then (a release frees its blocks at the next step).
        if not conn.poll(LEASE_POLL_S if engine.num_leases_held else None):
            engine.step()
            continue
        command, *rest = conn.recv()
        if command == "stop":
            engine.shutdown()
            return
        request_id, prompt, (chunked, final_chunk_tokens, inline_tail_bytes) = rest
        while not engine.kv_cache_manager.reset_prefix_cache():  # each run starts cold
            engine.step()  # a lease the decode side released frees its blocks
        connector.config.chunked_handoff = chunked
        connector.config.final_chunk_tokens = final_chunk_tokens
        connector.config.inline_tail_bytes = inline_tail_bytes
        greedy = SamplingParams(max_tokens=1, temperature=0.0)  # as the decode side samples
        engine.add_request(request_id, prompt, greedy, remote_decode=True)
        done = False
        while not done:
            for output in engine.step():
                ended_at = time.perf_counter()  # the process clocks agree (CLOCK_MONOTONIC)
                params = output.kv_transfer_params
                if params is not None:
                    connector.complete_transfer_params(params)
                if params is not None and not params.final:
                    conn.send(("offer", params, ended_at))
                elif output.finished:
                    conn.send(("final", params, ended_at))
                    done = True


@dataclass
class Run:
    prefill_s: float  # from the prefill's command to its last chunk's end (TTFT's part)
    tail_s: float
    second_token_s: float
    first_step_s: float  # the decode step that emits the second token
    itl_s: float
    blocks_after: int
    num_offers: int
    offer_pull_s: float  # mean pull time of one offer (one chunk's blocks)
    tokens: list[int]


@dataclass(frozen=True)
class Side:
    """One way to hand a prompt off: offers or not, and how short its last chunk is."""

    name: str
    chunked: bool
    final_chunk_tokens: int = 0
    inline_tail_bytes: int = 0


def _run_one(
    conn: Any,
    child: Any,
    decode: LLMEngine,
    request_id: str,
    prompt: list[int],
    side: Side,
    num_tokens: int,
) -> Run:
    assert decode.kv_cache_manager.reset_prefix_cache()  # each run starts cold
    sent_at = time.perf_counter()
    conn.send(
        (
            "prefill",
            request_id,
            prompt,
            (side.chunked, side.final_chunk_tokens, side.inline_tail_bytes),
        )
    )
    in_flight: str | None = None
    waiting: KVTransferParams | None = None
    offer_pulls: list[float] = []
    num_offers = 0
    final: tuple[KVTransferParams, float] | None = None
    while final is None or in_flight is not None:
        if not child.is_alive():
            raise RuntimeError(f"the prefill process died (exit code {child.exitcode})")
        while final is None and conn.poll(
            0 if (in_flight or decode.has_unfinished_requests()) else 0.001
        ):
            kind, params, ended_at = conn.recv()
            if kind == "final":
                final = (params, ended_at)
                waiting = None  # the hand-off names its blocks too
            else:
                waiting = params
        if waiting is not None and in_flight is None:
            in_flight = f"{request_id}#offer{num_offers}"
            num_offers += 1
            decode.add_request(
                in_flight,
                prompt[: waiting.num_tokens],
                SamplingParams(max_tokens=1),
                kv_transfer_params=waiting,
            )
            waiting = None
        if decode.has_unfinished_requests():
            for output in decode.step():
                if output.request_id == in_flight and output.finished:
                    in_flight = None
                    if output.kv_provenance and output.kv_provenance.num_blocks_pulled:
                        offer_pulls.append(output.kv_provenance.transfer_s)
    params, ended_at = final
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    decode.add_request(request_id, prompt, sampling, kv_transfer_params=params)
    emitted: list[float] = []
    first_step_at: float | None = None
    first_step_s = 0.0
    output = None
    while output is None or not output.finished:
        loading = decode.scheduler.requests[request_id].num_computed_tokens < len(prompt)
        started = time.perf_counter()
        for out in decode.step():
            if out.request_id == request_id:
                output = out
                emitted.append(time.perf_counter())
        if first_step_at is None and not loading and emitted:
            first_step_at = started
            first_step_s = emitted[-1] - started
    gaps = [b - a for a, b in zip(emitted[1:], emitted[2:])]
    assert output.kv_provenance is not None and first_step_at is not None
    return Run(
        prefill_s=ended_at - sent_at,
        tail_s=first_step_at - ended_at,
        second_token_s=emitted[0] - ended_at,
        first_step_s=first_step_s,
        itl_s=statistics.mean(gaps),
        blocks_after=output.kv_provenance.num_blocks_pulled,
        num_offers=num_offers,
        offer_pull_s=statistics.mean(offer_pulls) if offer_pulls else 0.0,
        tokens=output.output_token_ids,
    )


def _row(length: int, side: Side, runs: list[Run]) -> str:
    def median(figure) -> float:
        return statistics.median(figure(run) for run in runs)

    return (
        f"{length:>7} {side.name:>10} "
        f"{1e3 * median(lambda r: r.prefill_s):>10.1f} "
        f"{1e3 * median(lambda r: r.tail_s):>9.1f} "
        f"{1e3 * median(lambda r: r.second_token_s):>10.1f} "
        f"{1e3 * median(lambda r: r.first_step_s):>10.1f} "
        f"{1e3 * median(lambda r: r.itl_s):>7.1f} "
        f"{median(lambda r: r.second_token_s / r.itl_s):>7.2f} "
        f"{median(lambda r: r.blocks_after):>12.0f} "
        f"{1e3 * median(lambda r: r.offer_pull_s):>13.1f} {median(lambda r: r.num_offers):>6.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    parser.add_argument(
        "--final-chunk",
        type=int,
        default=KVConnectorConfig(role="producer").final_chunk_tokens,
        help="the short last chunk's tokens (final_chunk_tokens) of the third side",
    )
    parser.add_argument(
        "--inline-tail",
        type=int,
        default=KVConnectorConfig(role="producer").inline_tail_bytes,
        help="the fourth side's inline_tail_bytes (the default): the last chunk's pages ride in the hand-off",
    )
    cli = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    model = cli.model
    if model == "gemma3":
        model = save_gemma3(Path(tempfile.mkdtemp(prefix="bench-gemma3-")), max(cli.lengths))
    windowed_groups = 5 if cli.model == "gemma3" else 0
    args = dict(
        model=model,
        chunk=cli.chunk,
        max_len=max(cli.lengths),
        windowed_groups=windowed_groups,
        transport=cli.transport,
    )
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_prefill_main, args=(args, child_conn), daemon=True)
    child.start()
    conn.recv()
    decode = LLMEngine.from_pretrained(
        model,
        connector=PDConnector(
            KVConnectorConfig(role="consumer", transport=cli.transport, transfer_timeout_s=120.0),
            engine_id="decode-0",
            hash_algorithm="xxh3_128",
            hash_seed=0,
        ),
        engine_id="decode-0",
        **_engine_kwargs(args, args["max_len"]),
    )
    vocab = decode.tokenizer.vocab_size
    print(
        f"model {cli.model}, chunks of {cli.chunk} tokens, {BLOCK_SIZE}-token blocks, {cli.transport}, 1 thread per engine"
    )
    print(
        f"{'prompt':>7} {'side':>10} {'prefill ms':>10} {'tail ms':>9} {'2nd tok ms':>10} {'1st step':>10} {'ITL ms':>7} {'2nd/ITL':>7} "
        f"{'blocks after':>12} {'chunk pull ms':>13} {'offers':>6}"
    )
    sides = (
        Side("at end", chunked=False),
        Side("offers", chunked=True),
        Side("short end", chunked=True, final_chunk_tokens=cli.final_chunk),
        Side(
            "tail in",
            chunked=True,
            final_chunk_tokens=cli.final_chunk,
            inline_tail_bytes=cli.inline_tail,
        ),
    )
    serial = 0
    for length in cli.lengths:
        runs: dict[Side, list[Run]] = {side: [] for side in sides}
        for repetition in range(cli.repeat):
            prompt = [(repetition * 7919 + 31 * i) % (vocab - 1) + 1 for i in range(length)]
            for side in sides if repetition % 2 == 0 else sides[::-1]:
                serial += 1
                runs[side].append(
                    _run_one(conn, child, decode, f"r{serial}", prompt, side, cli.tokens)
                )
            # The same prompt every way, each from a cold cache: the same tokens.
            tokens = {side.name: runs[side][-1].tokens for side in sides}
            assert len({tuple(t) for t in tokens.values()}) == 1, tokens
        for side in sides:
            print(_row(length, side, runs[side]))
        at_end, offers, short_end, tail_in = (runs[side] for side in sides)
        for name, after, before in (
            ("offers / at end", offers, at_end),
            ("short end / offers", short_end, offers),
            ("tail in / short end", tail_in, short_end),
        ):
            tail = statistics.median(a.tail_s / b.tail_s for a, b in zip(after, before))
            prefill = statistics.median(a.prefill_s / b.prefill_s for a, b in zip(after, before))
            print(f"{length:>7} {name}: tail {tail:.2f}x, prefill {prefill:.3f}x")
    conn.send(("stop",))
    child.join(30)
    decode.shutdown()


if __name__ == "__main__":
    main()
