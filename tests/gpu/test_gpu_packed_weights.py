"""AWQ, GPTQ and fp8 checkpoints on a GPU, kept at their size: the Triton kernels
(``model/quantization/packed_matmul_triton.py``) compiled for the device and checked against
the dequantized weights, and whole folders loaded on CUDA computing the logits of the
weights they describe. ``tests/model/interpreter_checks_packed_matmul.py`` runs the same
kernels in Triton's interpreter where no GPU is lent."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import load_model
from pdserve.model.quantization.fp8_weight import Fp8Weight
from pdserve.model.quantization.grouped_int4_weight import GroupedInt4Weight
from pdserve.model.quantization.quantized_weight import packed_weight
from tests.model.interpreter_checks_packed_matmul import assert_product, fp8_case, random_groups
from tests.model.test_quantized_checkpoints import (
    FORMATS,
    PROMPT,
    fp8_block_linear,
    random_llama,
    write_quantized,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
)
CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_multiply_as_the_dequantized_matrices(rows, dtype):
    int4 = GroupedInt4Weight.from_groups(random_groups(1000, 1024, 128, 0), CUDA)
    fp8 = Fp8Weight.from_checkpoint(*fp8_case(1000, 1024, "block", 1)[:3], CUDA)
    for weight in (int4, fp8):
        x = torch.randn(rows, 1024, device=CUDA).to(dtype)
        reference = weight.dequantize()
        assert_product(
            weight.matmul(x).cpu(),
            x.cpu(),
            (reference.to(dtype) if dtype != torch.float32 else reference).cpu(),
        )


@pytest.mark.parametrize("name", ["AWQ", "GPTQ", "fp8"])
def test_a_quantized_folder_on_cuda_computes_its_dequantized_logits(tmp_path, name):
    reference = random_llama(tmp_path / "float")
    config, linear = (
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, fp8_block_linear)
        if name == "fp8"
        else FORMATS[name]
    )
    write_quantized(tmp_path / name, reference, config, linear)
    logits = {}
    for quantization in ("none", "auto"):
        model, model_config, _ = load_model(
            str(tmp_path / name), quantization=quantization, device="cuda"
        )
        runner = ModelRunner(model, model_config, num_blocks=16, block_size=4, device=CUDA)
        chunk = ScheduledChunk("a", PROMPT, 0, list(range(7)), sample=True)
        logits[quantization] = runner.execute([chunk])[0].cpu()
    q_proj = packed_weight(model.model.layers[0].self_attn.q_proj)
    assert isinstance(q_proj, Fp8Weight if name == "fp8" else GroupedInt4Weight)
    assert q_proj.nbytes < 0.3 * q_proj.out_features * q_proj.in_features * 4
    torch.testing.assert_close(logits["auto"], logits["none"], rtol=1e-4, atol=1e-4)
