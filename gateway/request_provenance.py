"""Where one request's KV came from, merged at the gateway, and the last N of them.

Each worker sends its own account (``KVProvenance``) in its last chunk; the gateway adds what
only it knows (the lease it handed over, TTFT, inter-token latency, end to end) and keeps the
most recent requests for ``GET /v1/requests/{id}``, the dashboard and the response itself.

A request's prompt is accounted twice, once per worker, and each account adds up to the
prompt's tokens::

    prefill worker:  | prefill_cache_hit | prefill_computed |
    decode worker:   | decode_cache_hit | pulled_early | pulled | decode_recomputed | decode_prefilled |
                       held already       offers, while  from     after a failed     no KV was
                       (dedup)            the prompt     the      or skipped pull    offered
                                          prefilled      hand-off

``pulled_early`` is what a chunk-wise hand-off's offers brought to the decode worker's cache
before the prefill finished (``KVProvenance.num_pulled_early_tokens``).

A request answered whole by the prefill worker (colocated, or ended by its first token) has
no decode account. vLLM's three sources describe the engine that replied: the decode worker
when there is one, else the prefill worker.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.offer_relay import OfferTotals
from pdserve.messages.kv_provenance import KVProvenance

KV_SOURCES = (
    "prefill_cache_hit",
    "prefill_tier_hit",
    "prefill_computed",
    "decode_cache_hit",
    "decode_tier_hit",
    "pulled_early",
    "pulled",
    "decode_recomputed",
    "decode_prefilled",
)
# vLLM's labels, plus one for a KV tier below the pool: its loads moved nothing between
# workers, so they are neither a local cache hit of the pool nor an external transfer.
VLLM_SOURCES = ("local_compute", "local_cache_hit", "local_kv_tier", "external_kv_transfer")


@dataclass(slots=True)
class RequestProvenance:
    """One finished request: its prompt's KV by source, the workers and the timing."""

    request_id: str
    created: float  # Unix seconds when the gateway took the request
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    block_size: int
    prefill: KVProvenance | None
    decode: KVProvenance | None
    handed_off: bool  # the decode worker was handed the prefill's lease (never its id)
    offers: OfferTotals | None  # a chunk-wise hand-off's pulls before the prefill finished
    ttft_s: float
    itl_s: float  # mean time between output tokens after the first
    e2e_s: float
    timeline: dict[str, Any] | None = None  # RequestTimeline.to_json(): the first tokens' way

    def tokens_by_kv_source(self) -> dict[str, int]:
        """The prompt's tokens by ``KV_SOURCES`` (each worker's account adds up to the prompt).

        A decode worker computes a prompt from scratch either because no KV was offered
        (``decode_prefilled``) or because the gateway skipped an offered pull (a replay after
        the first decode worker was lost): that is ``decode_recomputed``."""
        counts = dict.fromkeys(KV_SOURCES, 0)
        if self.prefill is not None:
            counts["prefill_cache_hit"] = self.prefill.num_cache_hit_tokens
            counts["prefill_tier_hit"] = self.prefill.num_tier_tokens
            counts["prefill_computed"] = self.prefill.num_computed_tokens
        if self.decode is not None:
            skipped = self.decode.num_computed_tokens if self.handed_off else 0
            counts["decode_cache_hit"] = self.decode.num_cache_hit_tokens
            counts["pulled_early"] = self.decode.num_pulled_early_tokens
            counts["decode_tier_hit"] = self.decode.num_tier_tokens
            counts["pulled"] = self.decode.num_pulled_tokens
            counts["decode_recomputed"] = self.decode.num_recomputed_tokens + skipped
            counts["decode_prefilled"] = self.decode.num_computed_tokens - skipped
        return counts

    def tokens_by_vllm_source(self) -> dict[str, int]:
        """vLLM's ``prompt_tokens_by_source``, from the engine that replied."""
        replying = self.decode or self.prefill
        if replying is None:
            return dict.fromkeys(VLLM_SOURCES, 0)
        return {
            "local_compute": replying.num_computed_tokens + replying.num_recomputed_tokens,
            "local_cache_hit": replying.num_cache_hit_tokens,
            "local_kv_tier": replying.num_tier_tokens,
            "external_kv_transfer": replying.num_pulled_tokens + replying.num_pulled_early_tokens,
        }

    def to_json(self) -> dict[str, Any]:
        """The response's ``kv_provenance`` object and a ``/v1/requests`` entry."""
        decode, offers = self.decode, self.offers or OfferTotals()
        return {
            "request_id": self.request_id,
            "created": self.created,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "block_size": self.block_size,
            "prompt_tokens_by_source": self.tokens_by_kv_source(),
            "prefill": _worker_json(self.prefill),
            "decode": _worker_json(decode),
            "transfer": {
                "handed_off": self.handed_off,
                "num_blocks": decode.num_blocks_pulled if decode else 0,
                "num_bytes": decode.num_bytes_pulled if decode else 0,
                "seconds": decode.transfer_s if decode else 0.0,
                # Pulled by a chunk-wise hand-off's offers, before the prefill finished (the
                # three above: by the hand-off, after it).
                "num_offers": offers.num_offers,
                "num_blocks_early": offers.num_blocks,
                "num_bytes_early": offers.num_bytes,
                "seconds_early": offers.transfer_s,
            },
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "e2e_s": self.e2e_s,
            "timeline": self.timeline,
        }


def _worker_json(provenance: KVProvenance | None) -> dict[str, Any] | None:
    return None if provenance is None else dataclasses.asdict(provenance)


class RecentRequests:
    """The provenance of the last ``capacity`` finished requests, by id; oldest go first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(
                f"the recent-requests store needs a capacity of at least 1, got {capacity}"
            )
        self.capacity = capacity
        self._records: OrderedDict[str, RequestProvenance] = OrderedDict()

    def add(self, record: RequestProvenance) -> None:
        self._records[record.request_id] = record
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, request_id: str) -> RequestProvenance | None:
        return self._records.get(request_id)

    def latest(self, limit: int) -> list[RequestProvenance]:
        """Up to ``limit`` records, newest first."""
        newest = reversed(self._records.values())
        return [record for _, record in zip(range(max(limit, 0)), newest)]
