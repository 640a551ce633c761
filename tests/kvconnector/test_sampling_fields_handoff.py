"""vLLM's sampling fields across the P/D hand-off: the prefill samples the first token
under them, the decode worker counts the prompt and that token as its own history, so the
decoded output equals the colocated engine's token for token, over gRPC and NIXL, with
and without speculative decoding on the decode side, and after a failed pull recomputed."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from tests.engine.test_sampling_fields import CASES
from tests.kvconnector.disaggregation import (
    assert_decode_idle,
    disaggregate,
    make_decode_engine,
    random_prompts,
    run_to_completion,
)
from tests.kvconnector.kv_peer import TRANSPORTS


@pytest.mark.parametrize("speculative_method", ["off", "ngram"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_field_decoded_after_a_pull_equals_colocated(
    transport: str, speculative_method: str, colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(transport, speculative_method=speculative_method)
    params = [
        dataclasses.replace(SamplingParams(max_tokens=16, temperature=0.0), **fields)
        for fields in CASES.values()
    ]
    prompts = random_prompts(53, len(params))
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    outputs = disaggregate(prefill, decode, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    assert decode.stats().transfer.num_failed_transfers == 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_every_field_after_a_pull_that_fails_and_recomputes_equals_colocated(
    colocated: LLMEngine, prefill_factory
) -> None:
    """The recompute fallback: each request's first block arrives corrupt, so the decode
    worker recomputes the whole prompt; its counts are still the prompt and the prefill's
    first token, and the output the colocated engine's."""
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc")
    params = [
        dataclasses.replace(SamplingParams(max_tokens=12, temperature=0.0), **fields)
        for fields in CASES.values()
    ]
    prompts = random_prompts(54, len(params))
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    ids = [f"f{i}" for i in range(len(prompts))]
    for request_id, prompt, request_params in zip(ids, prompts, params):
        first_token = dataclasses.replace(request_params, max_tokens=1)
        prefilled = prefill.prefill(request_id, prompt, first_token)
        prefill.corrupt(prefilled.kv_transfer_params.block_ids[0])
        decode.add_request(
            request_id, prompt, request_params, kv_transfer_params=prefilled.kv_transfer_params
        )
    outputs = run_to_completion(decode, ids)
    assert [o.output_token_ids for o in outputs] == expected
    assert decode.stats().num_recompute_fallbacks == len(ids)
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()
