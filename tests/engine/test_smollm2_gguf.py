"""The built-in ``smollm2`` (a real Q4_1 GGUF) computes what transformers computes from the same file.

The reference is transformers' own GGUF load (``from_pretrained(dir, gguf_file=...)``), which
dequantizes and un-permutes independently of our loader (converted once per environment and
kept in pytest's cache: tests/transformers_reference.py). Both engines are built once per
module (≈ 0.5 GB each in float32; ours dequantized, ``quantization="none"``: the packed path
is checked against this one in ``test_smollm2_packed.py``). Skipped, with the install command,
when the wheel is absent.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.test_sampling_fields import reference_tokens
from tests.transformers_reference import reference_model

ATOL = 1e-3  # float32 over 30 layers; logits reach ~25
BLOCK_SIZE = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [
        {"role": "user", "content": "Count from 1 to 5."},
        {"role": "assistant", "content": "1, 2, 3, 4, 5"},
        {"role": "user", "content": "Now backwards."},
    ],
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf, pytestconfig) -> transformers.PreTrainedModel:
    torch.set_num_threads(1)
    return reference_model(pytestconfig, smollm2_gguf)


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> LLMEngine:
    return LLMEngine.from_pretrained(
        "smollm2", num_kv_blocks=64, block_size=BLOCK_SIZE, quantization="none"
    )


def chat_prompt_ids(engine: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    prompt = engine.tokenizer.chat_template.render(messages)
    return engine.tokenizer.encode(prompt, add_special_tokens=False)


def reference_last_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1]


def test_config_and_tokenizer_come_from_the_gguf_metadata(engine):
    config = engine.model_config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (
        9,
        3,
        64,
        49152,
    )
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == [2] and engine.tokenizer.eos_token_ids == (2,)


def test_prefill_cached_prefix_and_decode_logits_equal_transformers(engine, reference):
    """Shuffled, non-contiguous blocks; the second request reads its first 16 tokens from the cache."""
    runner = ModelRunner(engine.model, engine.model_config, num_blocks=12, block_size=BLOCK_SIZE)
    prompt = chat_prompt_ids(engine, CHATS[0])
    assert 32 < len(prompt) <= 4 * BLOCK_SIZE - 4
    blocks = [7, 2, 9, 4]
    logits = runner.execute([ScheduledChunk("plain", prompt, 0, blocks, sample=True)])
    torch.testing.assert_close(
        logits[0], reference_last_logits(reference, prompt), atol=ATOL, rtol=0
    )

    cached = [5, 11, 0, 3]
    runner.execute([ScheduledChunk("cached", prompt[:16], 0, cached, sample=False)])
    logits = runner.execute([ScheduledChunk("cached", prompt[16:], 16, cached, sample=True)])
    torch.testing.assert_close(
        logits[0], reference_last_logits(reference, prompt), atol=ATOL, rtol=0
    )

    sequence = list(prompt)
    for _ in range(4):
        sequence.append(int(logits[0].argmax()))
        logits = runner.execute(
            [ScheduledChunk("plain", sequence[-1:], len(sequence) - 1, blocks, sample=True)]
        )
        torch.testing.assert_close(
            logits[0], reference_last_logits(reference, sequence), atol=ATOL, rtol=0
        )


def test_greedy_chat_replies_equal_transformers_generate_token_for_token(engine, reference):
    prompts = [chat_prompt_ids(engine, chat) for chat in CHATS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        assert output.output_token_ids == generated[0, len(prompt) :].tolist()
    assert outputs[0].text == "The capital of France is Paris."
    assert outputs[0].output_token_ids[-1] == 2 and outputs[0].finish_reason == "stop"
    assert not any("<|im_end|>" in output.text for output in outputs)


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=6),
        dict(temperature=0.7, seed=9, presence_penalty=0.8, min_p=0.05, logit_bias={504: -5.0}),
    ],
    ids=["greedy", "seeded"],
)
def test_sampling_fields_give_the_reference_tokens_on_smollm2(engine, reference, fields):
    """vLLM's penalties and logits fields on the real model, against the reference written
    from vLLM's definitions over transformers' logits (tests/engine/test_sampling_fields.py)."""
    params = SamplingParams(max_tokens=12, **fields)
    prompt = chat_prompt_ids(engine, [{"role": "user", "content": "Name three colours."}])
    (output,) = engine.generate([prompt], params)
    eos = engine.tokenizer.eos_token_id
    assert output.output_token_ids == reference_tokens(reference, prompt, params, eos)
