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
