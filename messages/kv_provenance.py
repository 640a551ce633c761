"""Where one worker got the KV of a request's prompt: worker → gateway, in the last chunk."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVProvenance:
    """One worker's account of a request's prompt tokens, by where their KV came from.

    The six token counts add up to ``num_prompt_tokens``; they lie in this order along the
    prompt::

        prompt: | cache hit | tier hit | pulled early | pulled | recomputed | computed |
                  held in     loaded     pulled by      arrived   the peer     no peer offered
                  the pool    intact     offers while   intact    offered it,  any: computed
                  (dedup)     from this  the prompt     from the  its pull     here from scratch
                              worker's   prefilled      peer      failed
                              KV tier    (chunk-wise
                                         hand-off)

    *Pulled early* blocks were in the pool when the hand-off came (its pull skipped them):
    the request's offers had landed them there. The ledger marks such blocks with the
    offers' lease (``KVCacheBlock.pulled_early_for``), so the engine counts the hand-off's
    hit on them apart from its cache hits, here and in its prefix-cache stats.

    A prefill (or colocated) worker only hits (pool or tier) and computes. ``num_blocks_pulled`` and
    ``num_bytes_pulled`` count what landed, as the worker's transfer counters do, so the
    requests' figures add up to the counters' growth (but for a pull cut off by an error: it
    reports none of the bytes that landed before it broke). The engine fills the counts; the
    worker's host adds who it is (``worker_id``, ``role``, ``node_ip``) before sending.
    """

    num_prompt_tokens: int
    num_cache_hit_tokens: int = 0
    num_tier_tokens: int = 0
    num_pulled_early_tokens: int = 0
    num_pulled_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_computed_tokens: int = 0
    num_blocks_pulled: int = 0
    num_bytes_pulled: int = 0
    transfer_s: float = 0.0
    worker_id: str = ""
    role: str = ""
    node_ip: str = ""
