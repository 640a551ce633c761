"""Speculative decoding in the engine (engine/spec_decode/): prompt-lookup drafts, verified
in one forward, emit exactly the tokens speculation-off emits.

Every row of a verification is sampled as a plain decode samples that position (same seed,
same position, same logits up to float noise), so the proof is token-for-token equality
with a speculation-off engine of the same model: greedy and seeded, batched, with prefix
hits, ``n > 1``, logprobs, stops inside an accepted run, ``max_tokens``, grammars and
preemption; the logprobs, stop and grammar cases also with a draft model (smollm2 drafting
for itself). Each comparison also asserts that drafts were accepted, so it cannot pass by
never speculating. smollm2 quotes its prompt (drafts get accepted); the random ``tiny``
model rarely does, which tests the rejection paths and the adaptive pause.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cache import BlockStored
from pdserve.cache.kv_cache_block import get_block_hash
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.spec_decode import DraftModelProposer
from pdserve.grammar import GrammarSpec

BLOCK_SIZE = 16

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at six, lit the great "
    "lamp, and wrote the weather in a leather logbook: wind from the west, light rain, "
    "three ships passing north before midnight."
)
GROUNDED_PROMPTS = [
    f"Passage: {PASSAGE}\nCopy the passage exactly.\nCopy: The lighthouse keeper",
    f"Passage: {PASSAGE}\nQuestion: what did the keeper write in the logbook?\nAnswer: He wrote",
    "def area(width, height):\n    return width * height\n\n"
    "# The same function, renamed to rectangle_area:\ndef rectangle_area(width, height):\n",
]


def make_engine(model: str, **config: object) -> LLMEngine:
    # Dequantized: token-for-token equality across the rows of a step is float32's
    # property; packed kernels round activations to bfloat16 and take another path for
    # many rows, so a verification's logits differ from a decode's in the third digit.
    defaults = dict(
        block_size=BLOCK_SIZE,
        num_kv_blocks=512,
        max_num_batched_tokens=512,
        quantization="none",
    )
    defaults.update(config)
    return LLMEngine.from_pretrained(model, **defaults)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> tuple[LLMEngine, LLMEngine]:
    """(speculation off, ngram speculation) engines of the built-in SmolLM2."""
    return make_engine("smollm2"), make_engine("smollm2", speculative_method="ngram")


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def drafters(request, smollm2) -> tuple[LLMEngine, LLMEngine]:
    """(speculation off, speculation on) for both drafters: smollm2's ngram engine, and
    smollm2 drafting for itself (its greedy drafts are always right, its sampled ones not)."""
    if request.param == "ngram":
        return smollm2
    return smollm2[0], make_engine(
        "smollm2",
        speculative_method="draft_model",
        speculative_model="smollm2",
        speculative_draft_cost=0.0,  # it costs a step: it would rightly never draft
    )


@pytest.fixture(scope="module")
def tiny() -> tuple[LLMEngine, LLMEngine]:
    return make_engine("tiny"), make_engine("tiny", speculative_method="ngram")


def tokens(outputs) -> list[list[int]]:
    return [out.output_token_ids for out in outputs]


def accepted(engine: LLMEngine) -> int:
    return engine.stats().spec_decode.num_accepted_tokens


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Token prompts that repeat a short pattern: their suffix always occurred before."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 12))]
        prompts.append((pattern * 8)[: rng.randrange(20, 90)])
    return prompts


def assert_all_blocks_free(engine: LLMEngine) -> None:
    """The engine's pool, and a draft model's, hold nothing."""
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0
    proposer = engine.scheduler.proposer
    if isinstance(proposer, DraftModelProposer):
        assert proposer.num_free_blocks == engine.runner.num_blocks - 1


def test_greedy_smollm2_equals_speculation_off_batched_and_alone(smollm2) -> None:
    off, on = smollm2
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = tokens(off.generate(GROUNDED_PROMPTS, params))
    before = accepted(on)
    assert tokens(on.generate(GROUNDED_PROMPTS, params)) == expected
    assert [tokens(on.generate([p], params))[0] for p in GROUNDED_PROMPTS] == expected
    stats = on.stats().spec_decode
    assert accepted(on) - before >= 20, stats  # the copying prompts were drafted and accepted
    assert stats.mean_accepted_length > 1.5
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert_all_blocks_free(on)


def test_seeded_sampling_smollm2_equals_speculation_off_token_for_token(smollm2) -> None:
    off, on = smollm2
    params = [
        SamplingParams(max_tokens=32, temperature=temperature, top_p=0.95, seed=seed)
        for seed, temperature in enumerate([0.3, 0.7, 1.0, 0.5, 0.9, 0.6])
    ]
    prompts = GROUNDED_PROMPTS * 2
    before = accepted(on)
    assert tokens(on.generate(prompts, params)) == tokens(off.generate(prompts, params))
    assert accepted(on) > before


def test_sampled_token_distribution_matches_speculation_off(smollm2) -> None:
    """Two-sample chi-square per output position, speculation on against off, on disjoint
    seeds (200 requests each, top_k=3: a vocabulary of at most 3 tokens per position). The
    seeded comparison above shows equality per seed; this one shows that the verified
    positions are distributed as the target's, whatever the drafts were. Bins under 5
    expected samples merge; the threshold is p < 1e-4 over every position tested."""
    off, on = smollm2
    prompt = GROUNDED_PROMPTS[0]
    count, length = 200, 4

    def sample(engine: LLMEngine, first_seed: int) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=length, temperature=1.0, top_k=3, seed=first_seed + i)
            for i in range(count)
        ]
        return tokens(engine.generate([prompt] * count, params))

    before = on.stats().spec_decode
    speculative, plain = sample(on, 0), sample(off, 10_000)
    after = on.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens > count
    tested = 0
    for position in range(1, length):
        statistic, dof = chi_square_two_sample(
            Counter(t[position] for t in speculative if len(t) > position),
            Counter(t[position] for t in plain if len(t) > position),
        )
        if dof:
            p_value = torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2))
            assert p_value.item() > 1e-4, (position, statistic, dof)
            tested += 1
    assert tested >= 2  # positions where the sample is not a single token


def chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for "a and b come from one distribution" and its degrees of
    freedom; categories expected fewer than 5 times in either sample are merged."""
    total_a, total_b = sum(a.values()), sum(b.values())
    total = total_a + total_b
    rows, rest_a, rest_b = [], 0, 0
    for key in a.keys() | b.keys():
        pooled = a[key] + b[key]
        if min(pooled * total_a, pooled * total_b) / total < 5:
            rest_a, rest_b = rest_a + a[key], rest_b + b[key]
        else:
            rows.append((a[key], b[key]))
    if rest_a + rest_b:
        rows.append((rest_a, rest_b))
    statistic = 0.0
    for count_a, count_b in rows:
        pooled = count_a + count_b
        for observed, size in ((count_a, total_a), (count_b, total_b)):
            expected = pooled * size / total
            if expected:
                statistic += (observed - expected) ** 2 / expected
    return statistic, max(len(rows) - 1, 0)


def test_logprobs_and_n_choices_with_prefix_hits_equal_speculation_off(drafters) -> None:
    """n > 1 is several seeded requests of one prompt (the gateway's choices), run after
    one another here so that all but the first hit the prefix cache."""
    off, on = drafters
    prompt = GROUNDED_PROMPTS[1]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, logprobs=2) for s in range(4)]
    expected = off.generate([prompt] * 4, params)
    before, hits = accepted(on), on.stats().prefix_cache_hits
    got = [on.generate([prompt], [p])[0] for p in params]
    assert tokens(got) == tokens(expected)
    for g, e in zip(got, expected):
        assert len(g.output_logprobs) == len(g.output_token_ids)
        for mine, theirs in zip(g.output_logprobs, e.output_logprobs):
            assert mine.token_id == theirs.token_id
            assert math.isclose(mine.logprob, theirs.logprob, abs_tol=1e-3)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert accepted(on) > before
    assert on.stats().prefix_cache_hits > hits


def test_stop_string_eos_and_max_tokens_inside_an_accepted_run(drafters) -> None:
    off, on = drafters
    prompt = GROUNDED_PROMPTS[0]
    base = off.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    stop_word = base.text.split()[8]  # a word deep inside the copied passage
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_word], logprobs=1),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[base.output_token_ids[12]]),
        SamplingParams(max_tokens=11, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.0),
    ]
    for params in cases:
        [expected] = off.generate([prompt], params)
        [got] = on.generate([prompt], params)
        assert got.output_token_ids == expected.output_token_ids, params
        assert len(got.output_logprobs) == len(expected.output_logprobs), params
        assert (got.text, got.finish_reason, got.stop_reason) == (
            expected.text,
            expected.finish_reason,
            expected.stop_reason,
        ), params
    assert len(got.output_token_ids) == 1
    assert_all_blocks_free(on)


def test_structured_output_checks_each_draft_against_the_grammar(drafters) -> None:
    off, on = drafters
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "ships": {"type": "integer"}},
        "required": ["city", "ships"],
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    prompt = (
        'Example: {"city": "Lisbon", "ships": 3}\nExample: {"city": "Porto", "ships": 5}\n'
        "Another example in the same JSON:"
    )
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=s, structured=spec)
        for s, t in ((0, 0.0), (1, 0.7), (2, 1.0))
    ]
    before = accepted(on)
    expected = off.generate([prompt] * 3, params)
    got = on.generate([prompt] * 3, params)
    assert tokens(got) == tokens(expected)
    for output in got:
        assert output.finish_reason == "stop"
        assert set(json.loads(output.text)) == {"city", "ships"}
    assert accepted(on) > before


def test_tiny_batched_prompts_with_chunked_prefill_equal_speculation_off(tiny) -> None:
    off, on = tiny
    prompts = repetitive_prompts(0, 10)
    params = [
        SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(10)
    ]
    before = on.stats().spec_decode.num_draft_tokens
    assert tokens(on.generate(prompts, params)) == tokens(off.generate(prompts, params))
    assert on.stats().spec_decode.num_draft_tokens > before
    assert_all_blocks_free(on)


def test_preemption_in_a_small_pool_keeps_speculative_outputs_exact(smollm2) -> None:
    """Eight usable blocks: drafts' lookahead slots compete with running requests; a step
    falls back to no drafts before it preempts anyone, and preempted requests recompute."""
    off, _ = smollm2
    small = make_engine("smollm2", num_kv_blocks=9, speculative_method="ngram")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = tokens(off.generate(GROUNDED_PROMPTS, params))
    assert tokens(small.generate(GROUNDED_PROMPTS, params)) == expected
    assert small.stats().num_preemptions > 0
    assert accepted(small) > 0
    assert_all_blocks_free(small)


def test_free_text_pauses_drafting_when_drafts_keep_failing(tiny) -> None:
    """tiny's random weights rarely continue their context: with one-token lookups every
    step finds a draft, but after a few rejected verifications the request pauses, so most
    of its steps carry none."""
    off, _ = tiny
    on = make_engine("tiny", speculative_method="ngram", prompt_lookup_min=1)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 256) for _ in range(6)] * 8
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True)
    before = on.stats().spec_decode
    [got] = on.generate([prompt], params)
    after = on.stats().spec_decode
    assert got.output_token_ids == off.generate([prompt], params)[0].output_token_ids
    verified_steps = after.num_drafts - before.num_drafts
    assert 0 < verified_steps < 40, verified_steps  # of 200 decode steps


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("speculative_method", "eagle", "speculative_method must be one of off, ngram"),
        ("num_speculative_tokens", 0, "num_speculative_tokens must be between 1 and 16"),
        ("num_speculative_tokens", -3, "num_speculative_tokens must be between 1 and 16"),
        ("num_speculative_tokens", 10_000, "num_speculative_tokens must be between 1 and 16"),
        ("prompt_lookup_min", 5, "prompt_lookup_min <= prompt_lookup_max"),
        ("speculative_min_acceptance", 1.5, "speculative_min_acceptance must be between 0"),
    ],
)
def test_bad_speculative_config_is_refused_with_a_clear_message(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine("tiny", **{"speculative_method": "ngram", field: value})


@st.composite
def speculative_workloads(draw) -> tuple[int, list[list[int]], list[int]]:
    """(drafts per step, repetitive prompts of whole blocks, max_tokens each): the
    the patterns are short and the vocabulary small: drafts get accepted and rejected."""
    num_speculative_tokens = draw(st.integers(1, 6))
    prompts, lengths = [], []
    for _ in range(draw(st.integers(1, 3))):
        pattern = draw(st.lists(st.integers(1, 12), min_size=2, max_size=6))
        prompts.append((pattern * 30)[: BLOCK_SIZE * draw(st.integers(1, 3)) + 1])
        lengths.append(draw(st.integers(2, 40)))
    return num_speculative_tokens, prompts, lengths


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(speculative_workloads())
def test_no_block_holding_an_unverified_token_ever_carries_a_hash(workload) -> None:
    """After every step, a running request's hashed blocks are full blocks of its verified
    tokens (drafts are not the request's tokens, so their lookahead blocks stay unhashed),
    each carrying the hash of those tokens; every BlockStored event names such a block.

    Each prompt runs twice, the second copy after the first was prefilled: its full prefix
    hit leaves the last token to compute alone, with drafts from the repeated pattern.
    A small pool (16 usable blocks) makes drafts, eviction and preemption meet."""
    num_speculative_tokens, prompts, lengths = workload
    engine = make_engine(
        "tiny",
        num_kv_blocks=17,
        speculative_method="ngram",
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_min=1,
        speculative_min_acceptance=0.0,
        publish_kv_events=True,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"first-{i}", prompt, request_params)
    requests = list(engine.scheduler.requests.values())
    verified: set[bytes] = set()
    while engine.has_unfinished_requests():
        engine.step()
        if len(requests) == len(prompts):  # the first copies are prefilled now
            for i, (prompt, request_params) in enumerate(zip(prompts, params)):
                engine.add_request(f"again-{i}", prompt, request_params)
            requests = list(engine.scheduler.requests.values())
        for request in requests:
            verified.update(request.block_hashes)
        for request in engine.scheduler.running:
            [blocks] = engine.kv_cache_manager.get_blocks(request.request_id).blocks
            for index, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert index < request.num_tokens // BLOCK_SIZE
                    assert get_block_hash(block.block_hash) == request.block_hashes[index]
        for event in engine.take_kv_events():
            if isinstance(event, BlockStored):
                assert set(event.block_hashes) <= verified
    assert engine.stats().spec_decode.num_draft_tokens > 0
    assert_all_blocks_free(engine)
