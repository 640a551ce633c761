"""Workers' chunks → what the client gets next: each token and each character sent once.

A request's output comes from up to three streams in turn (the prefill worker's first
token, the decode worker's stream that repeats it, a replay after a lost decode worker):

    sent to client:    t0 t1 t2 t3
    decode stream:     t0 t1 t2 t3 t4 t5     (repeats t0; on replay repeats t0..t3)
                       └── checked ──┘ └ new ┘

Text that could still become a stop string is held back until it cannot, so a streamed
reply equals the non-streamed one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.request_provenance import RequestProvenance
from pdserve.messages.generation import GenerationChunk, StopReason
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.tokenizer.detokenizer import stop_safe_length


class ReplayDiverged(Exception):
    """A retried request's tokens differ from those already sent to the client."""


@dataclass(slots=True)
class StreamDelta:
    """What the client gets next: new tokens and text; ``finish_reason``, ``stop_reason``
    (vLLM's: the stop string or token id met, or why the grammar ended it) and the request's
    ``kv_provenance`` on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: StopReason = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_provenance: RequestProvenance | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token, when asked
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # once, when asked


class StreamEmitter:
    """Merges a request's worker streams into one client stream, and times it.

    ``restart_stream`` starts reading a new worker stream from its first token; what was
    already sent is compared, not sent again.
    """

    def __init__(
        self, stops: list[str], num_prompt_tokens: int, metrics: GatewayMetrics, start: float
    ) -> None:
        self.stops = stops
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = metrics
        self.start = start
        self.first_token_time: float | None = None
        self.last_token_time = start
        self.sent_tokens = 0
        self.sent_token_ids: list[int] = []
        self.sent_chars = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] = []  # until sent with a delta
        self.restart_stream()

    def restart_stream(self) -> None:
        self.stream_tokens: list[int] = []
        self.stream_logprobs: list[TokenLogprobs | None] = []
        self.stream_text = ""

    def update(self, chunk: GenerationChunk, final: bool) -> StreamDelta | None:
        """The delta ``chunk`` adds (None if nothing can be sent yet); ``final``: this
        stream's finish is the request's (False for a prefill that hands off to decode)."""
        # Only this chunk's tokens that fall on already-sent ones are compared: the stream's
        # earlier ones were compared by earlier chunks (O(new), not O(history), per chunk).
        checked = len(self.stream_tokens)
        self.stream_tokens.extend(chunk.new_token_ids)
        overlap = min(len(self.stream_tokens), self.sent_tokens)
        self.stream_logprobs.extend(chunk.new_logprobs)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.stream_text += chunk.text_delta
        if self.stream_tokens[checked:overlap] != self.sent_token_ids[checked:overlap]:
            raise ReplayDiverged(
                f"tokens {self.stream_tokens[checked:overlap]} at {checked}.. where "
                f"{self.sent_token_ids[checked:overlap]} were sent"
            )
        if chunk.new_token_ids and not self.sent_tokens:
            # The stream that brings the first token computed the prompt: its prefix hit is
            # the request's (a decode worker's own hit saved a pull, not the prompt's compute;
            # taking the larger one counted a prompt-logprobs request's as cached).
            self.num_cached_tokens = chunk.num_cached_tokens
        finished = chunk.finished and final
        new_tokens = self.stream_tokens[self.sent_tokens :]
        new_logprobs = self.stream_logprobs[self.sent_tokens :]
        end = len(self.stream_text) if finished else stop_safe_length(self.stream_text, self.stops)
        new_text = self.stream_text[self.sent_chars : end] if end > self.sent_chars else ""
        if not new_tokens and not new_text and not finished:
            return None
        now = time.perf_counter()
        if new_tokens:
            self._time_tokens(len(new_tokens), now)
        self.sent_tokens += len(new_tokens)
        self.sent_token_ids.extend(new_tokens)
        self.sent_chars += len(new_text)
        reason = chunk.finish_reason if finished else None
        if finished:
            self.metrics.record_finished(
                reason or "unknown", now - self.start, self.num_prompt_tokens
            )
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, []
        return StreamDelta(
            new_tokens,
            new_text,
            reason,
            chunk.stop_reason if finished else None,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def ttft_s(self) -> float:
        return 0.0 if self.first_token_time is None else self.first_token_time - self.start

    def mean_itl_s(self) -> float:
        """Mean time between the tokens after the first (0 for a one-token reply)."""
        if self.first_token_time is None or self.sent_tokens < 2:
            return 0.0
        return (self.last_token_time - self.first_token_time) / (self.sent_tokens - 1)

    def _time_tokens(self, num_tokens: int, now: float) -> None:
        if self.sent_tokens == 0:
            self.first_token_time = now
            self.metrics.record_first_token(now - self.start)
            num_tokens -= 1
        if num_tokens:
            after_second = self.sent_tokens >= 2
            self.metrics.record_tokens(num_tokens, now - self.last_token_time, after_second)
        self.last_token_time = now
