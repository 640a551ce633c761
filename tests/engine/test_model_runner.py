"""The paged model runner computes what transformers computes.

Each test saves a small random HF model (safetensors) to a temporary directory,
loads it with our loader, and compares ModelRunner logits or greedy tokens with
transformers' own forward / ``generate``. Block ids are shuffled, never contiguous,
so a correct result proves the paging.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import load_model
from tests.engine.hf_models import save_hf_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4


class PagedRequests:
    """Hands out shuffled block ids per request and builds chunks for them."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def chunk(
        self, request_id: str, token_ids: list[int], start: int, sample: bool = True
    ) -> ScheduledChunk:
        table = self.tables.setdefault(request_id, [])
        while len(table) * BLOCK_SIZE < start + len(token_ids):
            table.append(self.free.pop())
        return ScheduledChunk(request_id, list(token_ids), start, list(table), sample)


def random_tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 96) for _ in range(count)]


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float()


def make_runner(directory) -> ModelRunner:
    model, config, _ = load_model(str(directory))
    return ModelRunner(model, config, NUM_BLOCKS, BLOCK_SIZE)


ARCHITECTURES = [
    pytest.param(transformers.LlamaConfig, {}, id="llama"),
    pytest.param(transformers.Qwen2Config, {}, id="qwen2"),
    pytest.param(transformers.Qwen3Config, {"head_dim": 32}, id="qwen3"),
    pytest.param(transformers.MistralConfig, {"sliding_window": None}, id="mistral"),
    pytest.param(transformers.LlamaConfig, {"tie_word_embeddings": True}, id="llama-tied"),
]


@pytest.mark.parametrize("config_class, overrides", ARCHITECTURES)
def test_prefill_logits_equal_transformers(tmp_path, config_class, overrides):
    reference = save_hf_model(tmp_path, config_class, **overrides)
    runner = make_runner(tmp_path)
    prompt = random_tokens(23, seed=1)
    paged = PagedRequests(runner)
    logits = runner.execute([paged.chunk("a", prompt, 0)])
    torch.testing.assert_close(
        logits[0], reference_logits(reference, prompt)[-1], atol=ATOL, rtol=0
    )


def test_prefill_after_cached_prefix_equals_transformers(tmp_path):
    reference = save_hf_model(tmp_path, transformers.LlamaConfig)
    runner = make_runner(tmp_path)
    prompt = random_tokens(30, seed=2)
    paged = PagedRequests(runner)
    runner.execute([paged.chunk("a", prompt[:13], 0, sample=False)])
    # Clobber nothing, reuse the same blocks: the second part reads the prefix from the cache.
    logits = runner.execute([paged.chunk("a", prompt[13:], 13)])
    torch.testing.assert_close(
        logits[0], reference_logits(reference, prompt)[-1], atol=ATOL, rtol=0
    )


def test_chunked_prefill_in_three_chunks_equals_transformers(tmp_path):
    reference = save_hf_model(tmp_path, transformers.Qwen2Config)
    runner = make_runner(tmp_path)
    prompt = random_tokens(29, seed=3)
    expected = reference_logits(reference, prompt)
    paged = PagedRequests(runner)
    bounds = [(0, 10), (10, 19), (19, 29)]
    for start, end in bounds:
        logits = runner.execute([paged.chunk("a", prompt[start:end], start)])
        torch.testing.assert_close(logits[0], expected[end - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        pytest.param(transformers.LlamaConfig, {}, id="llama"),
        pytest.param(
            transformers.MistralConfig, {"sliding_window": 6}, id="mistral-sliding-window"
        ),
    ],
)
def test_mixed_batch_of_prefills_and_decodes_equals_transformers(tmp_path, config_class, overrides):
    """Requests of different lengths in one step: some prefill chunks, some one-token decodes."""
    reference = save_hf_model(tmp_path, config_class, **overrides)
    runner = make_runner(tmp_path)
    rng = random.Random(4)
    lengths = {"a": 5, "b": 17, "c": 9, "d": 26, "e": 3}
    prompts = {name: [rng.randrange(96) for _ in range(length)] for name, length in lengths.items()}
    expected = {name: reference_logits(reference, prompt) for name, prompt in prompts.items()}
    paged = PagedRequests(runner, seed=5)
    # Step 1: prefill a, b, c but their last prompt token, and the first 12 tokens of d.
    first = runner.execute(
        [
            paged.chunk("a", prompts["a"][:-1], 0),
            paged.chunk("b", prompts["b"][:-1], 0),
            paged.chunk("d", prompts["d"][:12], 0, sample=False),
            paged.chunk("c", prompts["c"][:-1], 0),
        ]
    )
    for row, name in enumerate("abc"):
        torch.testing.assert_close(first[row], expected[name][-2], atol=ATOL, rtol=0, msg=name)
    # Step 2: a, b, c decode one token (their last prompt token), d finishes its prefill,
    # e starts: decodes interleaved with prefills, in no particular order.
    chunks = [
        paged.chunk("c", prompts["c"][-1:], len(prompts["c"]) - 1),
        paged.chunk("d", prompts["d"][12:], 12),
        paged.chunk("a", prompts["a"][-1:], len(prompts["a"]) - 1),
        paged.chunk("e", prompts["e"], 0),
        paged.chunk("b", prompts["b"][-1:], len(prompts["b"]) - 1),
    ]
    logits = runner.execute(chunks)
    for row, chunk in enumerate(chunks):
        name = chunk.request_id
        torch.testing.assert_close(logits[row], expected[name][-1], atol=ATOL, rtol=0, msg=name)


def test_llama3_rope_scaling_equals_transformers(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    reference = save_hf_model(tmp_path, transformers.LlamaConfig, rope_parameters=rope)
    runner = make_runner(tmp_path)
    assert runner.model_config.rope_scaling["rope_type"] == "llama3"
    prompt = random_tokens(60, seed=6)
    paged = PagedRequests(runner)
    runner.execute([paged.chunk("a", prompt[:40], 0, sample=False)])
    logits = runner.execute([paged.chunk("a", prompt[40:], 40)])
    torch.testing.assert_close(
        logits[0], reference_logits(reference, prompt)[-1], atol=ATOL, rtol=0
    )


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, eos: int
) -> list[list[int]]:
    """Batched greedy decoding over the runner: all prompts in step 1, then one token each per step."""
    paged = PagedRequests(runner, seed=7)
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [paged.chunk(str(i), prompt, 0) for i, prompt in enumerate(prompts)]
    while chunks:
        tokens = runner.execute(chunks).argmax(dim=-1).tolist()
        next_chunks = []
        for chunk, token in zip(chunks, tokens):
            index = int(chunk.request_id)
            outputs[index].append(token)
            if token != eos and len(outputs[index]) < max_new_tokens:
                position = len(prompts[index]) + len(outputs[index]) - 1
                next_chunks.append(paged.chunk(chunk.request_id, [token], position))
        chunks = next_chunks
    return outputs


@pytest.mark.parametrize(
    "config_class",
    [
        pytest.param(transformers.LlamaConfig, id="llama"),
        pytest.param(transformers.Qwen2Config, id="qwen2"),
        pytest.param(transformers.Qwen3Config, id="qwen3"),
    ],
)
def test_greedy_generation_equals_transformers_generate(tmp_path, config_class):
    reference = save_hf_model(tmp_path, config_class)
    runner = make_runner(tmp_path)
    rng = random.Random(8)
    prompts = [[rng.randrange(2, 96) for _ in range(length)] for length in (3, 11, 7)]
    ours = greedy_generate(runner, prompts, max_new_tokens=20, eos=1)
    for prompt, output in zip(prompts, ours):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=1,
                pad_token_id=1,
            )
        assert output == generated[0, len(prompt) :].tolist()


def test_decode_before_an_all_logits_prefill_gets_its_own_row(tmp_path):
    """A decode ahead of a prompt-logprobs prefill: the runner moves the prefill first, and
    every token is a logit row, so the row count matches the token count but their order
    does not (main returned the prefill's first row as the decode's)."""
    reference = save_hf_model(tmp_path, transformers.LlamaConfig)
    runner = make_runner(tmp_path)
    decoding, echoed = random_tokens(9, seed=7), random_tokens(6, seed=8)
    paged = PagedRequests(runner, seed=9)
    runner.execute([paged.chunk("a", decoding[:-1], 0)])
    logits = runner.execute(
        [
            paged.chunk("a", decoding[-1:], len(decoding) - 1),
            replace(paged.chunk("b", echoed, 0), all_logits=True),
        ]
    )
    torch.testing.assert_close(
        logits[0], reference_logits(reference, decoding)[-1], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(logits[1:], reference_logits(reference, echoed), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        pytest.param(transformers.LlamaConfig, {}, id="llama"),
        pytest.param(
            transformers.MistralConfig, {"sliding_window": 6}, id="mistral-sliding-window"
        ),
    ],
)
def test_verification_rows_beside_a_prefill_and_a_decode_equal_transformers(
    tmp_path, config_class, overrides
):
    """A speculative verification (a last token and three drafts) goes with the decodes,
    reading its pages in place: each of its rows equals transformers' logits at its
    position, beside a prefill and a plain decode in the same step."""
    reference = save_hf_model(tmp_path, config_class, **overrides)
    runner = make_runner(tmp_path)
    verified, decoding, fresh = (random_tokens(n, seed=s) for n, s in ((23, 1), (11, 2), (7, 3)))
    paged = PagedRequests(runner, seed=4)
    runner.execute([paged.chunk("v", verified[:-4], 0), paged.chunk("d", decoding[:-1], 0)])
    chunks = [
        paged.chunk("d", decoding[-1:], len(decoding) - 1),
        replace(paged.chunk("v", verified[-4:], len(verified) - 4), num_draft_tokens=3),
        paged.chunk("p", fresh, 0),
    ]
    logits = runner.execute(chunks)
    assert logits.shape[0] == 1 + 4 + 1
    torch.testing.assert_close(
        logits[0], reference_logits(reference, decoding)[-1], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        logits[1:5], reference_logits(reference, verified)[-4:], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(logits[5], reference_logits(reference, fresh)[-1], atol=ATOL, rtol=0)


def test_an_engines_rope_tables_are_built_for_every_position_it_serves_at_start():
    """A decode worker first reaches a long prompt's positions at its first decode after the
    pull; the table built then would cost that step. Built at start-up, a forward at the
    engine's last position finds it whole, and its rows equal a table grown on demand."""
    from pdserve.engine import LLMEngine
    from pdserve.model.architectures.rotary import RotaryEmbedding

    engine = LLMEngine.from_pretrained("tiny", num_kv_blocks=80, block_size=16)
    assert engine.max_model_len == 79 * 16  # the pool bounds it
    rotary = next(m for m in engine.model.modules() if isinstance(m, RotaryEmbedding))
    grown = RotaryEmbedding(engine.model_config)
    last = torch.tensor([0, engine.max_model_len - 1])
    table = rotary._table
    reserved = rotary.forward(last, engine.max_model_len, torch.float32)
    assert rotary._table is table  # nothing was built by the step
    for built, on_demand in zip(reserved, grown.forward(last, engine.max_model_len, torch.float32)):
        assert torch.equal(built, on_demand)
    engine.shutdown()
