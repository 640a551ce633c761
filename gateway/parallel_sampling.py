"""``n`` samples of one prompt (OpenAI's ``n``): one prefill, one lease, ``n`` decodes.

    choice 0:       the usual phases: prefill ─▶ hand-off (lease) ─▶ decode on worker D
    choice i ≥ 1:   once choice 0 streams from D, the same prompt on D with its own seed;
                    D's prefix cache holds every full prompt block (choice 0 pulled them),
                    so each choice recomputes only the prompt's partial last block (a whole
                    block when the prompt is block-aligned: the last token needs its logits)

Seeds: ``seed + i`` when the client gave ``seed`` (so ``n=3, seed=s`` equals three
requests with seeds ``s, s+1, s+2``), else one random seed per choice. Choices stream
interleaved, each delta tagged with its index, as OpenAI's do. A choice whose worker is
lost moves on as a single request would (choice 0 by the decode phase's replay, the others
as requests run whole); a choice that still fails fails the request: its siblings are
cancelled (their worker streams abort on the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncGenerator

from pdserve.gateway.orchestrator import RequestOrchestrator, RequestRun
from pdserve.gateway.request_timeline import RequestTimeline
from pdserve.gateway.stream_emitter import StreamDelta, StreamEmitter
from pdserve.messages.lora_adapters import LoRAAdapterRef
from pdserve.messages.sampling_params import SamplingParams

MAX_SEED = 2**63
_FINISHED = object()


def choice_params(
    params: SamplingParams, n: int, client_seed: int | None, rng: random.Random
) -> list[SamplingParams]:
    """Each choice's params: ``params`` (already seeded) first, then the siblings'."""
    siblings = [
        dataclasses.replace(
            params,
            seed=(client_seed + i) % MAX_SEED if client_seed is not None else rng.getrandbits(63),
            prompt_logprobs=None,
        )  # choice 0 brings the prompt's
        for i in range(1, n)
    ]
    return [params, *siblings]


async def generate_choices(
    orchestrator: RequestOrchestrator,
    request_id: str,
    token_ids: list[int],
    params: list[SamplingParams],
    cache_salt: str | None,
    timeout_s: float | None = None,
    lora: LoRAAdapterRef | None = None,
) -> AsyncGenerator[tuple[int, StreamDelta], None]:
    """``(choice index, delta)`` of every choice, interleaved as they arrive; all of them
    end by one deadline (``timeout_s``, else the service's); ``lora``: the adapter they
    run."""
    first = await orchestrator.new_run(
        request_id, token_ids, params[0], cache_salt, orchestrator.deadline_for(timeout_s), lora
    )
    if len(params) == 1:
        async for delta in orchestrator.run_phases(first):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(0, orchestrator.run_phases(first), queue))]
    tasks.append(asyncio.create_task(_start_siblings(orchestrator, first, params, tasks, queue)))
    pending = len(params)
    try:
        while pending:
            index, item = await queue.get()
            if item is _FINISHED:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _start_siblings(
    orchestrator: RequestOrchestrator,
    first: RequestRun,
    params: list[SamplingParams],
    tasks: list[asyncio.Task],
    queue: asyncio.Queue,
) -> None:
    """Waits until choice 0's KV sits in its final worker's cache, then starts the rest."""
    await first.final_stream_started.wait()
    for index in range(1, len(params)):
        stream = _sibling(orchestrator, first, index, params[index])
        tasks.append(asyncio.create_task(_pump(index, stream, queue)))


async def _sibling(
    orchestrator: RequestOrchestrator, first: RequestRun, index: int, params: SamplingParams
) -> AsyncGenerator[StreamDelta, None]:
    """Choice ``index``: the prompt run whole where choice 0 streams from, as a request
    run whole on a decode worker is (``RequestOrchestrator.prefill``). So a worker lost
    mid-way is replaced as it would be for that request: the choice runs again where the
    prompt's prefix is held best (or on the lost worker, restarted), same seed, the
    replay's first tokens checked against those sent and not sent again."""
    run = RequestRun(
        f"{first.request_id}-{index}",
        first.token_ids,
        params,
        first.cache_salt,
        first.block_hashes,
        emitter=StreamEmitter(
            params.stop, len(first.token_ids), orchestrator.metrics, first.emitter.start
        ),
        timeline=RequestTimeline(first.emitter.start),
        remote_decode=False,
        lora=first.lora,
        deadline=first.deadline,
        whole_on=first.serving_worker,  # its cache holds every full block of the prompt
    )
    async for delta in orchestrator.prefill(run):
        yield delta


async def _pump(
    index: int, stream: AsyncGenerator[StreamDelta, None], queue: asyncio.Queue
) -> None:
    try:
        async for delta in stream:
            await queue.put((index, delta))
        await queue.put((index, _FINISHED))
    except Exception as error:  # noqa: BLE001 — handed to the consumer, which re-raises it
        await queue.put((index, error))
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()
