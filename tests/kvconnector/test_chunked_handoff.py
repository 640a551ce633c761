"""The chunk-wise hand-off between two real engines: a prefill engine (producer, its
transfer service on 127.0.0.1) whose prompt is prefilled in chunks, and a decode engine
(consumer) that pulls each chunk's offer while the later chunks compute, over real gRPC
and NIXL.

What it proves: the decode engine's output equals a colocated engine's token for token
(greedy and seeded); the final hand-off pulls only the blocks no offer brought, one block
where the prompt's last chunk is cut short (``final_chunk_tokens``); a prefill
preempted after its offers resumes from the blocks they named (the lease pins them), also when its offer is checksummed late; a
prompt that ends at its first token, or a full decode pool, leaves nothing held on either
side.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import transformers

from pdserve.cache import NULL_BLOCK_ID
from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_transfer_params import KVTransferParams
from tests.engine.hf_models import GEMMA3, save_hf_model
from tests.kvconnector.disaggregation import (
    assert_decode_idle,
    make_decode_engine,
    run_to_completion,
)
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

BLOCK_SIZE = ENGINE_KWARGS["block_size"]
CHUNK = 64  # tokens per prefill step: a 200-token prompt takes four


def make_prefill_engine(
    transport: str = "grpc",
    model: str = "tiny",
    connector_options: dict[str, object] | None = None,
    **overrides: object,
) -> LLMEngine:
    connector = PDConnector(
        KVConnectorConfig(
            role="producer", transport=transport, allow_insecure=True, **(connector_options or {})
        ),
        engine_id="prefill-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    kwargs = {**ENGINE_KWARGS, "max_num_batched_tokens": CHUNK, **overrides}
    return LLMEngine.from_pretrained(
        model, connector=connector, hash_seed=0, engine_id="prefill-0", **kwargs
    )


@dataclasses.dataclass
class HandOff:
    first: RequestOutput  # the prefill's last output: the first token, the hand-off
    offers: list[KVTransferParams]
    offer_outputs: list[RequestOutput]  # the decode side's KV-only requests, as they ended


def prefill_chunkwise(
    prefill: LLMEngine,
    decode: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    between_steps=None,
) -> HandOff:
    """Prefills ``prompt`` in chunks; each offer goes to ``decode`` as a KV-only request,
    one at a time (as the gateway sends them to ``DecodeWorker.pull_offer``)."""
    producer = prefill.connector
    prefill.add_request(
        request_id, prompt, dataclasses.replace(params, max_tokens=1), remote_decode=True
    )
    offers: list[KVTransferParams] = []
    ended: list[RequestOutput] = []
    first: RequestOutput | None = None
    pending: KVTransferParams | None = None  # the latest offer not sent yet
    in_flight: str | None = None

    def send_pending() -> None:
        nonlocal pending, in_flight
        if pending is not None and in_flight is None:  # one offer at a time, the latest
            in_flight = f"{request_id}#offer{len(offers)}"
            offers.append(pending)
            decode.add_request(
                in_flight,
                prompt[: pending.num_tokens],
                SamplingParams(max_tokens=1),
                kv_transfer_params=pending,
            )
            pending = None

    while first is None or in_flight is not None:
        # A chunk computes for far longer than its blocks take to pull: the prefill steps on
        # once the offer in flight has landed, so each chunk's offer is its own.
        if first is None and in_flight is None:
            for output in prefill.step():
                params_out = output.kv_transfer_params
                if params_out is not None:
                    producer.complete_transfer_params(params_out)  # the worker's stream does
                if params_out is not None and not params_out.final:
                    pending = params_out
                elif output.finished:
                    first = output
            if between_steps is not None:
                between_steps()
        send_pending()
        for output in decode.step():
            if output.request_id == in_flight and output.finished:
                ended.append(output)
                in_flight = None
        if first is None:
            send_pending()
    assert first is not None
    return HandOff(first, offers, ended)


def wait_prefill_idle(prefill: LLMEngine, timeout_s: float = 10.0) -> None:
    """Steps the prefill engine (a release arrives over gRPC) until it holds nothing."""
    deadline = time.monotonic() + timeout_s
    while prefill.num_leases_held or prefill.kv_cache_manager.usage:
        assert time.monotonic() < deadline, "the prefill engine still holds blocks or leases"
        prefill.step()
        time.sleep(0.005)


def first_offer(
    prefill: LLMEngine, request_id: str, prompt: list[int], min_tokens: int = 1
) -> KVTransferParams:
    """Prefills ``prompt`` (handed off) until an offer of at least ``min_tokens`` goes out,
    checksummed as the worker's stream does; the request goes on prefilling."""
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1), remote_decode=True)
    while True:
        for output in prefill.step():
            offer = output.kv_transfer_params
            if offer is not None and offer.num_tokens >= min_tokens:
                return prefill.connector.complete_transfer_params(offer)


def pull_offer(
    decode: LLMEngine, offer_id: str, prompt: list[int], offer: KVTransferParams
) -> RequestOutput:
    """Runs ``offer`` as the decode worker's KV-only request ``offer_id`` to its end."""
    decode.add_request(
        offer_id, prompt[: offer.num_tokens], SamplingParams(max_tokens=1), kv_transfer_params=offer
    )
    (output,) = run_to_completion(decode, [offer_id])
    return output


def decode_equals_colocated(
    prefill: LLMEngine,
    decode: LLMEngine,
    colocated: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    handoff: KVTransferParams | None,
) -> RequestOutput:
    """Decodes the handed-off request, checks its tokens against the colocated engine's,
    and checks that neither side holds a block or a lease afterwards."""
    decode.add_request(request_id, prompt, params, kv_transfer_params=handoff)
    return finish_as_colocated(prefill, decode, colocated, request_id, prompt, params)


def finish_as_colocated(
    prefill: LLMEngine,
    decode: LLMEngine,
    colocated: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> RequestOutput:
    """``decode_equals_colocated`` for a request the decode engine has already."""
    (output,) = run_to_completion(decode, [request_id])
    (expected,) = colocated.generate([prompt], [params])
    assert output.output_token_ids == expected.output_token_ids
    wait_prefill_idle(prefill)
    assert_decode_idle(decode)
    return output


@pytest.fixture(scope="module")
def colocated() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", **{**ENGINE_KWARGS, "max_num_batched_tokens": CHUNK})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_offers_are_pulled_while_prefilling_and_the_output_equals_colocated(
    transport: str, colocated: LLMEngine
) -> None:
    prefill = make_prefill_engine(transport)
    decode = make_decode_engine(transport)
    try:
        prompt = [(7 * i + 3) % 256 for i in range(200)]
        for index, params in enumerate(
            [
                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
            ]
        ):
            # Another prompt each time, so no block is in the decode cache beforehand.
            prompt = [(token + 31 * index) % 256 for token in prompt]
            (expected,) = colocated.generate([prompt], [params])
            request_id = f"r{index}"
            handoff = prefill_chunkwise(prefill, decode, request_id, prompt, params)
            # Three chunks end mid-prompt: offers of 4, 8 and 12 blocks, in one lease.
            assert [o.num_tokens for o in handoff.offers] == [64, 128, 192]
            assert len({o.lease_id for o in handoff.offers}) == 1
            assert [len(o.block_ids) for o in handoff.offers] == [4, 8, 12]
            pulled = [o.kv_provenance.num_blocks_pulled for o in handoff.offer_outputs]
            assert pulled == [4, 4, 4], pulled  # each offer pulled only its new blocks
            final = handoff.first.kv_transfer_params
            assert final is not None and final.final
            assert final.lease_id == handoff.offers[0].lease_id
            assert final.block_ids[:12] == handoff.offers[-1].block_ids
            decode.add_request(request_id, prompt, params, kv_transfer_params=final)
            (output,) = run_to_completion(decode, [request_id])
            assert output.output_token_ids == expected.output_token_ids
            provenance = output.kv_provenance
            # The offers' 192 tokens were in the decode cache; only the last block moved.
            # They are a transfer made early, not a reuse of the cache: no cache hit, for
            # the client (cached_tokens) nor for the prefix-cache stats.
            assert provenance.num_pulled_early_tokens == 192
            assert provenance.num_cache_hit_tokens == 0 and output.num_cached_tokens == 0
            assert provenance.num_blocks_pulled == 1
            assert provenance.num_pulled_tokens == 200 - 192
        stats = decode.stats()
        assert stats.prefix_cache_queries > 0 and stats.prefix_cache_hits == 0
        # A later request on the same prompt reuses those blocks: a cache hit like any.
        (again,) = decode.generate([prompt], [SamplingParams(max_tokens=1)])
        assert again.num_cached_tokens == 192 and again.kv_provenance.num_pulled_early_tokens == 0
        transfer = decode.stats().transfer
        assert transfer.num_failed_transfers == 0
        wait_prefill_idle(prefill)
        assert_decode_idle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


class ClientSpy:
    """Records the real client's reads (whether each releases its lease) and release calls,
    then makes them."""

    def __init__(self, decode: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        client = decode.connector._transfer_client
        self.reads_releasing: list[bool] = []
        self.releases: list[str] = []
        real_read, real_release = client.read_blocks, client.release

        def read_blocks(*args, release_lease: bool = False):
            self.reads_releasing.append(release_lease)
            return real_read(*args, release_lease=release_lease)

        def release(peer, lease_id: str) -> None:
            self.releases.append(lease_id)
            real_release(peer, lease_id)

        monkeypatch.setattr(client, "read_blocks", read_blocks)
        monkeypatch.setattr(client, "release", release)


def run_hand_off_step_by_step(
    prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[KVTransferParams, list[tuple[bool, int]]]:
    """Prefills ``prompt`` chunk-wise, then decodes its hand-off one step at a time; each
    decode step's (whether the prefill still held the lease after it, tokens so far). After
    the last one, the lease is waited for (up to 10 s) rather than looked at once."""
    handoff = prefill_chunkwise(prefill, decode, "r0", prompt, params)
    assert [o.num_tokens for o in handoff.offers] == [64, 128, 192, 224]
    final = handoff.first.kv_transfer_params
    assert final is not None and final.final and final.num_tokens == 240
    with pytest.raises(ValueError, match="still held for a decode worker"):
        prefill.add_request("r0", prompt, params)  # its blocks wait under the lease
    decode.add_request("r0", prompt, params, kv_transfer_params=final)
    trace = []
    for step in range(3):  # the load, then two decode steps
        outputs = decode.step()
        deadline = time.monotonic() + (10.0 if step == 2 else 0.05)
        while True:  # a release sent in the step reaches the prefill within 50 ms here
            prefill.step()
            if not prefill.num_leases_held or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        tokens = sum(len(o.output_token_ids) for o in outputs if o.request_id == "r0")
        trace.append((prefill.num_leases_held > 0, tokens))
    return final, trace


# A 240-token prompt in chunks of 64 would end with a 48-token chunk (three blocks after
# the prefill); final_chunk_tokens=16 cuts it at token 224, so the chunk before moves as an
# offer and one block is left for the hand-off.
SHORT_END = {"final_chunk_tokens": 16}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_short_final_chunk_leaves_one_block_for_the_hand_off_which_carries_it(
    transport: str, colocated: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-off carries the block's page (``inline_tail_bytes``): the decode engine
    lands it at admission with no read, and the request decodes at the next step. The
    lease is released as the second decode step ends, not beside the first. The colocated
    engine's chunks end at 240 and the tokens are the same. (A negative
    ``final_chunk_tokens`` or ``inline_tail_bytes`` is refused.)"""
    for option in ("final_chunk_tokens", "inline_tail_bytes"):
        with pytest.raises(ValueError, match=option):
            KVConnectorConfig(role="producer", **{option: -1})
    prefill = make_prefill_engine(transport, connector_options=SHORT_END)
    decode = make_decode_engine(transport)
    spy = ClientSpy(decode, monkeypatch)
    try:
        prompt = [(11 * i + 2) % 256 for i in range(240)]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        final, trace = run_hand_off_step_by_step(prefill, decode, prompt, params)
        page_bytes = decode.connector._kv_pages.page_bytes
        assert len(final.tail_block_ids) == 1 and len(final.tail_pages) == page_bytes
        assert final.tail_block_ids == final.block_ids[14:]  # the block the offers left
        # Landed in the first step, decoded in the next two; the lease held until the
        # second decode step ended, off the second token's path.
        assert trace == [(True, 0), (True, 2), (False, 3)]
        assert spy.releases == [final.lease_id]
        assert spy.reads_releasing == [False] * 4  # the offers' reads only
        output = finish_as_colocated(prefill, decode, colocated, "r0", prompt, params)
        assert output.kv_provenance.num_pulled_early_tokens == 224
        assert output.kv_provenance.num_blocks_pulled == 1
        # The offers' 14 blocks were read; the tail's one was not, and is counted apart.
        transfer = decode.stats().transfer
        assert transfer.num_blocks_received == 14 == prefill.stats().transfer.num_blocks_sent
        assert transfer.num_blocks_received_in_handoff == 1
        assert transfer.num_successful_transfers == 4  # the offers' reads only
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    "inline_tail_bytes",
    [0, 65535],  # off; a byte under tiny's page (64 KiB): nothing fits
    ids=["off", "over-the-bound"],
)
def test_a_tail_not_carried_is_pulled_by_the_read_that_releases_the_lease(
    inline_tail_bytes: int, colocated: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-off's read releases the lease itself: no release call follows it, and the
    prefill engine frees everything once the load is over."""
    options = {**SHORT_END, "inline_tail_bytes": inline_tail_bytes}
    prefill = make_prefill_engine(connector_options=options)
    decode = make_decode_engine()
    spy = ClientSpy(decode, monkeypatch)
    try:
        prompt = [(11 * i + 2) % 256 for i in range(240)]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        final, trace = run_hand_off_step_by_step(prefill, decode, prompt, params)
        assert final.tail_block_ids == [] and final.tail_pages == b""
        assert not trace[-1][0]  # the read released the lease
        output = finish_as_colocated(prefill, decode, colocated, "r0", prompt, params)
        assert output.kv_provenance.num_blocks_pulled == 1
        assert spy.reads_releasing == [False] * 4 + [True]
        assert spy.releases == []
        assert decode.stats().transfer.num_blocks_received_in_handoff == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_tail_that_fails_its_checksum_or_reaches_a_decode_engine_without_the_offers_is_pulled(
    colocated: LLMEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A page changed on the way is caught where it lands and read from the lease instead;
    a decode engine that pulled none of the offers (a retry on another worker) lacks more
    than the tail and pulls the whole prompt. Both decode as the colocated engine does."""
    prefill = make_prefill_engine(connector_options=SHORT_END)
    decode = make_decode_engine()
    other = make_decode_engine()
    spy = ClientSpy(decode, monkeypatch)
    try:
        prompt = [(17 * i + 5) % 256 for i in range(240)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        final = prefill_chunkwise(prefill, decode, "r0", prompt, params).first.kv_transfer_params
        assert final is not None and len(final.tail_block_ids) == 1
        pages = bytearray(final.tail_pages)
        pages[100] ^= 0xFF
        corrupt = dataclasses.replace(final, tail_pages=bytes(pages))
        output = decode_equals_colocated(prefill, decode, colocated, "r0", prompt, params, corrupt)
        assert output.kv_provenance.num_blocks_pulled == 1
        assert spy.reads_releasing == [False] * 4 + [True]  # the tail, read from the lease
        assert "do not match its checksums" in caplog.text
        assert decode.stats().transfer.num_failed_blocks == 0
        # Another prompt's offers go to `decode`, its hand-off to `other`.
        prompt = [(23 * i + 9) % 256 for i in range(240)]
        final = prefill_chunkwise(prefill, decode, "r1", prompt, params).first.kv_transfer_params
        assert final is not None and len(final.tail_block_ids) == 1
        elsewhere = decode_equals_colocated(prefill, other, colocated, "r1", prompt, params, final)
        assert elsewhere.kv_provenance.num_blocks_pulled == 15
        assert_decode_idle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
        other.shutdown()


@pytest.mark.parametrize("step_fails", [False, True], ids=["after-the-step", "in-the-step"])
def test_a_hand_off_aborted_after_its_tail_landed_releases_its_lease_once_at_once(
    step_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborted after the step that landed its tail, or in it: a forward that raises after the
    landing (another request's), and the caller aborts everything, as ``EngineHost`` does.
    Either way one release goes out at the abort, and neither side holds anything."""
    prefill = make_prefill_engine(connector_options=SHORT_END)
    decode = make_decode_engine()
    spy = ClientSpy(decode, monkeypatch)
    try:
        prompt = [(19 * i + 7) % 256 for i in range(240)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        final = prefill_chunkwise(prefill, decode, "r0", prompt, params).first.kv_transfer_params
        assert final is not None and final.tail_pages
        decode.add_request("r0", prompt, params, kv_transfer_params=final)
        if step_fails:
            decode.add_request("other", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))

            def fail(chunks):  # stands in for a forward that fails
                raise RuntimeError("the forward failed")

            decode.runner.execute = fail
            with pytest.raises(RuntimeError, match="the forward failed"):
                decode.step()
            del decode.runner.execute  # the class's own again
            decode.abort_all()
        else:
            decode.step()  # lands the tail
            assert spy.releases == []
            decode.abort("r0")
        wait_prefill_idle(prefill)
        for _ in range(3):  # nothing more goes out in later steps
            decode.step()
        decode.connector._executor.submit(lambda: None).result()
        assert spy.releases == [final.lease_id]
        assert_decode_idle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_last_chunk_with_no_block_edge_near_the_prompts_end_is_its_last_block(
    colocated: LLMEngine,
) -> None:
    """190 tokens end with a block of 14; ``final_chunk_tokens=4`` finds no block edge within
    4 tokens of the end (the first edge past it, 192, would schedule tokens the prompt does
    not have), so the last chunk is that partial block: cut at 176, offered, and the
    hand-off pulls one block."""
    prefill = make_prefill_engine(connector_options={"final_chunk_tokens": 4})
    decode = make_decode_engine()
    try:
        prompt = [(13 * i + 6) % 256 for i in range(190)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        handoff = prefill_chunkwise(prefill, decode, "r0", prompt, params)
        assert [o.num_tokens for o in handoff.offers] == [64, 128, 176]
        final = handoff.first.kv_transfer_params
        assert final is not None and final.num_tokens == 190
        output = decode_equals_colocated(prefill, decode, colocated, "r0", prompt, params, final)
        assert output.kv_provenance.num_blocks_pulled == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    ("connector_options", "engine_options"),
    [
        ({"chunked_handoff": False}, {}),
        # The prompt's rest fits one chunk when it is admitted: one step, never cut.
        ({"final_chunk_tokens": 16}, {"max_num_batched_tokens": 256}),
    ],
    ids=["offers-off", "admitted-whole"],
)
def test_without_offers_the_whole_prompt_is_handed_off_at_the_end(
    connector_options: dict[str, object], engine_options: dict[str, object], colocated: LLMEngine
) -> None:
    prefill = make_prefill_engine(connector_options=connector_options, **engine_options)
    decode = make_decode_engine()
    try:
        prompt = [(5 * i + 1) % 256 for i in range(200)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        handoff = prefill_chunkwise(prefill, decode, "r0", prompt, params)
        assert handoff.offers == []
        output = decode_equals_colocated(
            prefill, decode, colocated, "r0", prompt, params, handoff.first.kv_transfer_params
        )
        assert output.kv_provenance.num_blocks_pulled == 13  # the whole prompt, at the end
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_preempted_after_its_offers_resumes_from_the_offered_blocks(
    colocated: LLMEngine,
) -> None:
    """The prefill is preempted after two offers, as a full pool would. The lease pins the
    offered blocks, so the request's prefix hit when it is admitted again is those very
    blocks: nothing offered is computed twice, the lease is the same, the output is exact."""
    prefill = make_prefill_engine("grpc")
    decode = make_decode_engine()
    try:
        prompt = [(11 * i + 2) % 256 for i in range(200)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        scheduler = prefill.scheduler
        preempted: list[list[int]] = []

        def preempt_once() -> None:
            request = scheduler.requests.get("r0")
            if preempted or request is None or request.num_computed_tokens < 2 * CHUNK:
                return
            preempted.append(list(prefill.kv_cache_manager.get_block_ids(request)[0]))
            scheduler.running.remove(request)
            scheduler._preempt(request)  # as a full pool would (the scheduler's own path)
            # The pins hold the 8 offered blocks: the cache cannot be reset under them.
            assert not prefill.kv_cache_manager.reset_prefix_cache()

        handoff = prefill_chunkwise(prefill, decode, "r0", prompt, params, preempt_once)
        assert preempted and prefill.stats().num_preemptions == 1
        final = handoff.first.kv_transfer_params
        assert final.block_ids[:8] == preempted[0][:8]  # its prefix hit: the pinned blocks
        assert final.lease_id == handoff.offers[0].lease_id
        decode_equals_colocated(prefill, decode, colocated, "r0", prompt, params, final)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prompt_ended_by_its_first_token_releases_the_offers_lease(
    colocated: LLMEngine,
) -> None:
    """Offers went out, then the first token is a stop: there is no hand-off, and the lease
    the offers were under ends with the prefill (the decode side keeps only cache). The
    conversation's next turn, run whole on the decode engine, finds the offered blocks as
    cache hits: no hand-off of its own pulled them."""
    prefill = make_prefill_engine("grpc")
    decode = make_decode_engine()
    try:
        prompt = [(3 * i + 4) % 256 for i in range(200)]
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        (first_token,) = colocated.generate([prompt], [greedy])[0].output_token_ids
        stopping = dataclasses.replace(greedy, max_tokens=8, stop_token_ids=[first_token])
        handoff = prefill_chunkwise(prefill, decode, "r0", prompt, stopping)
        assert handoff.offers and handoff.first.finish_reason == "stop"
        assert handoff.first.kv_transfer_params is None
        wait_prefill_idle(prefill)
        assert_decode_idle(decode)
        next_turn = prompt + [first_token] + [(5 * i + 1) % 256 for i in range(40)]
        hits_before = decode.stats().prefix_cache_hits
        (output,) = decode.generate([next_turn], [greedy])
        offered = handoff.offers[-1].num_tokens
        assert output.num_cached_tokens == offered
        assert output.kv_provenance.num_cache_hit_tokens == offered
        assert output.kv_provenance.num_pulled_early_tokens == 0
        assert decode.stats().prefix_cache_hits - hits_before == offered
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prompt_aborted_while_its_offer_is_read_keeps_the_offered_blocks_until_the_read_ends():
    """A prefill aborted mid-prompt ends its lease at once, but a read of its offer that the
    transfer server began (``begin_read``, as a ``ReadBlocks`` call does) is still copying
    the pages: the offered blocks stay pinned, and the engine counts the lease held (and
    refuses a new request of that id, which would take the lease over), until that read
    ends; then everything is freed."""
    prefill = make_prefill_engine("grpc")
    try:
        offer = first_offer(prefill, "r0", [(3 * i + 8) % 256 for i in range(200)])
        leases = prefill.connector.leases
        leases.begin_read(offer.lease_id, offer.block_ids)
        prefill.abort("r0")
        for _ in range(3):
            prefill.step()
        assert prefill.num_leases_held == 1
        pool = prefill.kv_cache_manager.block_pool
        assert all(pool.blocks[block_id].ref_cnt == 1 for block_id in offer.block_ids)
        with pytest.raises(ValueError, match="still held for a decode worker"):
            prefill.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=1))
        leases.end_read(offer.lease_id)
        wait_prefill_idle(prefill)
        prefill.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=1))  # free again
        prefill.abort("r0")
    finally:
        prefill.shutdown()


def test_blocks_a_window_left_stay_held_while_a_read_begun_before_is_in_flight(tmp_path):
    """A sliding window moves past blocks an earlier offer named: the next offer takes them
    out of the lease (no read begins on them), but a read the transfer server began before
    (``begin_read``, as a ``ReadBlocks`` call does) still copies their pages: they stay
    held, never handed out, until that read ends, and are freed at the next step after."""
    save_hf_model(tmp_path, transformers.Gemma3TextConfig, **{**GEMMA3, "sliding_window": 40})
    prefill = make_prefill_engine("grpc", model=str(tmp_path))
    try:
        offer = first_offer(prefill, "r0", [(7 * i + 3) % 90 + 2 for i in range(200)])
        read = [block_id for block_id in offer.block_ids if block_id != NULL_BLOCK_ID]
        prefill.connector.leases.begin_read(offer.lease_id, read)
        offered_since = []
        for _ in range(2):  # two more chunks: the window has left the first offer's blocks
            offered_since += [o.kv_transfer_params for o in prefill.step()]
        later = {b for params in offered_since if params for b in params.block_ids}
        left = set(read) - later
        assert len(left) == 6  # each window's 3 blocks of the first offer
        pool = prefill.kv_cache_manager.block_pool
        assert all(pool.blocks[block_id].ref_cnt == 1 for block_id in left)
        assert set(prefill.kv_cache_manager.retired_owners) == {"r0"}
        prefill.connector.leases.end_read(offer.lease_id)
        prefill.step()
        assert all(pool.blocks[block_id].ref_cnt == 0 for block_id in left)
        assert not prefill.kv_cache_manager.retired_owners
        prefill.abort("r0")
        wait_prefill_idle(prefill)
    finally:
        prefill.shutdown()


def test_an_offer_the_decode_pool_cannot_hold_is_dropped_and_the_hand_off_pulls_it(
    colocated: LLMEngine,
) -> None:
    """A decode pool of 16 blocks, 6 of them held, holds no offer of 12: the KV-only
    request ends at once (nothing waits for room), and the final hand-off pulls what is
    missing."""
    prefill = make_prefill_engine("grpc")
    decode = make_decode_engine(num_kv_blocks=16)
    try:
        prompt = [(9 * i + 5) % 256 for i in range(200)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        occupant = [(17 * i + 1) % 256 for i in range(90)]  # 6 blocks held while r0 prefills
        decode.add_request("occupant", occupant, SamplingParams(max_tokens=200, ignore_eos=True))
        decode.step()
        handoff = prefill_chunkwise(prefill, decode, "r0", prompt, params)
        dropped = [o for o in handoff.offer_outputs if o.kv_provenance.num_blocks_pulled == 0]
        assert dropped, [o.kv_provenance for o in handoff.offer_outputs]
        decode.abort("occupant")
        decode_equals_colocated(
            prefill, decode, colocated, "r0", prompt, params, handoff.first.kv_transfer_params
        )
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_offer_that_would_take_a_running_requests_next_block_is_dropped() -> None:
    """A decode pool of 15 usable blocks, 7 held by a running decode whose next token needs
    an eighth: an offer of 8 blocks would fit only by taking the last free ones (three of
    them cached by an earlier request), and that decode would be preempted while the pull
    runs. The offer is dropped before it takes anything: the running request is not
    preempted, and no cached block is evicted. Sent again after the prefill ended, its pull
    fails: a failed load, and no recompute fallback (the hand-off would pull what it
    lacks)."""
    prefill = make_prefill_engine("grpc")
    decode = make_decode_engine(num_kv_blocks=16)
    try:
        prompt = [(9 * i + 5) % 256 for i in range(200)]
        offer = first_offer(prefill, "r0", prompt, min_tokens=128)
        decode.generate([[(5 * i + 3) % 256 for i in range(48)]], [SamplingParams(max_tokens=1)])
        occupant = [(17 * i + 1) % 256 for i in range(111)]  # 7 blocks; its 2nd token: an 8th
        decode.add_request("occupant", occupant, SamplingParams(max_tokens=20, ignore_eos=True))
        decode.step()
        assert decode.kv_cache_manager.get_num_free_blocks() == len(offer.block_ids) == 8
        dropped = pull_offer(decode, "r0#offer", prompt, offer)
        assert dropped.kv_provenance.num_blocks_pulled == 0
        assert decode.stats().num_evictions == 0
        run_to_completion(decode, ["occupant"])
        assert decode.stats().num_preemptions == 0
        # The prefill is aborted: its lease ends, and a late pull of the offer fails. That is
        # a failed load, and no recompute: an offer's hand-off pulls what it lacks.
        prefill.abort("r0")
        wait_prefill_idle(prefill)
        failed = pull_offer(decode, "r0#offer", prompt, offer)
        assert failed.kv_provenance.num_blocks_pulled == 0
        stats = decode.stats()
        assert stats.num_load_failures == 1 and stats.num_recompute_fallbacks == 0
        assert_decode_idle(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_offer_checksummed_after_its_prefill_was_preempted_still_lands_its_own_kv(
    colocated: LLMEngine,
) -> None:
    """The worker's stream checksums an offer off the engine thread, so the engine may step
    on first: here it preempts the prefill after its first offer, and two other prompts
    run before it is admitted again (the test holds it out of the waiting queue meanwhile,
    as a scheduler admitting others first would). The offered blocks are pinned by the
    lease, so the second prompt cannot take them: the late checksums are of the prompt's
    own KV, and the decode side never caches another prompt's KV under its hashes.

    Before the pins, the second prompt wrote into three of the four offered blocks, the
    late checksums vouched for its KV, and the decode output differed from colocated."""
    prefill = make_prefill_engine("grpc", num_kv_blocks=32)  # 31 usable blocks
    decode = make_decode_engine()
    try:
        prompt = [(13 * i + 6) % 256 for i in range(200)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prefill.add_request(
            "r0", prompt, dataclasses.replace(params, max_tokens=1), remote_decode=True
        )
        (offer_output,) = prefill.step()
        offer = offer_output.kv_transfer_params
        assert offer is not None and not offer.final and len(offer.block_ids) == 4
        scheduler = prefill.scheduler
        request = scheduler.requests["r0"]
        scheduler.running.remove(request)
        scheduler._preempt(request)  # as a full pool would (the scheduler's own path)
        scheduler.waiting.remove(request)
        # 27 blocks, then 4: without the pins, the second prompt takes three offered blocks.
        others = [[(5 * i + k) % 256 for i in range(n)] for k, n in ((1, 431), (2, 63))]
        for index, other in enumerate(others):  # r0 is tracked: generate() would refuse
            prefill.add_request(f"other{index}", other, SamplingParams(max_tokens=1))
            run_to_completion(prefill, [f"other{index}"])
        producer = prefill.connector
        producer.complete_transfer_params(offer)  # the stream, late
        landed = pull_offer(decode, "r0#offer0", prompt, offer)
        assert landed.kv_provenance.num_blocks_pulled == 4
        scheduler.waiting.appendleft(request)
        final = None
        while final is None:
            for output in prefill.step():
                params_out = output.kv_transfer_params
                if params_out is not None:
                    producer.complete_transfer_params(params_out)
                    if params_out.final:
                        final = params_out
        decode_equals_colocated(prefill, decode, colocated, "r0", prompt, params, final)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_windowed_model_offers_each_window_and_decodes_as_colocated(transport, tmp_path):
    """Gemma 3 (windowed and global layers: two KV groups) streams its hand-off too. Each
    offer names every global block so far but only the blocks the window still reads (a
    40-token window: the last three), the blocks the window left leave the lease and their
    pins, and the decode side's tokens equal a colocated engine's, greedy and seeded."""
    save_hf_model(tmp_path, transformers.Gemma3TextConfig, **{**GEMMA3, "sliding_window": 40})
    model = str(tmp_path)
    prefill = make_prefill_engine(transport, model=model)
    decode = make_decode_engine(transport, model=tmp_path)
    colocated = LLMEngine.from_pretrained(
        model, **{**ENGINE_KWARGS, "max_num_batched_tokens": CHUNK}
    )
    try:
        for index, params in enumerate(
            [
                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
            ]
        ):
            prompt = [(7 * i + 3 + 31 * index) % 90 + 2 for i in range(200)]
            handoff = prefill_chunkwise(prefill, decode, f"r{index}", prompt, params)
            assert [o.num_tokens for o in handoff.offers] == [64, 128, 192]
            assert len({o.lease_id for o in handoff.offers}) == 1
            for offer in handoff.offers:
                num_blocks = offer.num_tokens // BLOCK_SIZE
                tables = [
                    offer.block_ids[g * num_blocks : (g + 1) * num_blocks]
                    for g in range(offer.num_kv_groups)
                ]
                # One global group (4 layers in 2 groups of 2) whole, two windows' last 3.
                held = sorted(sum(b != NULL_BLOCK_ID for b in table) for table in tables)
                assert held == [3, 3, num_blocks], held
                assert all(NULL_BLOCK_ID not in table[-3:] for table in tables)
            # Both windows' three blocks of the first offer left the lease with the second.
            first, second = (set(o.block_ids) - {NULL_BLOCK_ID} for o in handoff.offers[:2])
            assert len(first - second) == 6
            output = decode_equals_colocated(
                prefill,
                decode,
                colocated,
                f"r{index}",
                prompt,
                params,
                handoff.first.kv_transfer_params,
            )
            assert output.kv_provenance.num_pulled_early_tokens == 192
        assert decode.stats().transfer.num_failed_transfers == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
