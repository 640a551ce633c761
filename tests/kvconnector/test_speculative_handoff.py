"""Speculative decoding on the decode side of a P/D pair: a real prefill engine in its own
process, the KV pulled over real gRPC and NIXL, drafts proposed from the pulled prompt and
the prefill's first token.

The decode engine's outputs equal a colocated speculation-off engine's token for token,
greedy and seeded, and its computed tokens add up exactly: one per verified step plus its
drafts, none of the prompt (it arrived over the wire, and drafts never cover it). A draft
model computes the prompt itself (the pulled KV is the target's): with ``tiny`` drafting
for ``tiny`` every greedy draft is accepted, which it is only if the draft's own pages of
the pulled prompt are right.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.spec_decode import DraftModelProposer
from tests.engine.test_draft_model import prompts as tiny_prompts
from tests.engine.test_speculative_decoding import GROUNDED_PROMPTS
from tests.kvconnector.disaggregation import assert_decode_idle, disaggregate, make_decode_engine
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS


@pytest.fixture(scope="module")
def colocated(smollm2_gguf) -> LLMEngine:
    """Speculation off, in this process: the reference."""
    return LLMEngine.from_pretrained("smollm2", **ENGINE_KWARGS)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_speculative_decode_after_a_pull_equals_colocated(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport=transport, model="smollm2")
    decode = make_decode_engine(transport, model="smollm2", speculative_method="ngram")
    prompts = [colocated.tokenizer.encode(p) for p in GROUNDED_PROMPTS] * 2
    params = [
        SamplingParams(max_tokens=32, temperature=t, seed=i, ignore_eos=True)
        for i, t in enumerate([0.0, 0.0, 0.0, 0.7, 1.0, 0.5])
    ]
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    outputs = disaggregate(prefill, decode, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    stats = decode.stats()
    spec = stats.spec_decode
    assert spec.num_accepted_tokens > 20, spec
    # Each verified step computes its last token and its drafts, and emits 1 + accepted
    # tokens; the prefill sampled the first. Any prompt token computed here would add.
    emitted_here = sum(len(o.output_token_ids) - 1 for o in outputs)
    num_steps = emitted_here - spec.num_accepted_tokens
    assert stats.num_scheduled_tokens == num_steps + spec.num_draft_tokens
    assert stats.transfer.num_failed_transfers == 0 and stats.transfer.num_blocks_received > 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_draft_model_drafts_from_the_pulled_prompt(transport: str, prefill_factory) -> None:
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(
        transport,
        speculative_method="draft_model",
        speculative_model="tiny",
        speculative_draft_cost=0.0,  # an identical draft costs a step: it would never draft
    )
    colocated = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    prompts = tiny_prompts(7, 4)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    outputs = disaggregate(prefill, decode, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    stats = decode.stats()
    spec = stats.spec_decode
    assert spec.num_draft_tokens > 30 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert stats.transfer.num_blocks_received > 0
    proposer = decode.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.num_free_blocks == decode.runner.num_blocks - 1
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()
