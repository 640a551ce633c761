"""vLLM's sampling fields (penalties, ``logit_bias``, ``min_p``, ``min_tokens``,
``bad_words``, ``allowed_token_ids``) against a reference written from vLLM's definitions
over transformers' logits, token for token, greedy and seeded; speculation on equals off.

The reference recomputes each step's logits with transformers over the whole sequence and
applies the fields in vLLM's order with plain Python loops (``reference_tokens``); only the
seeded draw (``sampler.draw_seed`` and the exponential race) is pdserve's own, as it is what
makes a seed reproduce.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.sampler import draw_seed
from tests.engine.hf_models import save_hf_model

EOS = 1
VOCAB = 96
BASE = SamplingParams(max_tokens=24, temperature=0.0)
CASES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition below 1": dict(repetition_penalty=0.7),
    "frequency and presence": dict(frequency_penalty=1.5, presence_penalty=0.8),
    "negative frequency": dict(frequency_penalty=-0.6),
    "logit_bias": dict(logit_bias={5: 6.0, 7: -100.0, 40: 2.5}),
    "min_tokens before a likely EOS": dict(min_tokens=9, logit_bias={EOS: 9.0}),
    "bad_words": dict(bad_words_token_ids=[[12], [30, 31], [44, 45, 46]]),
    "allowed_token_ids": dict(allowed_token_ids=[3, 8, 13, 21, 34, 55, 89]),
    "seeded min_p with penalties": dict(
        temperature=0.9, seed=11, min_p=0.08, frequency_penalty=0.7, repetition_penalty=1.2
    ),
    "seeded everything": dict(
        temperature=1.1,
        seed=5,
        top_k=40,
        min_p=0.02,
        presence_penalty=1.0,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={9: 3.0},
        min_tokens=4,
        bad_words_token_ids=[[20], [50, 51]],
        stop_token_ids=[60],
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[transformers.PreTrainedModel, str]:
    folder = tmp_path_factory.mktemp("llama")
    return save_hf_model(folder, transformers.LlamaConfig, seed=3), str(folder)


@pytest.fixture(scope="module")
def engine(models) -> LLMEngine:
    return LLMEngine.from_pretrained(models[1], block_size=4, num_kv_blocks=256)


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (7, 19, 33)]


def reference_tokens(
    model: transformers.PreTrainedModel, prompt: list[int], params: SamplingParams, eos: int = EOS
) -> list[int]:
    """vLLM's definitions, one token at a time over transformers' logits (the penalties
    change only the ids the prompt and output hold: the loop visits those)."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].double().tolist()
        position = len(output)
        if params.allowed_token_ids is not None:
            logits = [
                v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(logits)
            ]
        for word in params.bad_words_token_ids:
            if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
                logits[word[-1]] = -math.inf
        if position < params.min_tokens:
            for token in {*params.stop_token_ids, *([] if params.ignore_eos else [eos])}:
                logits[token] = -math.inf
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        for token in {*prompt, *output}:  # repetition: seen in the prompt or the output
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
            count = output.count(token)
            logits[token] -= params.frequency_penalty * count
            logits[token] -= params.presence_penalty * (count > 0)
        token = _draw(logits, params, position)
        output.append(token)
        stops = {*params.stop_token_ids, *([] if params.ignore_eos else [eos])}
        if len(output) >= params.min_tokens and token in stops:
            break
    return output


def _draw(logits: list[float], params: SamplingParams, position: int) -> int:
    values = torch.tensor(logits, dtype=torch.float32)
    if params.greedy:
        return int(values.argmax())
    scaled = values / params.temperature
    if params.min_p:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if params.top_k:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    noise = torch.empty(len(logits)).exponential_(
        generator=torch.Generator().manual_seed(draw_seed(params.seed, position))
    )
    return int((torch.softmax(scaled, dim=-1) / noise).argmax())


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_field_gives_the_reference_tokens(models, engine, case) -> None:
    params = dataclasses.replace(BASE, **CASES[case])
    outputs = engine.generate(prompts(), params)
    for prompt, output in zip(prompts(), outputs):
        assert output.output_token_ids == reference_tokens(models[0], prompt, params), case
    assert engine.kv_cache_manager.usage == 0.0


def test_the_fields_change_the_output(engine) -> None:
    """No case is vacuous: each gives another output than the same request without it."""
    plain = [o.output_token_ids for o in engine.generate(prompts(), BASE)]
    for case, fields in CASES.items():
        params = dataclasses.replace(BASE, **fields)
        if params.greedy:
            assert [o.output_token_ids for o in engine.generate(prompts(), params)] != plain, case


def test_min_tokens_holds_off_eos_and_a_stop_id_then_lets_them_end_it(engine) -> None:
    params = dataclasses.replace(BASE, min_tokens=9, logit_bias={EOS: 50.0})
    for output in engine.generate(prompts(), params):
        assert len(output.output_token_ids) == 10 and output.output_token_ids[-1] == EOS
        assert EOS not in output.output_token_ids[:-1]


def test_a_batch_mixing_fields_samples_each_row_as_alone(engine) -> None:
    """Rows never read each other's fields: a mixed batch equals each request run alone."""
    all_params = [dataclasses.replace(BASE, **fields) for fields in CASES.values()]
    batch_prompts = [prompts()[i % 3] for i in range(len(all_params))]
    together = engine.generate(batch_prompts, all_params)
    for prompt, params, output in zip(batch_prompts, all_params, together):
        (alone,) = engine.generate([prompt], params)
        assert output.output_token_ids == alone.output_token_ids


def test_speculative_decoding_on_equals_off_with_every_field(models) -> None:
    """Draft rows see the output plus the drafts before them, so verified runs sample as
    plain steps would; repetitive prompts make the n-gram drafter propose."""
    off = LLMEngine.from_pretrained(models[1], block_size=4, num_kv_blocks=256)
    on = LLMEngine.from_pretrained(
        models[1], block_size=4, num_kv_blocks=256, speculative_method="ngram"
    )
    repetitive = [[5, 6, 7, 8, 9] * 6, [20, 21, 22] * 9, [40, 41, 42, 43] * 7]
    all_params = [
        dataclasses.replace(BASE, max_tokens=40, ignore_eos=True, **fields)
        for fields in CASES.values()
    ]
    batch_prompts = [repetitive[i % 3] for i in range(len(all_params))]
    expected = [o.output_token_ids for o in off.generate(batch_prompts, all_params)]
    assert [o.output_token_ids for o in on.generate(batch_prompts, all_params)] == expected
    assert on.stats().spec_decode.num_draft_tokens > 0


def test_prompt_logprobs_equal_transformers_with_and_without_a_prefix_hit(models, engine) -> None:
    """Each prompt token's logprob, rank and top-3 equal transformers' log-softmax within
    1e-4. The second run's prompt is in the prefix cache: a request asking for prompt
    logprobs computes its prompt anyway (as vLLM), so they come back all the same."""
    prompt = prompts()[2]
    with torch.no_grad():
        reference = torch.log_softmax(models[0](torch.tensor([prompt])).logits[0].double(), -1)
    params = dataclasses.replace(BASE, max_tokens=2, prompt_logprobs=3)
    engine.generate([prompt], dataclasses.replace(params, prompt_logprobs=None))  # cache it
    (output,) = engine.generate([prompt], params)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        expected = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - expected[prompt[position]].item()) < 1e-4
        assert entry.rank == int((expected > expected[prompt[position]]).sum()) + 1
        top_ids, top_values = zip(*entry.top)
        assert list(top_ids) == expected.topk(3).indices.tolist()
        assert max(abs(a - b) for a, b in zip(top_values, expected.topk(3).values.tolist())) < 1e-4


def test_skip_special_tokens_false_keeps_their_text() -> None:
    """tiny's byte tokenizer: ids from 257 up are specials that decode to their names."""
    tiny = LLMEngine.from_pretrained("tiny", num_kv_blocks=64, block_size=16)
    forced = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={300: 100.0})
    skipped, kept = tiny.generate(
        [[5, 6, 7]] * 2, [forced, dataclasses.replace(forced, skip_special_tokens=False)]
    )
    assert skipped.output_token_ids == kept.output_token_ids == [300, 300, 300]
    assert skipped.text == "" and kept.text == tiny.tokenizer.backend.id_to_token(300) * 3
