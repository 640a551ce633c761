"""vLLM's sampling fields across the P/D hand-off: the prefill samples the first token
under them, the decode worker counts the prompt and that token as its own history, so the
decoded output equals the colocated engine's token for token, over gRPC and NIXL, with
and without speculative decoding on the decode side."""

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
