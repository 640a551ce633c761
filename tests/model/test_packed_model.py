"""A model whose weights stay packed (``--quantization``) computes what its dequantized twin
computes, runs in the formats it names, and is refused where it cannot run.

GGUFs are written here (``test_gguf_loader.py``'s writer, a random Llama); the kernels
themselves are checked against the dequantized reference in ``test_quantized_weight.py``.
Here: the wiring. Fused q/k/v and gate/up, the un-permuted rows of a Llama GGUF, the
embedding looked up row by row, a tied LM head that is the embedding's packed weight, and
the fingerprint that keeps a packed worker from pairing with a float one.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType as Quant

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import check_model, check_tensor_parallel, load_model
from pdserve.model.quantization import QuantizedWeight, int4_tiles_kernel
from pdserve.model.quantization.quantized_weight import packed_weight
from tests.model.test_gguf_loader import gguf_tensors, random_model, write_gguf

PROMPT = list(range(40, 61))
PACKED_TYPES = [Quant.Q8_0, Quant.Q4_0, Quant.Q4_1, Quant.Q5_0, Quant.Q5_1]


@pytest.fixture(scope="module")
def reference():
    return random_model(tie_word_embeddings=True)


def last_logits(model, config) -> torch.Tensor:
    runner = ModelRunner(model, config, num_blocks=8, block_size=4)
    chunk = ScheduledChunk("a", PROMPT, 0, [6, 1, 4, 0, 7, 2], sample=True)
    return runner.execute([chunk])[0]


@pytest.mark.parametrize("quant", PACKED_TYPES, ids=lambda quant: quant.name)
def test_a_packed_gguf_computes_what_its_dequantized_load_computes(tmp_path, reference, quant):
    """The kernels multiply float32 or bfloat16-rounded activations (``int4_planes.py``
    derives the bound per product; the kernels are checked against it in
    ``test_quantized_weight.py``) by the weights the dequantized load holds: over two layers
    of a random model the logits stay within 3 % of their spread (2 % where our float32
    kernel serves; torch's bfloat16 one elsewhere), the same token on top. The integer-dot
    kernel, which rounds activations to 16 bits, is set aside here: this checks the wiring
    at the exact kernel's precision (its own bound is checked per product, and smollm2 run
    through it in ``tests/engine/test_smollm2_packed.py``)."""
    path = tmp_path / f"llama-{quant.name}.gguf"
    tensors = gguf_tensors(reference)
    tensors.pop("output.weight")  # tied: the LM head is the embedding
    write_gguf(path, tensors, quant)
    packed_model, packed_config, _ = load_model(str(path), quantization="auto")
    float_model, float_config, _ = load_model(str(path), quantization="none")
    assert packed_config.quantization == quant.name and float_config.quantization == "none"
    attention = packed_model.model.layers[0].self_attn
    assert isinstance(packed_weight(attention.q_proj), QuantizedWeight)
    expected = last_logits(float_model, float_config)
    with mock.patch.object(int4_tiles_kernel, "dots_tiles_of", lambda tile_rows: False):
        got = last_logits(packed_model, packed_config)
    assert (got - expected).abs().max() < 0.03 * (expected.max() - expected.min())
    assert got.argmax() == expected.argmax()
    assert packed_model.lm_head_weight is packed_weight(packed_model.model.embed_tokens)


def test_int8_packs_a_float_checkpoints_linears_within_the_rounding_of_a_row(tmp_path, reference):
    """int8 per output channel errs by at most half a step (max |w| / 254) per weight; over
    two layers the logits stay within a few percent of their spread."""
    path = tmp_path / "llama-f32.gguf"
    write_gguf(path, gguf_tensors(reference))
    model, config, _ = load_model(str(path), quantization="int8")
    float_model, float_config, _ = load_model(str(path), quantization="none")
    assert config.quantization == "int8"
    expected = last_logits(float_model, float_config)
    got = last_logits(model, config)
    assert (got - expected).abs().max() < 0.03 * (expected.max() - expected.min())
    assert got.argmax() == expected.argmax()


def test_the_fingerprint_names_the_packing_so_a_packed_worker_never_pairs_with_a_float_one(
    tmp_path, reference
):
    path = tmp_path / "llama-q4_1.gguf"
    write_gguf(path, gguf_tensors(reference), Quant.Q4_1)
    _, packed, _ = load_model(str(path), quantization="auto")
    _, dequantized, _ = load_model(str(path), quantization="none")
    assert packed.fingerprint.startswith("LlamaForCausalLM[Q4_1]:")
    assert dequantized.fingerprint.startswith("LlamaForCausalLM:")


def test_packed_weights_are_refused_where_they_cannot_run(tmp_path, reference):
    """On a GPU (the packed kernels are CPU ones) and split over tensor-parallel ranks at
    other than whole groups of 32 inputs, before a weight is read, naming the formats and
    what would serve."""
    path = tmp_path / "llama-q4_0.gguf"
    write_gguf(path, gguf_tensors(reference), Quant.Q4_0)
    with pytest.raises(ValueError, match=r"packed as Q4_0 run on CPU only, not on cuda.*none"):
        check_model(str(path), quantization="auto", device="cuda")
    config = check_model(str(path), quantization="auto")
    assert config.quantization == "Q4_0"
    check_tensor_parallel(config, 2)  # each rank: 32 attention and 64 intermediate inputs
    with pytest.raises(ValueError, match=r"packed as Q4_0 split only at multiples of 32"):
        check_tensor_parallel(config, 4)  # 16 attention features a rank
    check_tensor_parallel(check_model(str(path), quantization="none"), 4)
