"""A hand-off between simulated workers (``--model sim:<profile>``) moves their placeholder
pages over gRPC and NIXL, and the decode worker names the tokens a colocated simulated engine
does."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from tests.kvconnector.disaggregation import make_decode_engine, run_to_completion
from tests.kvconnector.kv_peer import TRANSPORTS

SIM = "sim:tiny-cpu"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 17, 30, 4, 11] * 5, [6, 7, 8], list(range(40, 90))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_hand_off_between_simulated_workers_equals_the_colocated_one(
    transport, prefill_factory
) -> None:
    colocated = LLMEngine.from_pretrained(SIM, num_kv_blocks=64)
    expected = colocated.generate(PROMPTS, GREEDY)
    prefill = prefill_factory(transport=transport, model=SIM)
    decode = make_decode_engine(transport, model=SIM)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        prefilled = prefill.prefill(
            request_id, prompt, dataclasses.replace(GREEDY, max_tokens=1), None
        )
        decode.add_request(
            request_id, prompt, GREEDY, kv_transfer_params=prefilled.kv_transfer_params
        )
    outputs = run_to_completion(decode, ids)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
    assert decode.stats().transfer.num_blocks_received > 0
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_simulated_pull_waits_out_the_real_pages_time(monkeypatch, prefill_factory) -> None:
    """tiny's pages (4 layers of K and V, 2 heads of 64 float32 values, 16 tokens) at the
    profile's rate: the pull asks for the rest of that time (checked on the call, not on a
    clock), where the placeholder pages themselves move in microseconds."""
    from pdserve.model import sim_transfer

    waits: list[float] = []
    monkeypatch.setattr(sim_transfer, "sleep", waits.append)
    prefill = prefill_factory(transport="grpc", model=SIM)
    decode = make_decode_engine("grpc", model=SIM)
    # A worker's connector gets it from its engine's config (PDConnector.for_engine); this
    # test's connector was made before its engine, so it is given the same one here.
    decode.connector._simulated = sim_transfer.simulated_transfer(decode.config)
    prompt = PROMPTS[2]  # 50 tokens: 3 full blocks
    prefilled = prefill.prefill("w", prompt, dataclasses.replace(GREEDY, max_tokens=1), None)
    decode.add_request("w", prompt, GREEDY, kv_transfer_params=prefilled.kv_transfer_params)
    run_to_completion(decode, ["w"])
    simulated = decode.connector._simulated
    assert simulated.page_bytes == 4 * 2 * 2 * 64 * 4 * 16
    moved = decode.stats().transfer.num_blocks_received
    full = moved * simulated.page_bytes / simulated.bytes_per_s
    assert len(waits) == 1 and full - 0.01 < waits[0] <= full
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_workers_connector_is_simulated_for_a_simulated_model_only() -> None:
    from pdserve.kvconnector.pd.pd_connector import PDConnector
    from pdserve.messages.connector_config import KVConnectorConfig
    from pdserve.messages.engine_config import EngineConfig

    consumer = KVConnectorConfig(role="consumer")
    assert PDConnector.for_engine(consumer, EngineConfig(model=SIM))._simulated is not None
    assert PDConnector.for_engine(consumer, EngineConfig(model="tiny"))._simulated is None
