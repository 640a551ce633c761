"""The hand-off from a prefill worker to a decode worker, as one typed message."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache import BlockHash


@dataclass(slots=True)
class KVTransferParams:
    """Where a finished prefill's KV lives and how long it is held for the decode side.

    The prefill worker returns it with the first token; the gateway passes it unchanged to the
    decode worker, whose connector pulls ``block_ids`` (minus the ones whose hash it already
    holds) before the request joins its decode batch.

        prompt:        | full block | full block | full block | partial |
        block_ids:     |     7      |     3      |     12     |    5    |
        block_hashes:  |     h0     |     h1     |     h2     |            (full blocks only)
        block_checksums: one per block id, xxh3 of the block's bytes at lease time

    With a sliding window, blocks the prefill's window had already left are the null block
    (``NULL_BLOCK_ID``, checksum 0): no token after the prompt reads them, so they are
    neither leased nor pulled, and the decode side drops its own blocks there too.

    A model of several KV groups (Gemma 3: global and windowed layers) lists each group's
    table in turn, ``num_kv_groups`` tables of one id per prompt block, by position::

        block_ids:     | g0: 7 3 12 5 | g1: 0 0 9 4 | g2: 0 0 14 8 |     (0: left the window)

    A chunk-wise hand-off (``KVConnectorConfig.chunked_handoff``) also sends *offers*
    (``final=False``) while the prompt is still being prefilled: the full blocks computed so
    far, under the lease the final hand-off will carry too. An offer has no first token
    (``first_token_id`` is -1) and its ``num_tokens`` is a whole number of blocks; the
    decode side pulls it into its prefix cache and never releases the lease for it::

        chunk 1 done ─▶ offer  [7 3]          (decode pulls 7 3 while chunk 2 computes)
        chunk 2 done ─▶ offer  [7 3 12]
        prompt done  ─▶ final  [7 3 12 5] + first token   (decode pulls only 5)

    After offers, the final hand-off may carry the pages the offers left in itself
    (``KVConnectorConfig.inline_tail_bytes``): ``tail_block_ids`` name them (the prefill's
    ids, as in ``block_ids``) and ``tail_pages`` holds their bytes, page after page. The
    decode side lands them without a read (verified against ``block_checksums``, as a pull
    is) when they hold every block it lacks; otherwise it pulls, as without them::

        prompt done  ─▶ final  [7 3 12 5] + first token, tail [5] + its page (nothing to pull)
    """

    engine_id: str
    transfer_address: str
    lease_id: str
    block_ids: list[int]
    block_hashes: list[BlockHash]
    block_checksums: list[int]
    num_tokens: int
    first_token_id: int
    sampling_seed: int
    lease_expires_at: float
    num_kv_groups: int = 1
    final: bool = True
    tail_block_ids: list[int] = field(default_factory=list)
    tail_pages: bytes = field(default=b"", repr=False)
    lora_digest: str | None = None
    """The LoRA adapter the prefill ran, by its weights' digest (``model/lora/``), or None
    (the base model): the KV was computed with it, so the decode worker must run the same
    weights (``LLMEngine.add_request`` refuses a hand-off otherwise, naming the adapter)."""
