"""What the engine reports about a request after a step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.request_stamps import RequestStamps
from pdserve.messages.generation import StopReason
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.logprobs import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step; ``output_token_ids``, ``output_logprobs`` and ``text``
    are cumulative, or with ``delta`` only what is new since the request's previous output
    (``LLMEngine.step(delta=True)``; then ``prompt_logprobs`` come once).
    ``num_output_tokens`` is the cumulative count either way.

    A running request's ``text`` holds back a tail that may begin a stop string
    (``IncrementalDetokenizer.stable_length``): text once reported is never taken back, so
    each cumulative ``text`` extends the one before and the deltas add up to the final text.

    ``kv_transfer_params`` is set on a prefill worker's request that finished with its blocks
    held under a lease for a decode worker. ``kv_provenance`` is set on a finished request
    that was admitted: where its prompt's KV came from. ``stamps`` is the request's own
    record (not a copy: outputs stay in the engine's process) of its way to a first token.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int = 0
    error: str | None = None
    stop_reason: StopReason = None
    kv_transfer_params: KVTransferParams | None = None
    kv_provenance: KVProvenance | None = None
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # when asked
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # when asked
    stamps: RequestStamps | None = None
    delta: bool = False
    num_output_tokens: int = 0

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output for this one and the ``later`` output of the same request: the later's
        state, with both deltas joined (a cumulative later output is already the sum)."""
        if not later.delta:
            return later
        return dataclasses.replace(
            later,
            output_token_ids=self.output_token_ids + later.output_token_ids,
            output_logprobs=self.output_logprobs + later.output_logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            text=self.text + later.text,
            # An offer is superseded by anything later: the next offer, or the hand-off (or
            # its absence, when the first token ended the request).
            kv_transfer_params=later.kv_transfer_params
            or (self.kv_transfer_params if _final(self.kv_transfer_params) else None),
        )


def _final(params: KVTransferParams | None) -> bool:
    return params is not None and params.final
