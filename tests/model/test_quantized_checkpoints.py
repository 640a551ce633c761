"""AWQ, GPTQ and fp8 Hugging Face folders load as the weights their formats describe: AWQ
and GPTQ packed (int4 planes), fp8 dequantized or repacked as int8, and refused clearly
where they cannot run.

The folders are written here from a random Llama by this file's own packers, which follow
the published ones (AutoAWQ's ``pack`` with its column order, GPTQ's sequential packing
with v1's ``zero - 1``, fp8 with DeepSeek-V3's 128 x 128 ``weight_scale_inv``), not by
pdserve's readers; the reference is the float weight the test's own integer codes describe.
No AWQ or GPTQ library is installed here (each needs a GPU build), so none wrote these.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.messages.engine_config import EngineConfig
from pdserve.model.loader import check_model, load_model
from pdserve.model.memory_estimate import weights_bytes
from pdserve.model.quantization import Int4PlanesWeight
from pdserve.model.quantization.quantized_weight import packed_weight
from tests.model.test_loader import save_llama

PROMPT = list(range(3, 30))
GROUP = 128
AWQ_PACKING_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble n holds column 8c + order[n]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("float"))


def random_llama(directory):
    """A random two-layer Llama whose linears take groups of 128 inputs, saved in
    ``directory``."""
    torch.manual_seed(0)
    model = save_llama(
        directory,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model.reference_directory = directory  # its tokenizer.json
    return model


def linears(model) -> dict[str, torch.Tensor]:
    return {
        name.removesuffix(".weight"): tensor
        for name, tensor in model.state_dict().items()
        if name.startswith("model.layers.") and "proj" in name
    }


def affine_codes(weight: torch.Tensor, group: int, bits: int, symmetric: bool = False):
    """Min-max codes ``[out, in]``, scales and zeros ``[groups, out]`` (float16 scales)."""
    top = (1 << bits) - 1
    rows, columns = weight.shape
    grouped = weight.view(rows, columns // group, group)
    if symmetric:
        scales = grouped.abs().amax(-1) / (top // 2)
        zeros = torch.full_like(scales, (top + 1) // 2)
    else:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = (high - low) / top
        zeros = torch.round(-low / scales).clamp(1, top)
    scales = scales.half().float()
    codes = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, top)
    return codes.view(rows, columns).int(), scales.t().contiguous(), zeros.t().int()


def dequantized(codes, scales, zeros, group) -> torch.Tensor:
    return (codes - zeros.t().repeat_interleave(group, 1)) * scales.t().repeat_interleave(group, 1)


def pack_along_columns(values: torch.Tensor, bits: int, order: list[int]) -> torch.Tensor:
    """``[rows, columns]`` to int32 ``[rows, columns * bits / 32]``, nibble n of each int
    holding column ``c * per_int + order[n]``."""
    per_int = 32 // bits
    packed = torch.zeros(values.shape[0], values.shape[1] // per_int, dtype=torch.int64)
    for nibble, column in enumerate(order):
        packed |= values[:, column::per_int].long() << (bits * nibble)
    return _as_int32(packed)


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


def write_quantized(directory, reference, quantization_config, tensors_of_linear) -> dict:
    """The reference's folder with each linear's weight replaced by its stored tensors;
    returns the float weights those tensors describe, by module."""
    reference.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    expected = {}
    for module, weight in linears(reference).items():
        del state[f"{module}.weight"]
        stored, expected[module] = tensors_of_linear(weight)
        state |= {f"{module}.{part}": tensor.contiguous() for part, tensor in stored.items()}
    for file in directory.glob("*.safetensors"):
        file.unlink()
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(
        (reference.reference_directory / "tokenizer.json").read_text()
    )
    return expected


def awq_linear(weight):
    codes, scales, zeros = affine_codes(weight, GROUP, 4)
    stored = {
        "qweight": pack_along_columns(codes.t(), 4, AWQ_PACKING_ORDER),
        "qzeros": pack_along_columns(zeros, 4, AWQ_PACKING_ORDER),
        "scales": scales.half(),
    }
    return stored, dequantized(codes, scales, zeros, GROUP)


def gptq_linear(bits: int, v1: bool, act_order: bool = False):
    def tensors(weight):
        group = GROUP if bits == 4 else -1
        size = weight.shape[1] if group == -1 else group
        codes, scales, zeros = affine_codes(weight, size, bits, symmetric=bits == 8)
        per_int = 32 // bits
        stored_zeros = zeros - 1 if v1 else zeros
        qweight = pack_along_columns(codes, bits, list(range(per_int))).t()  # along inputs
        g_idx = torch.arange(weight.shape[1]) // size
        reference_weight = dequantized(codes, scales, zeros, size)
        if act_order:  # inputs permuted: the same weight with scattered groups
            order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(1))
            g_idx = g_idx[order]
            codes = codes[:, order]
            reference_weight = reference_weight[:, order]
            qweight = pack_along_columns(codes, bits, list(range(per_int))).t()
        stored = {
            "qweight": qweight,
            "qzeros": pack_along_columns(stored_zeros, bits, list(range(per_int))),
            "scales": scales.half(),
            "g_idx": g_idx.int(),
        }
        return stored, reference_weight

    return tensors


def fp8_block_linear(weight):
    rows, columns = weight.shape
    blocks = weight.view(rows // 64, 64, columns // 64, 64)  # 64 x 64: the config's block
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    expanded = scale.repeat_interleave(64, 0).repeat_interleave(64, 1)
    fp8 = (weight / expanded).to(torch.float8_e4m3fn)
    return {"weight": fp8, "weight_scale_inv": scale}, fp8.float() * expanded


def fp8_channel_linear(weight):
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    fp8 = (weight / scale).to(torch.float8_e4m3fn)
    stored = {"weight": fp8, "weight_scale": scale, "input_scale": torch.tensor(1.0)}
    return stored, fp8.float() * scale


FORMATS = {
    "AWQ": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "zero_point": True,
            "version": "gemm",
        },
        awq_linear,
    ),
    "GPTQ": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq",
        },
        gptq_linear(4, v1=True),
    ),
    "GPTQ-8bit-v2": (
        {
            "quant_method": "gptq",
            "bits": 8,
            "group_size": -1,
            "sym": True,
            "checkpoint_format": "gptq_v2",
        },
        gptq_linear(8, v1=False),
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, reference):
    written = {}
    for name, (config, tensors) in FORMATS.items():
        directory = tmp_path_factory.mktemp(name)
        written[name] = (directory, write_quantized(directory, reference, config, tensors))
    return written


def last_logits(model, config) -> torch.Tensor:
    runner = ModelRunner(model, config, num_blocks=16, block_size=4)
    chunk = ScheduledChunk("a", PROMPT, 0, list(range(7)), sample=True)
    return runner.execute([chunk])[0]


def transformers_logits(reference, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference Llama in transformers with the dequantized weights put in."""
    model = transformers.LlamaForCausalLM(reference.config).eval()
    state = reference.state_dict() | {f"{m}.weight": w for m, w in weights.items()}
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def dequantized_load_logits(directory, reference, expected) -> torch.Tensor:
    """Loads ``directory`` with ``--quantization none``, checks it holds exactly the weights
    the codes describe and computes transformers' logits on them; returns those logits."""
    model, config, _ = load_model(str(directory), quantization="none")
    for module, weight in expected.items():
        torch.testing.assert_close(model.get_submodule(module).weight, weight, rtol=0, atol=0)
    want = transformers_logits(reference, expected)
    torch.testing.assert_close(last_logits(model, config), want, rtol=1e-4, atol=1e-4)
    return want


@pytest.mark.parametrize("name", list(FORMATS))
def test_an_int4_or_int8_folder_runs_packed_and_computes_its_dequantized_weights(
    folders, reference, name
):
    """``none`` holds exactly the weights the codes describe and computes transformers'
    logits on them; ``auto`` keeps them packed (int4 planes, offsets rounded to float16)
    and computes the same logits within 1 % of their spread (torch's kernel rounds the
    activations to bfloat16 where our float32 one is not built: ``int4_planes.py``)."""
    directory, expected = folders[name]
    scheme = name.split("-")[0]
    want = dequantized_load_logits(directory, reference, expected)

    packed_model, packed_config, _ = load_model(str(directory), quantization="auto")
    assert packed_config.quantization == scheme
    assert packed_config.fingerprint.startswith(f"LlamaForCausalLM[{scheme}]:")
    q_proj = packed_model.model.layers[0].self_attn.q_proj
    assert isinstance(packed_weight(q_proj), Int4PlanesWeight)
    got = last_logits(packed_model, packed_config)
    assert (got - want).abs().max() < 1e-2 * (want.max() - want.min())
    assert got.argmax() == want.argmax()
    assert check_model(str(directory), quantization="auto").quantization == scheme


def test_an_act_order_gptq_is_refused_packed_and_served_dequantized(tmp_path, folders, reference):
    """Groups scattered over the inputs are no runs the planes can hold."""
    config = FORMATS["GPTQ"][0] | {"desc_act": True}
    expected = write_quantized(tmp_path, reference, config, gptq_linear(4, True, act_order=True))
    with pytest.raises(ValueError, match="act-order groups are not runs.*--quantization none"):
        load_model(str(tmp_path), quantization="auto")
    dequantized_load_logits(tmp_path, reference, expected)


@pytest.mark.parametrize(
    "config, linear",
    [
        (
            {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "weight_block_size": [64, 64],
                "activation_scheme": "dynamic",
            },
            fp8_block_linear,
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    }
                },
            },
            fp8_channel_linear,
        ),
    ],
    ids=["fp8-block", "compressed-tensors-channel"],
)
def test_an_fp8_folder_is_dequantized_or_repacked_and_refused_as_it_is_stored(
    tmp_path, folders, reference, config, linear
):
    expected = write_quantized(tmp_path, reference, config, linear)
    with pytest.raises(ValueError, match="fp8 weights have no kernel.*none.*int8"):
        check_model(str(tmp_path), quantization="auto")
    with pytest.raises(ValueError, match="fp8 weights have no kernel"):
        load_model(str(tmp_path), quantization="auto")
    want = dequantized_load_logits(tmp_path, reference, expected)
    int8_model, int8_config, _ = load_model(str(tmp_path), quantization="int8")
    assert int8_config.quantization == "int8"
    got = last_logits(int8_model, int8_config)
    assert (got - want).abs().max() < 0.03 * (want.max() - want.min())


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf"])
def test_a_format_pdserve_does_not_read_is_refused_naming_those_it_does(
    tmp_path, reference, method
):
    """bitsandbytes is refused; "gguf" is what transformers writes in the config of a model it
    dequantized from a GGUF, whose weights are floats: it loads as one."""
    reference.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(
        (reference.reference_directory / "tokenizer.json").read_text()
    )
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if method == "gguf":
        assert check_model(str(tmp_path), quantization="auto").quantization == "none"
        return
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; supported: awq"):
        check_model(str(tmp_path))


def test_packed_folders_pass_for_a_gpu_in_its_formats_and_are_estimated_at_their_size(folders):
    """On CUDA, 4-bit AWQ and GPTQ run as int4 groups (``grouped_int4_weight.py``: 4.5 bits
    a weight, not the planes' 5) and an 8-bit GPTQ is refused naming what serves; the
    GPU's formats themselves run in ``interpreter_checks_packed_matmul.py``."""
    directory, _ = folders["AWQ"]
    assert check_model(str(directory), quantization="auto", device="cuda").quantization == "AWQ"
    with pytest.raises(ValueError, match="8-bit GPTQ weights have no kernel in pdserve on cuda"):
        check_model(str(folders["GPTQ-8bit-v2"][0]), quantization="auto", device="cuda")
    config = check_model(str(directory), quantization="auto")
    model, _, _ = load_model(str(directory), quantization="auto")
    packable = model.packable_weights()
    packed = weights_bytes(
        EngineConfig(model=str(directory), quantization="auto"), config, packable
    )
    float32 = weights_bytes(
        EngineConfig(model=str(directory), quantization="none"), config, packable
    )
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(packed_weight(m).nbytes for m in model.modules() if packed_weight(m) is not None)
    assert abs(packed - held) < 0.05 * held
    assert float32 > 4 * packed  # 32 bits a weight against the planes' 5
    on_gpu = weights_bytes(
        EngineConfig(model=str(directory), quantization="auto", device="cuda"), config, packable
    )
    assert on_gpu < packed
