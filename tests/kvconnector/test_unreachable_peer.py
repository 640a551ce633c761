"""An advertised KV address that cannot be reached: the pull fails within its deadline and
the decode side recomputes, token for token.

The unreachable peer is a listening socket on 127.0.0.7 that never accepts: the TCP
handshake completes in the kernel, then nothing answers, as behind a firewall that drops
packets (a real firewall cannot run in this sandbox). The prefill engine and its lease are
real, in their own process.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from pdserve.engine import LLMEngine, SamplingParams
from tests.kvconnector.disaggregation import (
    make_decode_engine,
    random_prompts,
    run_to_completion,
)

PULL_DEADLINE_S = 1.0


@contextlib.contextmanager
def silent_listener(host: str = "127.0.0.7") -> Iterator[str]:
    """``host:port`` of a socket that accepts TCP connections into its backlog, never more."""
    with socket.socket() as listener:
        listener.bind((host, 0))
        listener.listen(64)
        yield f"{host}:{listener.getsockname()[1]}"


def test_unreachable_advertised_address_fails_the_pull_in_its_deadline_and_recomputes(
    colocated: LLMEngine, prefill_factory
) -> None:
    """...and handshakes once: the lease's release after the failed pull goes through the
    peer the pull had (none here), never a second handshake that would hold the transfer
    thread for another deadline."""
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc", transfer_timeout_s=PULL_DEADLINE_S)
    client = decode.connector._client
    handshakes: list[str] = []
    real_handshake = client.handshake

    def counted_handshake(address: str):
        handshakes.append(address)
        return real_handshake(address)

    client.handshake = counted_handshake
    prompt = random_prompts(3, 1)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prefilled = prefill.prefill("u0", prompt, params)

    with silent_listener() as unreachable:
        prefilled.kv_transfer_params.transfer_address = unreachable
        decode.add_request("u0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
        (output,) = run_to_completion(decode, ["u0"])

    assert output.output_token_ids == colocated.generate([prompt], [params])[0].output_token_ids
    assert decode.stats().num_recompute_fallbacks == 1
    assert output.kv_provenance.num_recomputed_tokens == len(prompt)
    assert handshakes == [unreachable]
    decode.shutdown()
