"""A prefill worker restarted on the same address (a fixed ``kv_transfer_port``, as the
shipped cluster configs set) must be pulled from again, without restarting the decode side.

Measured before the fix on a 1 + 1 app: over NIXL every request after the restart fell back
to recompute (0 blocks received) until the decode worker restarted, because the decode
connector kept the dead engine's handshake (its NIXL agent and pool) cached by address.
"""

from __future__ import annotations

import time

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from tests.kvconnector.disaggregation import (
    assert_decode_idle,
    disaggregate,
    make_decode_engine,
    random_prompts,
)
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.ports import free_port

PARAMS = [SamplingParams(max_tokens=4, temperature=0.0)]


def _pulled_from_a_first_prefill(
    transport: str, colocated: LLMEngine, prefill_factory, seed: int
) -> tuple:
    """A decode engine that pulled one of two prompts from a prefill on a fixed port:
    (port, decode, prompts, expected tokens of both, the prefill, the first outputs)."""
    port = free_port()
    decode = make_decode_engine(transport)
    prompts = random_prompts(seed, 2)
    expected = [o.output_token_ids for o in colocated.generate(prompts, PARAMS * 2)]
    first = prefill_factory(transport=transport, port=port, engine_id="prefill-0-first")
    before = disaggregate(first, decode, prompts[:1], PARAMS, prefix="before")
    return port, decode, prompts, expected, first, before


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_restarted_on_the_same_port_is_pulled_from_not_recomputed(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    port, decode, prompts, expected, first, before = _pulled_from_a_first_prefill(
        transport, colocated, prefill_factory, seed=21
    )
    first.close()  # the worker dies; Serve starts a new one on the same port
    second = prefill_factory(transport=transport, port=port, engine_id="prefill-0-second")
    assert second.address == first.address
    received_before = decode.stats().transfer.num_blocks_received
    after = disaggregate(second, decode, prompts[1:], PARAMS, prefix="after")

    assert [before[0].output_token_ids, after[0].output_token_ids] == expected
    stats = decode.stats()
    assert stats.num_recompute_fallbacks == 0
    assert stats.transfer.num_blocks_received > received_before
    assert_decode_idle(decode)
    second.wait_until_idle()
    decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_down_for_a_while_is_pulled_from_at_once_when_it_comes_back(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    """While the prefill is down, the decode side keeps trying it (prewarm handshakes, pulls)
    and gRPC's channel to the address backs off further with each refused connect: the
    first pull after the restart must not fail fast on that backed-off channel."""
    from pdserve.kvconnector.transport.base import TransferError

    port, decode, prompts, expected, first, _ = _pulled_from_a_first_prefill(
        transport, colocated, prefill_factory, seed=22
    )
    first.close()
    refusals = 0
    while refusals < 4:  # each refused connect lengthens the channel's reconnect backoff
        with pytest.raises(TransferError):
            decode.connector.connect(first.address)
        refusals += 1
        time.sleep(0.8)  # let the backoff run out, so the next try really connects (and fails)
    second = prefill_factory(transport=transport, port=port, engine_id="prefill-0-second")
    after = disaggregate(second, decode, prompts[1:], PARAMS, prefix="after")

    assert after[0].output_token_ids == expected[1]
    assert decode.stats().num_recompute_fallbacks == 0, "the first pull after the restart failed"
    assert_decode_idle(decode)
    second.wait_until_idle()
    decode.shutdown()
