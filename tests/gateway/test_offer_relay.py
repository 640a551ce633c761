"""``OfferRelay``, the gateway's part of a chunk-wise hand-off, against a decode worker that
stands in for the real one behind the ``WorkerPool`` surface (``call``), so that its
``pull_offer`` can fail, or be held, at a chosen moment. The real relay runs in every
chunk-wise hand-off of the service suite (tests/service/test_fault_matrix.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.offer_relay import OfferRelay
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.kv_transfer_params import KVTransferParams


class StandInDecode:
    """``pull_offer`` waits for ``release`` and then fails (``fail``) or lands its blocks."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.release = asyncio.Event()
        self.offered: list[int] = []  # num_tokens of each offer sent

    async def call(self, worker_id: str, method: str, request) -> KVProvenance:
        assert (worker_id, method) == ("decode-0", "pull_offer")
        self.offered.append(request.kv_transfer_params.num_tokens)
        await self.release.wait()
        if self.fail:
            raise ConnectionError("decode-0 died while pulling the offer")
        num_blocks = len(request.kv_transfer_params.block_ids)
        return KVProvenance(
            num_prompt_tokens=16 * num_blocks,
            num_pulled_tokens=16 * num_blocks,
            num_blocks_pulled=num_blocks,
        )


def offer(num_blocks: int) -> KVTransferParams:
    return KVTransferParams(
        engine_id="prefill-0",
        transfer_address="127.0.0.1:1",
        lease_id="lease-0",
        block_ids=list(range(num_blocks)),
        block_hashes=[b"h"] * num_blocks,
        block_checksums=[1] * num_blocks,
        num_tokens=16 * num_blocks,
        first_token_id=-1,
        sampling_seed=0,
        lease_expires_at=0.0,
        final=False,
    )


def relay_to(decode: StandInDecode) -> OfferRelay:
    return OfferRelay(decode, "decode-0", "r0", list(range(256)), None, None)  # type: ignore[arg-type]


def test_settle_waits_for_the_offer_in_flight_and_drops_the_one_waiting() -> None:
    async def scenario() -> None:
        decode = StandInDecode()
        relay = relay_to(decode)
        relay.offer(offer(4))
        relay.offer(offer(8))  # waits behind the first ...
        relay.offer(offer(12))  # ... and is replaced: it names the same blocks and more
        settling = asyncio.create_task(relay.settle(timeout_s=30))
        await asyncio.sleep(0.01)
        decode.release.set()
        totals = await settling
        assert decode.offered == [4 * 16]  # the waiting one was dropped: the hand-off names it
        assert (totals.num_offers, totals.num_blocks) == (1, 4)

    asyncio.run(scenario())


def test_an_offer_that_fails_while_the_hand_off_settles_costs_only_speed() -> None:
    """The decode worker dies during the offer's pull: ``settle`` returns (the request goes
    on to its hand-off, which the decode phase retries), not the pull's error."""

    async def scenario() -> None:
        decode = StandInDecode(fail=True)
        relay = relay_to(decode)
        relay.offer(offer(4))
        settling = asyncio.create_task(relay.settle(timeout_s=30))
        await asyncio.sleep(0.01)
        decode.release.set()
        totals = await settling
        assert totals.num_offers == 0

    asyncio.run(scenario())


def test_a_request_cancelled_while_it_settles_is_cancelled_and_the_pull_goes_on() -> None:
    """The client leaves while the gateway waits for the offer in flight: the request ends
    there (no decode stream starts); the decode worker's pull is left to finish."""

    async def scenario() -> None:
        decode = StandInDecode()
        relay = relay_to(decode)
        relay.offer(offer(4))
        in_flight = relay._in_flight
        settling = asyncio.create_task(relay.settle(timeout_s=30))
        await asyncio.sleep(0.01)
        settling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settling
        assert in_flight is not None and not in_flight.done()
        decode.release.set()
        await in_flight
        assert relay.totals.num_offers == 1

    asyncio.run(scenario())
