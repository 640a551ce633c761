"""LLMEngine on the built-in tiny model: scheduling under pressure, prefix caching, stops,
aborts and bad input. Model numerics against transformers live in test_model_runner.py and
tests/model/."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.messages.sampling_params import MIN_TEMPERATURE
from tests.kvconnector.disaggregation import run_to_completion

BLOCK_SIZE = 16


def make_engine(**config: object) -> LLMEngine:
    defaults = dict(block_size=BLOCK_SIZE, num_kv_blocks=256, max_num_batched_tokens=512)
    defaults.update(config)
    return LLMEngine.from_pretrained("tiny", **defaults)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def random_prompts(seed: int, count: int, shared_prefix_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix_len)]
    return [
        prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 60))] for _ in range(count)
    ]


def token_ids(outputs) -> list[list[int]]:
    return [out.output_token_ids for out in outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    manager = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.held_for_transfer
    assert manager.usage == 0.0, f"{manager.usage:.1%} of the pool is still referenced"


def test_generate_is_deterministic_and_independent_of_batching(engine: LLMEngine) -> None:
    prompts = random_prompts(0, 6)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(6)]
    batched = token_ids(engine.generate(prompts, params))
    one_by_one = [token_ids(engine.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    assert batched == one_by_one
    assert all(len(t) == 12 for t in batched)
    assert_all_blocks_free(engine)


def test_generate_refuses_to_run_beside_a_request_in_flight_and_leaves_it_whole(
    engine: LLMEngine,
) -> None:
    """generate() steps the engine to its own requests' end: beside another request it
    consumed that request's final output (and then failed with a KeyError, its own
    requests left holding blocks). It refuses, and the other request finishes for its
    caller."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("other", [8, 9, 10], params)
    with pytest.raises(RuntimeError, match="no request in flight"):
        engine.generate([[8, 9, 10]], params)
    (other,) = run_to_completion(engine, ["other"])
    assert other.output_token_ids == token_ids(engine.generate([[8, 9, 10]], params))[0]
    assert_all_blocks_free(engine)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(engine: LLMEngine) -> None:
    """max_tokens and the stop string end the request at one token: the stop is why
    (OpenAI's "stop"), with the text cut before it; it was reported as "length"."""
    prompt = [(7 * i + 6) % 256 for i in range(40)]  # tiny's greedy reply: "M", then "%"
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], greedy)[0].text.startswith("M")
    for max_tokens, stop in ((1, "M"), (3, "%")):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[stop])
        (output,) = engine.generate([prompt], params)
        assert (output.finish_reason, output.stop_reason) == ("stop", stop)
        assert stop not in output.text
    assert_all_blocks_free(engine)


def test_a_temperature_near_zero_samples_as_the_lowest_one_not_token_zero(
    engine: LLMEngine,
) -> None:
    """1e-38 took the logits past float32's range: NaN probabilities, token 0 every time.
    Below MIN_TEMPERATURE (vLLM's floor) a temperature is that floor."""
    prompt = [(7 * i + 6) % 256 for i in range(40)]
    tokens = {
        temperature: token_ids(
            engine.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature, seed=7))
        )[0]
        for temperature in (1e-38, MIN_TEMPERATURE)
    }
    assert SamplingParams(temperature=1e-38).temperature == MIN_TEMPERATURE
    assert tokens[1e-38] == tokens[MIN_TEMPERATURE] != [0] * 8


def test_tiny_pool_preempts_but_every_request_matches_the_large_pool() -> None:
    prompts = random_prompts(1, 8, shared_prefix_len=20)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = token_ids(make_engine().generate(prompts, params))
    # 12 usable blocks of 16 tokens: one request fits, eight never fit together.
    small = make_engine(num_kv_blocks=13, max_num_batched_tokens=64)
    assert token_ids(small.generate(prompts, params)) == reference
    assert small.stats().num_preemptions > 0
    assert_all_blocks_free(small)


def test_prefix_cache_hit_gives_same_tokens_as_cold() -> None:
    prompt = random_prompts(2, 1, shared_prefix_len=100)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    cached = make_engine()
    cold_run = token_ids(cached.generate([prompt], params))
    warm_run = token_ids(cached.generate([prompt], params))
    uncached = token_ids(make_engine(enable_prefix_caching=False).generate([prompt], params))
    assert cold_run == warm_run == uncached
    stats = cached.stats()
    full_blocks = len(prompt) // BLOCK_SIZE
    hit_tokens = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # last token always recomputed
    assert stats.prefix_cache_hits >= min(full_blocks * BLOCK_SIZE, hit_tokens)


def test_second_request_reuses_the_first_requests_blocks(engine: LLMEngine) -> None:
    prompt = random_prompts(3, 1, shared_prefix_len=64)[0]
    engine.generate([prompt], SamplingParams(max_tokens=2))
    outputs = engine.generate([prompt], SamplingParams(max_tokens=2))
    assert outputs[0].num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_chunked_prefill_matches_unchunked() -> None:
    prompts = random_prompts(4, 3, shared_prefix_len=150)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    whole = token_ids(make_engine(max_num_batched_tokens=1024).generate(prompts, params))
    chunked = token_ids(make_engine(max_num_batched_tokens=32).generate(prompts, params))
    assert whole == chunked


def test_stop_token_ids_and_max_tokens(engine: LLMEngine) -> None:
    prompt = random_prompts(5, 1)[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert free_run.finish_reason in ("length", "stop")
    # A token past the first whose text shows (tiny's ids over 255 decode to nothing).
    stop_at = next(
        token
        for token in free_run.output_token_ids[1:]
        if engine.tokenizer.decode([token]) and token != free_run.output_token_ids[0]
    )
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    first = free_run.output_token_ids.index(stop_at)
    assert stopped.output_token_ids == free_run.output_token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)  # vLLM's field
    # The stop token's id is output, its text is not (vLLM's rule; it was, before).
    before_stop = engine.tokenizer.decode(free_run.output_token_ids[:first])
    assert stopped.text == before_stop != engine.tokenizer.decode(stopped.output_token_ids)
    if free_run.finish_reason == "length":
        assert free_run.stop_reason is None


def test_stop_string_cuts_text(engine: LLMEngine) -> None:
    prompt = "The quick brown fox"
    free_run = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert len(free_run.text) >= 4, free_run.text
    stop = free_run.text[2:4]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])
    )[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == free_run.text[: free_run.text.index(stop)]


def step_texts(engine: LLMEngine, prompt: str, params: SamplingParams) -> list[str]:
    """The text of each output one request reports, step by step."""
    engine.add_request("texts", prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.text for out in engine.step() if out.request_id == "texts"]
    return texts


def test_a_stop_string_split_over_two_steps_never_shows_its_first_half(
    engine: LLMEngine,
) -> None:
    """A stop string whose first characters come a step before the rest: the text reported
    in between must not hold them, since the stop will cut them (a stream cannot take back
    characters it sent). Before stable_length the host streamed them and the reply kept them."""
    prompt = "The quick brown fox"
    free_run = step_texts(engine, prompt, SamplingParams(max_tokens=20, temperature=0.0))
    final = free_run[-1]
    boundaries = [len(text) for text in free_run[:-1] if 0 < len(text) < len(final)]
    split = next(b for b in boundaries if final.index(final[b - 1 : b + 1]) == b - 1)
    stop = final[split - 1 : split + 1]
    stopped = step_texts(
        engine, prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])
    )
    assert stopped[-1] == final[: split - 1]
    for text in stopped:
        assert stopped[-1].startswith(text), (text, stopped[-1])


def test_abort_frees_every_block() -> None:
    engine = make_engine()
    prompts = random_prompts(6, 4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_cache_manager.usage > 0
    for i in range(len(prompts)):
        assert engine.abort(f"r{i}")
    assert not engine.abort("never-added")
    assert_all_blocks_free(engine)


def test_max_model_len_caps_output() -> None:
    engine = make_engine(max_model_len=40)
    out = engine.generate([[1] * 35], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.output_token_ids) == 40


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 100_000], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1] * 40_000, SamplingParams(), "max_model_len"),
    ],
)
def test_bad_prompts_raise_clear_errors(engine: LLMEngine, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params_raise_clear_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("model", ["/nonexistent/model/dir"])
def test_unknown_model_path_raises(model: str) -> None:
    with pytest.raises((FileNotFoundError, ValueError), match="nonexistent"):
        LLMEngine.from_pretrained(model)


@pytest.mark.parametrize("architecture", ["LlamaConfig", "Qwen2Config", "MistralConfig"])
def test_engine_greedy_generate_equals_transformers_on_a_local_checkpoint(
    tmp_path, architecture
) -> None:
    import torch
    import transformers

    from tests.engine.hf_models import save_hf_model

    reference = save_hf_model(tmp_path, getattr(transformers, architecture))
    engine = LLMEngine.from_pretrained(
        str(tmp_path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16
    )
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (5, 13, 30)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=15, temperature=0.0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=15,
                do_sample=False,
                eos_token_id=1,
                pad_token_id=1,
            )
        assert output.output_token_ids == generated[0, len(prompt) :].tolist()
    assert_all_blocks_free(engine)


def test_a_request_waiting_for_room_counts_one_prefix_cache_query() -> None:
    # 12 usable blocks of 16 tokens: the second 150-token prompt waits (its admission
    # fails, step after step) until the first finishes; it is still one query.
    engine = make_engine(num_kv_blocks=13, max_num_batched_tokens=256)
    prompts = [list(range(150)), list(range(100, 250))]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.prefix_cache_requests == 2
    assert stats.prefix_cache_queries == 300
