"""Speculative decoding with a draft model (engine/spec_decode/draft_model_proposer.py).

The proofs:

* the draft's own paged KV is right: a draft identical to the model (``tiny`` drafting for
  ``tiny``) proposes exactly the model's greedy continuation at every step, also after
  verifications that rejected some of its drafts (its stale pages are written again), and
  in the engine every one of its greedy drafts is accepted;
* verification keeps the output: with an identical draft and with an unrelated one, greedy
  and seeded outputs equal a speculation-off engine's token for token;
* a draft that costs as much as the model never drafts (its forward is in the trade);
* nothing leaks: the draft's pool is whole again after requests finish, are aborted or
  preempted, and a full draft pool skips drafting rather than preempting;
* bad settings are refused at start-up with a message naming them.
"""

from __future__ import annotations

import random

import pytest
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.spec_decode import DraftModelProposer
from tests.engine.hf_models import GEMMA3, save_hf_model

TINY_VOCAB = 512


def make_engine(**config: object) -> LLMEngine:
    defaults: dict[str, object] = dict(block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
    return LLMEngine.from_pretrained("tiny", **{**defaults, **config})


def drafted(draft: str, **config: object) -> LLMEngine:
    """A drafting engine; its draft's cost taken as nothing (an identical draft costs a whole
    step, and the trade would rightly never draft), unless ``config`` says otherwise."""
    settings = {"speculative_draft_cost": 0.0, **config}
    return make_engine(speculative_method="draft_model", speculative_model=draft, **settings)


def proposer_of(engine: LLMEngine) -> DraftModelProposer:
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def prompts(seed: int, count: int, longest: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(5, longest))] for _ in range(count)
    ]


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory) -> str:
    """A random two-layer Llama with tiny's vocabulary: it rarely guesses tiny's tokens."""
    directory = tmp_path_factory.mktemp("draft")
    save_hf_model(
        directory, transformers.LlamaConfig, vocab_size=TINY_VOCAB, max_position_embeddings=1024
    )
    return str(directory)


def test_an_identical_draft_proposes_the_models_greedy_continuation_after_any_verification():
    """Drive the proposer as verification does: each round keeps a random number of its
    drafts and then a token of its own, so the draft's pages after the first rejected draft
    are stale. Every proposal must still be tiny's greedy continuation of the context."""
    reference = make_engine()
    engine = drafted("tiny", speculative_min_acceptance=0.0, num_speculative_tokens=4)
    proposer = proposer_of(engine)
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in prompts(1, 3):
        state = proposer.new_state()
        context = list(prompt)
        for _ in range(8):
            [drafts] = proposer.propose([(state, context, 4)])
            [expected] = reference.generate([context], greedy)
            assert drafts == expected.output_token_ids
            kept = rng.randint(0, 4)
            context += drafts[:kept] + [rng.randrange(3, TINY_VOCAB)]
        proposer.release(state)
    assert proposer.num_free_blocks == engine.runner.num_blocks - 1


def test_an_identical_draft_is_always_accepted_greedy_and_changes_no_token():
    off, on = make_engine(), drafted("tiny")
    batch = prompts(2, 6, longest=150)  # longer than a chunk: the target prefills in pieces
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.output_token_ids for o in off.generate(batch, params)]
    assert [o.output_token_ids for o in on.generate(batch, params)] == expected
    spec = on.stats().spec_decode
    assert spec.num_draft_tokens > 100
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert proposer_of(on).num_free_blocks == on.runner.num_blocks - 1


@pytest.mark.parametrize("draft", ["tiny", "unrelated"])
def test_seeded_and_greedy_outputs_equal_speculation_off_whatever_the_draft(
    draft: str, unrelated_draft: str
):
    off = make_engine()
    on = drafted(unrelated_draft if draft == "unrelated" else draft, speculative_min_acceptance=0.0)
    batch = prompts(3, 6)
    params = [
        SamplingParams(max_tokens=32, temperature=t, seed=i, ignore_eos=True)
        for i, t in enumerate([0.0, 0.0, 0.8, 1.0, 0.5, 1.2])
    ]
    expected = [o.output_token_ids for o in off.generate(batch, params)]
    assert [o.output_token_ids for o in on.generate(batch, params)] == expected
    spec = on.stats().spec_decode
    assert spec.num_draft_tokens > 100  # it drafted, and some drafts were rejected
    assert spec.num_accepted_tokens < spec.num_draft_tokens
    assert proposer_of(on).num_free_blocks == on.runner.num_blocks - 1


def test_preempted_and_aborted_requests_give_the_drafts_pages_back():
    """A pool of 16 blocks for 6 requests of up to 160 tokens: the target preempts, and the
    draft's pool (as many blocks) is as short."""
    off, on = make_engine(num_kv_blocks=16), drafted("tiny", num_kv_blocks=16)
    batch = prompts(4, 6, longest=120)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.output_token_ids for o in off.generate(batch, params)]
    assert [o.output_token_ids for o in on.generate(batch, params)] == expected
    assert on.stats().num_preemptions > 0
    proposer = proposer_of(on)
    assert proposer.num_free_blocks == on.runner.num_blocks - 1
    for index, prompt in enumerate(batch):
        on.add_request(f"abort-{index}", prompt, params)
    for _ in range(6):
        on.step()
    assert proposer.num_free_blocks < on.runner.num_blocks - 1
    for index in range(len(batch)):
        on.abort(f"abort-{index}")
    assert not on.has_unfinished_requests()
    assert proposer.num_free_blocks == on.runner.num_blocks - 1


def test_a_full_draft_pool_skips_drafting_and_takes_nothing():
    engine = drafted("tiny", num_kv_blocks=8, speculative_min_acceptance=0.0)
    proposer = proposer_of(engine)
    holder, other = proposer.new_state(), proposer.new_state()
    [drafts] = proposer.propose([(holder, list(range(3, 103)), 4)])
    assert len(drafts) == 4
    assert proposer.num_free_blocks == 0  # 103 positions: 7 pages of 16
    assert proposer.propose([(other, [5, 6, 7], 4)]) == [[]]
    assert other.block_ids == [] and other.fed == []
    proposer.release(holder)
    [drafts] = proposer.propose([(other, [5, 6, 7], 4)])
    assert len(drafts) == 4


def test_the_drafts_pages_are_paid_from_the_kv_memory_budget(unrelated_draft):
    """Both pools, the model's and the draft's, as many blocks each, fit the budget
    together (the draft's used to come on top of it)."""
    budget = 4 << 20
    plain = LLMEngine.from_pretrained("tiny", block_size=16, kv_cache_memory_bytes=budget)
    engine = LLMEngine.from_pretrained(
        "tiny",
        block_size=16,
        kv_cache_memory_bytes=budget,
        speculative_method="draft_model",
        speculative_model=unrelated_draft,
        speculative_draft_cost=0.0,
    )
    draft_pages = proposer_of(engine).runner.kv_cache
    assert draft_pages.shape[0] == engine.runner.num_blocks < plain.runner.num_blocks
    used = engine.runner.kv_cache.nbytes + draft_pages.nbytes
    page_pair = (engine.runner.kv_cache.nbytes + draft_pages.nbytes) // engine.runner.num_blocks
    assert budget - page_pair < used <= budget  # the budget, to the last pair of pages
    plain.shutdown()
    engine.shutdown()


def test_a_draft_as_dear_as_the_model_never_drafts():
    """The trade weighs each draft's forward: at a measured cost (tiny drafting for tiny
    costs about a step) or a stated one of a whole step, no request drafts, and the output
    is speculation-off's."""
    assert proposer_of(drafted("tiny", speculative_draft_cost=None)).draft_cost > 0
    off, on = make_engine(), drafted("tiny", speculative_draft_cost=1.0)
    batch = prompts(8, 3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.output_token_ids for o in off.generate(batch, params)]
    assert [o.output_token_ids for o in on.generate(batch, params)] == expected
    assert on.stats().spec_decode.num_draft_tokens == 0
    assert proposer_of(on).num_free_blocks == on.runner.num_blocks - 1


def test_bad_draft_settings_are_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="speculative_model names the draft"):
        make_engine(speculative_method="draft_model")
    with pytest.raises(ValueError, match="speculative_model names the draft"):
        make_engine(speculative_method="ngram", speculative_model="tiny")
    with pytest.raises(ValueError, match="speculative_draft_cost must be at least 0"):
        drafted("tiny", speculative_draft_cost=-0.5)
    with pytest.raises(FileNotFoundError, match="no-such-draft"):
        drafted(str(tmp_path / "no-such-draft"))
    other_vocabulary = tmp_path / "other-vocabulary"
    other_vocabulary.mkdir()
    save_hf_model(other_vocabulary, transformers.LlamaConfig)  # 96 tokens
    with pytest.raises(ValueError, match="vocabulary of 96 tokens and the model tiny one of 512"):
        drafted(str(other_vocabulary))
    windowed = tmp_path / "gemma"
    windowed.mkdir()
    save_hf_model(windowed, transformers.Gemma3TextConfig, **{**GEMMA3, "vocab_size": TINY_VOCAB})
    with pytest.raises(ValueError, match="a draft model needs one KV group"):
        drafted(str(windowed))
