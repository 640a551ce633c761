"""Loading a Llama, Qwen2, Qwen3, Qwen3-MoE or Gemma 3 model from a GGUF file (llama.cpp's
format), e.g. the built-in ``smollm2``.

A quantized tensor of a weight the architecture can run packed (``packable_weights``)
stays packed unless ``--quantization none`` (``model/quantization/``: multiplied as it is
stored); every other tensor is dequantized to float32 by the ``gguf`` package's own
dequantizer and cast to the engine dtype. Each is renamed from llama.cpp's names to ours
(transformers' names), and, for
``attn_q`` / ``attn_k``, un-permuted: llama.cpp's converter reorders each head's rows so
that its RoPE rotates adjacent pairs ``(x0, x1), (x2, x3) ...``, while our RoPE (like
transformers') rotates halves ``(x0, x_{d/2}), (x1, x_{d/2+1}) ...``. Per head of
``head_dim`` rows::

    HF row order    [ 0  1  2 ... d/2-1 | d/2  d/2+1 ... d-1 ]      (first half, second half)
    GGUF row order  [ 0  d/2  1  d/2+1  2  d/2+2 ...  d/2-1  d-1 ]  (the halves interleaved)

so the inverse views each head as ``[2 (pair), d/2]`` rows and swaps the two axes. Only
Llama's converter permutes: Qwen2, Qwen3 and Gemma 3 run llama.cpp's NeoX RoPE, which
rotates halves as ours does, so their rows load as stored (with Qwen2's q/k/v biases and
Qwen3's and Gemma 3's q/k norms).

Gemma 3 names its four norms per layer its own way (``ffn_norm`` is the norm *before* the
MLP there, ``post_attention_norm`` / ``post_ffw_norm`` the ones after attention and the
MLP), and llama.cpp's converter stores every Gemma norm weight as ``1 + w``: the loader
subtracts the 1 again, as transformers does, since our RMSNorm adds it
(``norm_weight_offset``).
"""

from __future__ import annotations

import re
from collections.abc import Set

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Quant

from pdserve.model.freed_memory import release_freed_memory
from pdserve.model.model_config import ModelConfig
from pdserve.model.quantization import QuantizedWeight, gguf_weight

# Tensor types stored as floats: read as they are, never packed.
FLOAT_TYPES = frozenset({Quant.F32, Quant.F16, Quant.BF16})

# Weight types loaded (the package dequantizes each); anything else is refused by name
# (``check_gguf_tensors``).
SUPPORTED_QUANTIZATIONS = frozenset(
    {
        Quant.F32,
        Quant.F16,
        Quant.BF16,
        Quant.Q4_0,
        Quant.Q4_1,
        Quant.Q5_0,
        Quant.Q5_1,
        Quant.Q8_0,
        Quant.Q2_K,
        Quant.Q3_K,
        Quant.Q4_K,
        Quant.Q5_K,
        Quant.Q6_K,
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's names where they differ from (or add to) the map above.
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Qwen3-MoE's router, and its experts stacked in one tensor each (``[experts, out, in]``),
# split into one weight per expert (``{expert}``: ``_split_experts``).
_QWEN3MOE_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}
# DeepSeek-V2/V3's latent attention, router (with V3's correction bias), experts and
# shared experts. Newer llama.cpp files split ``attn_kv_b`` into ``attn_k_b`` / ``attn_v_b``:
# not read (refused by name).
_DEEPSEEK2_LAYER_NAMES = _QWEN3MOE_LAYER_NAMES | {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_LAYER_NAMES_BY_ARCHITECTURE = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen3moe": _QWEN3MOE_LAYER_NAMES,
    "deepseek2": _DEEPSEEK2_LAYER_NAMES,
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_has_output_head(reader: gguf.GGUFReader) -> bool:
    """Whether the file has its own LM head; without one the embedding is tied to it."""
    return any(tensor.name == "output.weight" for tensor in reader.tensors)


def gguf_state_dict(
    config: ModelConfig,
    reader: gguf.GGUFReader,
    dtype: torch.dtype,
    device: str | torch.device,
    keep_packed: Set[str] = frozenset(),
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """The GGUF's tensors under our names, un-permuted: ``(floats, packed)``. A quantized
    tensor named in ``keep_packed`` stays packed (``model/quantization/``, its rows
    reordered instead); every other is dequantized to ``dtype`` on ``device``."""
    check_gguf_tensors(reader)
    state = {}
    packed: dict[str, QuantizedWeight] = {}
    permuted = config.architecture == "LlamaForCausalLM"
    layer_names = _layer_names(reader)
    for tensor in reader.tensors:
        name = _our_name(tensor.name, layer_names)
        heads = _rotary_heads(config, tensor.name) if permuted else None
        if name in keep_packed and tensor.tensor_type not in FLOAT_TYPES:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists columns first
            weight_packed = gguf_weight(tensor.tensor_type, tensor.data, shape)
            if heads is not None:
                weight_packed = weight_packed.take_rows(rotary_row_order(shape[0], heads))
            packed[name] = weight_packed
            release_freed_memory()  # this tensor's temporaries, before the next one's
            continue
        weight = torch.from_numpy(_dequantize(tensor))
        if heads is not None:
            weight = unpermute_rotary_rows(weight, heads)
        weight = _without_norm_offset(config, tensor.name, weight)
        for part_name, part in _split_experts(name, weight).items():
            state[part_name] = part.to(device=device, dtype=dtype)
    return state, packed


def _rotary_heads(config: ModelConfig, gguf_name: str) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor (module doc), if any."""
    if gguf_name.endswith("attn_q.weight"):
        return config.num_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None


def rotary_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """The row index that un-permutes a packed weight: ``packed.take_rows(order)`` holds
    the rows ``unpermute_rotary_rows`` gives a float one."""
    return unpermute_rotary_rows(torch.arange(rows).unsqueeze(1), num_heads).squeeze(1)


def check_gguf_tensors(reader: gguf.GGUFReader) -> None:
    """Refuses a file with a tensor this loader cannot load: a weight type it does not
    dequantize, or a name with no counterpart in our models. Read from the tensor infos
    alone, so a load refuses before it dequantizes anything, and ``pdserve up`` refuses the
    file before it deploys a worker (``check_model``)."""
    layer_names = _layer_names(reader)
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_QUANTIZATIONS:
            supported = ", ".join(sorted(quant.name for quant in SUPPORTED_QUANTIZATIONS))
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is quantized as {tensor.tensor_type.name}, "
                f"which is not supported; supported: {supported}"
            )
        _our_name(tensor.name, layer_names)


def gguf_quantized_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """The file's quantized tensors (not stored as floats), by our name: their GGUF type."""
    layer_names = _layer_names(reader)
    return {
        _our_name(tensor.name, layer_names): tensor.tensor_type.name
        for tensor in reader.tensors
        if tensor.tensor_type not in FLOAT_TYPES
    }


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (module doc): ``[heads * d, in]`` back to HF order."""
    rows, columns = weight.shape
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, columns).transpose(1, 2).reshape(rows, columns)
    )


def _layer_names(reader: gguf.GGUFReader) -> dict[str, str]:
    """The per-layer name map of the file's architecture (``general.architecture``)."""
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    return _LAYER_NAMES_BY_ARCHITECTURE.get(str(architecture), _LAYER_NAMES)


def _without_norm_offset(config: ModelConfig, gguf_name: str, weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight (``attn_norm``, ``attn_q_norm``, ``output_norm``, ...) that
    llama.cpp's converter stored as ``offset + w`` (Gemma's, module doc) back as ``w``;
    every other tensor as it is."""
    if config.norm_weight_offset and gguf_name.endswith("norm.weight"):
        return weight - config.norm_weight_offset
    return weight


def _split_experts(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked experts tensor (``[experts, out, in]``, named with ``{expert}``) as one
    weight per expert; any other as it is."""
    if "{expert}" not in name:
        return {name: weight}
    return {name.format(expert=expert): part for expert, part in enumerate(weight.unbind(0))}


def _our_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors, Llama 3.1 style) "
            "is not supported"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the model")


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """``[rows, columns]`` float array (GGUF lists dimensions innermost first, numpy outermost
    first) of a tensor ``check_gguf_tensors`` accepted."""
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    # An F32 tensor comes back as a read-only view of the memory-mapped file: copy it out.
    return array if array.flags.writeable else array.copy()
