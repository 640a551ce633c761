"""One serving trace, replayed against any KV ledger with vLLM's scheduler API.

The trace fixes every input up front (prompts sharing a few system prompts, each
request's output tokens), so two ledgers replaying it see the same calls as long as
they make the same decisions. The replay is a vLLM-style scheduler loop:

```
step:  running requests, in admission order: allocate_slots(chunk or 1 decode token)
           on None: preempt the newest running request (free, back to the waiting
           head) until the request fits or is itself preempted
       waiting requests, in order (none after a preemption this step):
           get_computed_blocks -> allocate_slots(first chunk, hit) -> record stats
           on None: stop admitting this step
       requests whose tokens are all computed "sample" their next token, or finish (free)
```

Every decision (admit with its hit length, preempt, finish) goes into a digest, so
equal digests mean equal decisions, call for call.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request's inputs: its prompt and the tokens it will "sample"."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class TraceShape:
    """The trace and the scheduler limits it runs under."""

    num_requests: int = 2000
    num_blocks: int = 8192
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    num_system_prompts: int = 8
    user_prompt_tokens: tuple[int, int] = (256, 3072)
    output_tokens: tuple[int, int] = (16, 160)
    seed: int = 0


def make_trace(shape: TraceShape) -> list[TraceRequest]:
    """Prompts are a shared system prompt (256, 512 or 1024 tokens) plus a user part."""
    rng = random.Random(shape.seed)
    system_prompts = [
        [rng.randrange(32000) for _ in range(rng.choice([256, 512, 1024]))]
        for _ in range(shape.num_system_prompts)
    ]
    return [
        TraceRequest(
            f"r{index}",
            rng.choice(system_prompts)
            + [rng.randrange(32000) for _ in range(rng.randint(*shape.user_prompt_tokens))],
            [rng.randrange(32000) for _ in range(rng.randint(*shape.output_tokens))],
        )
        for index in range(shape.num_requests)
    ]


class LedgerDriver(Protocol):
    """What the replay needs from one ledger implementation (pdserve's or vLLM's).

    `manager` is the ledger's `KVCacheManager`; the driver only builds requests, appends
    tokens and normalizes the prefix lookup's return value.
    """

    name: str
    manager: Any

    def new_request(self, trace_request: TraceRequest) -> Any: ...

    append_token: Callable[[Any, int], None]

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]: ...


@dataclass(slots=True)
class ReplayResult:
    seconds: float
    digest: str
    num_allocate_calls: int
    num_admissions: int
    num_preemptions: int
    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


def replay(driver: LedgerDriver, trace: list[TraceRequest], shape: TraceShape) -> ReplayResult:
    """Run the trace to the end against `driver`'s ledger; every request finishes.

    Requests are built (their prompts hashed) before the clock starts: that is the
    gateway's and the engine's work, not the ledger's. Appending a sampled token, and
    hashing the block it completes, is inside the timed loop.
    """
    manager = driver.manager
    allocate_slots = manager.allocate_slots
    free = manager.free
    append_token = driver.append_token
    digest = hashlib.blake2b(digest_size=16)
    decisions: list[str] = []
    requests = [driver.new_request(trace_request) for trace_request in trace]
    outputs = {
        request.request_id: trace_request.output_token_ids
        for request, trace_request in zip(requests, trace)
    }
    num_sampled = dict.fromkeys(outputs, 0)
    waiting = list(reversed(requests))  # the waiting queue's head is its last item
    running: list[Any] = []
    num_calls = num_admissions = num_preemptions = queried = hits = 0
    start = time.perf_counter()

    while waiting or running:
        budget = shape.max_num_batched_tokens
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            num_calls += 1
            while allocate_slots(request, num_new_tokens) is None:
                victim = running.pop()
                free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                waiting.append(victim)
                decisions.append(f"P{victim.request_id}")
                num_preemptions += 1
                preempted = True
                if victim is request:
                    break
                num_calls += 1
            else:
                request.num_computed_tokens += num_new_tokens
                budget -= num_new_tokens
                index += 1

        while waiting and budget > 0 and not preempted and len(running) < shape.max_num_seqs:
            request = waiting[-1]
            blocks, num_hit = driver.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit, budget)
            num_calls += 1
            if allocate_slots(request, num_new_tokens, num_hit, blocks) is None:
                break
            manager.record_prefix_cache_stats(request, num_hit)
            waiting.pop()
            running.append(request)
            request.num_computed_tokens = num_hit + num_new_tokens
            budget -= num_new_tokens
            num_admissions += 1
            queried += request.num_tokens
            hits += num_hit
            decisions.append(f"A{request.request_id}:{num_hit}")

        still_running = []
        for request in running:
            if request.num_computed_tokens < request.num_tokens:
                still_running.append(request)
                continue
            request_id = request.request_id
            sampled = num_sampled[request_id]
            output = outputs[request_id]
            if sampled == len(output):
                free(request)
                decisions.append(f"F{request_id}")
                continue
            append_token(request, output[sampled])
            num_sampled[request_id] = sampled + 1
            still_running.append(request)
        running = still_running
        if decisions:
            digest.update("|".join(decisions).encode())
            decisions.clear()

    seconds = time.perf_counter() - start
    if manager.block_pool.get_num_free_blocks() != shape.num_blocks - 1:
        raise RuntimeError(f"{driver.name}: blocks still referenced after every request finished")
    return ReplayResult(
        seconds, digest.hexdigest(), num_calls, num_admissions, num_preemptions, queried, hits
    )
