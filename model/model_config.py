"""The model's shape, read once from a Hugging Face ``config.json`` or a GGUF file's metadata.

Every part that needs a dimension (the model, the runner sizing the KV tensor, the
ledger's block spec) reads it from this one typed record instead of a loose dict.
transformers 5 writes RoPE settings as ``rope_parameters`` (with ``rope_theta``
inside); older files use top-level ``rope_theta`` plus ``rope_scaling``. Both parse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.checkpoint.gguf_file import require

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# llama.cpp's ``general.architecture`` -> the model class that runs it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # or V3: by its router (_gguf_deepseek2_hf_config)
}

# The architecture decides whether q/k/v carry a bias when config.json does not say.
_DEFAULT_ATTENTION_BIAS = {"Qwen2ForCausalLM": True}
# Those that RMS-norm each query and key head before RoPE.
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# Interleaved local (windowed) and global layers, each kind with its RoPE base; Gemma's norms.
_GEMMA = ("Gemma3ForCausalLM",)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Those that window only with `use_sliding_window`, from `max_window_layers` on.
_QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Those that window every layer when `sliding_window` is set.
_MISTRAL_WINDOWS = ("MistralForCausalLM", "MixtralForCausalLM")
# Multi-head latent attention and DeepSeek's routed plus shared experts.
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True, slots=True)
class DeepSeekRouting:
    """How DeepSeek's router scores and limits its experts (float32, as the checkpoints
    keep ``gate.weight``).

    V2 scores by softmax; V3 by sigmoid plus a learned per-expert bias
    (``gate.e_score_correction_bias``) that steers the choice but not the weights. With
    ``num_groups > 1`` a token picks from its ``topk_groups`` best groups only, a group
    scored by the sum of its ``group_score_top`` best experts (V2: 1, the max; V3: 2).
    The chosen experts' weights are scaled by ``routed_scaling_factor``.
    """

    scoring: str  # "softmax" | "sigmoid"
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    group_score_top: int = 1
    score_correction_bias: bool = False


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts model (``architectures/moe.py``).

    ``sparse_layers``: the layers whose feed-forward is the experts (the others keep a dense
    MLP); ``module_name`` and ``expert_names`` (gate, up, down) are the checkpoint's names.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    module_name: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # DeepSeek's router (``DeepSeekRouting``) and its always-on shared experts (their
    # width; 0: none).
    deepseek_routing: DeepSeekRouting | None = None
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be 1..num_experts ({self.num_experts}), got {self.top_k}"
            )
        routing = self.deepseek_routing
        if routing is not None and self.num_experts % routing.num_groups != 0:
            raise ValueError(
                f"n_group ({routing.num_groups}) must divide the experts ({self.num_experts})"
            )


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: what one token caches and how heads expand it.

    A token's K and V of every head come from one ``kv_lora_rank`` latent through
    ``kv_b_proj``; only the latent (RMS-normed) and one shared RoPE key of
    ``qk_rope_head_dim`` are cached (``latent_size`` per token and layer, no heads)::

        cached row:  | latent (kv_lora_rank) | k_rope (qk_rope_head_dim) |
        per head:    k = | kv_b(latent)[:nope] | k_rope |    v = kv_b(latent)[nope:]

    ``q_lora_rank``: queries pass through their own low-rank bottleneck (V3, V2 full
    size) or, ``None``, one ``q_proj`` (V2-Lite). ``rope_interleave``: the RoPE pairs are
    adjacent channels (DeepSeek's layout) rather than the two halves.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(slots=True)
class ModelConfig:
    """What the model code and the KV cache need to know about a checkpoint.

    ``rope_scaling`` is ``None`` for plain RoPE, else the HF dict (``rope_type`` plus
    its parameters). ``attention_bias`` means a bias on q/k/v; Llama checkpoints that
    set it also put one on ``o_proj`` (``o_proj_bias``). ``sliding_window`` is the
    window (a key is visible when ``query_pos - key_pos < sliding_window``), ``None`` for
    full attention; it applies to every layer but ``full_attention_layers`` (Gemma 3's
    global layers, Qwen2's below ``max_window_layers``), which then form their own KV group
    (``kv_layer_groups``). ``local_rope_theta``: the windowed layers' own RoPE base (Gemma 3),
    unscaled. ``qk_norm``: each query and key head is RMS-normed (over ``head_dim``, weights
    ``self_attn.q_norm`` / ``k_norm``) before RoPE, as Qwen3 and Gemma 3 do.
    ``attention_scale``: the softmax scale (``None``: ``1/sqrt(head_dim)``).
    ``norm_weight_offset``: what every RMSNorm adds to its weight (Gemma stores ``w - 1``).
    ``hidden_activation``: the gated MLP's (``silu``, or Gemma's ``gelu_pytorch_tanh``).
    ``moe``: the experts of a mixture-of-experts model (None: dense). ``mla``: latent
    attention (DeepSeek), whose ``head_dim`` is the RoPE part of a query head.
    ``weights_digest``: the loader's digest of the weights (``checkpoint/weights_digest.py``;
    "" for a config built without them), so that the fingerprint tells apart two checkpoints
    of one config. ``quantization``: the formats the loaded linear weights are multiplied
    in ("none": floats; "int8"; the GGUF types kept packed, e.g. "Q4_K+Q6_K"), which the
    fingerprint covers too: a Q4 prefill's KV is not a float32 decode's.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    qk_norm: bool = False
    attention_scale: float | None = None
    norm_weight_offset: float = 0.0
    hidden_activation: str = "silu"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    weights_digest: str = ""
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden activation {self.hidden_activation!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    def is_windowed(self, layer: int) -> bool:
        return self.sliding_window is not None and layer not in self.full_attention_layers

    @property
    def kv_layer_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers that share one block table, per KV cache group.

        One group of every layer, unless windowed and full-attention layers mix: then the
        full layers are group 0 and the windowed ones follow in groups of the same size
        (vLLM's hybrid layout). Every group then fills the same number of the KV tensor's
        layer slots, so a block id is one whole page of whichever group holds it, and a
        windowed group's blocks that leave the window free pages a full group can use::

            layers        0 1 2 3 4 5 6 7      (F: full at 2 and 5; the rest windowed)
            groups        full: 2 5 | window: 0 1 | window: 3 4 | window: 6 7
            KV tensor     [num_blocks, 2 slots, 2 (K, V), block_size, heads, head_size]
        """
        layers = tuple(range(self.num_layers))
        full = tuple(i for i in layers if not self.is_windowed(i))
        windowed = tuple(i for i in layers if self.is_windowed(i))
        if not full or not windowed:
            return (layers,)
        size = len(full)
        return (full, *(windowed[i : i + size] for i in range(0, len(windowed), size)))

    @property
    def kv_token_shape(self) -> tuple[int, int, int]:
        """What one token stores per layer, as ``(entries, heads, head_size)``: K and V of
        each KV head, ``(2, num_kv_heads, head_dim)``; or MLA's one latent row,
        ``(1, 1, latent_size)``. The KV tensor, the ledger's page size and the connector's
        page bytes all follow from it."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_size
        return 2, self.num_kv_heads, self.head_dim

    @property
    def fingerprint(self) -> str:
        """``<architecture>:<16 hex>``, or ``<architecture>[<quantization>]:<16 hex>`` for
        packed weights: two workers whose KV pages may be exchanged run models with equal
        fingerprints (every field but the end-of-sequence ids, the weights' digest and
        their packing included: one config with other weights is another model). The
        packing is spelled out, so a refused pairing names both."""
        identity = {k: v for k, v in dataclasses.asdict(self).items() if k != "eos_token_ids"}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        packing = "" if self.quantization == "none" else f"[{self.quantization}]"
        return f"{self.architecture}{packing}:{digest[:16]}"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict (transformers 4.x or 5.x layout)."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ValueError(
                "config.json has no 'architectures' entry; cannot tell which model to build"
            )
        architecture = architectures[0]
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(hf)
        attention_bias = hf.get("attention_bias", _DEFAULT_ATTENTION_BIAS.get(architecture, False))
        mla = _parse_mla(hf, architecture)
        window, full_layers = _parse_sliding_window(hf, architecture)
        gemma = architecture in _GEMMA
        local_rope_theta = None
        if gemma:
            rope_theta, rope_scaling, local_rope_theta = _parse_gemma_rope(hf)
            for softcap in ("attn_logit_softcapping", "final_logit_softcapping"):
                if hf.get(softcap) is not None:
                    raise ValueError(f"{architecture} with {softcap} is not supported")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            # MLA: every head has its own K and V (expanded from the latent); RoPE spans
            # the rope part of a head only.
            num_kv_heads=num_heads if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=(
                mla.qk_rope_head_dim
                if mla
                else hf.get("head_dim") or hf["hidden_size"] // num_heads
            ),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and architecture != "Qwen2ForCausalLM",
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            eos_token_ids=_as_id_list(hf.get("eos_token_id")),
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            sliding_window=window,
            full_attention_layers=full_layers,
            local_rope_theta=local_rope_theta,
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            attention_scale=hf["query_pre_attn_scalar"] ** -0.5 if gemma else None,
            norm_weight_offset=1.0 if gemma else 0.0,
            hidden_activation=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            moe=_parse_moe(hf, architecture),
            mla=mla,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], tie_word_embeddings: bool) -> ModelConfig:
        """Parse a GGUF file's metadata (llama.cpp's ``{arch}.*`` keys, see ``model/gguf_loader.py``).

        ``tie_word_embeddings`` is not metadata in GGUF: a file without an ``output.weight``
        tensor reuses ``token_embd.weight`` as its LM head. End ids come from the tokenizer
        metadata (``tokenizer_from_gguf``), not from here.
        """
        gguf_architecture = require(metadata, "general.architecture")
        if gguf_architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {gguf_architecture!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def key(name: str) -> str:
            return f"{gguf_architecture}.{name}"

        if gguf_architecture == "deepseek2":
            return cls.from_hf_config(_gguf_deepseek2_hf_config(metadata, key, tie_word_embeddings))

        num_heads = require(metadata, key("attention.head_count"))
        hidden_size = require(metadata, key("embedding_length"))
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        architecture = GGUF_ARCHITECTURES[gguf_architecture]
        gemma = _gguf_gemma_fields(metadata, key) if architecture in _GEMMA else {}
        return cls(
            architecture=architecture,
            vocab_size=metadata.get(key("vocab_size")) or len(tokens),
            hidden_size=hidden_size,
            intermediate_size=require(metadata, key("feed_forward_length")),
            num_layers=require(metadata, key("block_count")),
            num_heads=num_heads,
            num_kv_heads=metadata.get(key("attention.head_count_kv")) or num_heads,
            head_dim=metadata.get(key("attention.key_length")) or hidden_size // num_heads,
            rope_theta=float(metadata.get(key("rope.freq_base"), 10000.0)),
            rope_scaling=_gguf_rope_scaling(metadata, key),
            rms_norm_eps=float(require(metadata, key("attention.layer_norm_rms_epsilon"))),
            tie_word_embeddings=tie_word_embeddings,
            max_position_embeddings=require(metadata, key("context_length")),
            attention_bias=_DEFAULT_ATTENTION_BIAS.get(architecture, False),
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            moe=_gguf_moe(metadata, key) if architecture == "Qwen3MoeForCausalLM" else None,
            **gemma,
        )


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config layout."""
    params = hf.get("rope_parameters")
    if params is None:
        scaling = hf.get("rope_scaling")
        theta = hf.get("rope_theta", 10000.0)
    else:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if scaling is not None:
        scaling = dict(scaling)
        # transformers 4.x wrote the type under "type" in older files.
        scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling


def _gguf_rope_scaling(
    metadata: dict[str, Any], key: Callable[[str], str]
) -> dict[str, Any] | None:
    """llama.cpp's ``rope.scaling.type`` / ``.factor`` as the HF scaling dict (``None`` for plain RoPE).

    Other types keep their name, so ``__post_init__`` refuses them clearly."""
    rope_type = metadata.get(key("rope.scaling.type"), "none")
    if rope_type == "none":
        return None
    scaling: dict[str, Any] = {
        "rope_type": rope_type,
        "factor": float(require(metadata, key("rope.scaling.factor"))),
    }
    if key("rope.scaling.original_context_length") in metadata:
        scaling["original_max_position_embeddings"] = metadata[
            key("rope.scaling.original_context_length")
        ]
    return scaling


def _gguf_gemma_fields(metadata: dict[str, Any], key: Callable[[str], str]) -> dict[str, Any]:
    """Gemma 3's fields that a GGUF leaves to llama.cpp's code (``llama-model.cpp``), which
    hard-codes them per architecture unless newer keys say otherwise: every 6th layer global,
    the others windowed; the local RoPE base 10,000, unscaled; the softmax scale
    ``1/sqrt(head_dim)`` (transformers' ``query_pre_attn_scalar``), but
    ``1/sqrt(hidden / heads)`` for the 62-layer 27B; the norms' ``1 + w`` and tanh GELU.
    A file with logit softcapping (Gemma 2's keys) is refused, as ``from_hf_config`` does."""
    for softcap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if metadata.get(key(softcap)) is not None:
            raise ValueError(f"Gemma 3 with {softcap} is not supported")
    num_layers = require(metadata, key("block_count"))
    num_heads = require(metadata, key("attention.head_count"))
    hidden_size = require(metadata, key("embedding_length"))
    head_dim = metadata.get(key("attention.key_length")) or hidden_size // num_heads
    pattern = metadata.get(key("attention.sliding_window_pattern")) or 6
    if isinstance(pattern, list):  # newer files: per layer, true where windowed
        full_layers = tuple(i for i, windowed in enumerate(pattern) if not windowed)
    else:
        full_layers = tuple(i for i in range(num_layers) if (i + 1) % pattern == 0)
    query_pre_attn_scalar = hidden_size // num_heads if num_layers == 62 else head_dim
    return {
        "sliding_window": int(require(metadata, key("attention.sliding_window"))),
        "full_attention_layers": full_layers,
        "local_rope_theta": float(metadata.get(key("rope.freq_base_swa"), 10000.0)),
        "attention_scale": query_pre_attn_scalar**-0.5,
        "norm_weight_offset": 1.0,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gguf_deepseek2_hf_config(
    metadata: dict[str, Any], key: Callable[[str], str], tie_word_embeddings: bool
) -> dict[str, Any]:
    """DeepSeek-V2/V3's ``config.json`` as llama.cpp's ``deepseek2`` metadata describes it,
    for ``from_hf_config``: latent attention (``key_length`` is the nope and RoPE parts of a
    query head), experts after ``leading_dense_block_count`` dense layers, shared experts,
    and the router: a sigmoid (``expert_gating_func`` 2) is V3's, a softmax V2's (its groups
    limited when the file has more than one). YaRN's ``yarn_log_multiplier`` is
    ``0.1 * mscale_all_dim``."""
    hidden_size = require(metadata, key("embedding_length"))
    rope_dim = require(metadata, key("rope.dimension_count"))
    v3 = metadata.get(key("expert_gating_func")) == 2
    groups = metadata.get(key("expert_group_count")) or 1
    hf: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "vocab_size": metadata.get(key("vocab_size"))
        or len(metadata.get("tokenizer.ggml.tokens") or []),
        "hidden_size": hidden_size,
        "intermediate_size": require(metadata, key("feed_forward_length")),
        "num_hidden_layers": require(metadata, key("block_count")),
        "num_attention_heads": require(metadata, key("attention.head_count")),
        "q_lora_rank": metadata.get(key("attention.q_lora_rank")) or None,
        "kv_lora_rank": require(metadata, key("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": require(metadata, key("attention.key_length")) - rope_dim,
        "v_head_dim": require(metadata, key("attention.value_length")),
        "rope_theta": float(metadata.get(key("rope.freq_base"), 10000.0)),
        "rope_scaling": _gguf_rope_scaling(metadata, key),
        "rms_norm_eps": float(require(metadata, key("attention.layer_norm_rms_epsilon"))),
        "max_position_embeddings": require(metadata, key("context_length")),
        "tie_word_embeddings": tie_word_embeddings,
        "first_k_dense_replace": metadata.get(key("leading_dense_block_count"), 0),
        "n_routed_experts": metadata.get(key("expert_count")),
        "num_experts_per_tok": metadata.get(key("expert_used_count")),
        "moe_intermediate_size": metadata.get(key("expert_feed_forward_length")),
        "n_shared_experts": metadata.get(key("expert_shared_count")),
        "routed_scaling_factor": metadata.get(key("expert_weights_scale"), 1.0),
        "norm_topk_prob": metadata.get(key("expert_weights_norm"), v3),
        "n_group": groups,
        "topk_group": metadata.get(key("expert_group_used_count")) or 1,
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
    }
    multiplier = metadata.get(key("rope.scaling.yarn_log_multiplier"))
    if hf["rope_scaling"] is not None and multiplier is not None:
        hf["rope_scaling"] |= {"mscale": multiplier / 0.1, "mscale_all_dim": multiplier / 0.1}
    return hf


def _gguf_moe(metadata: dict[str, Any], key: Callable[[str], str]) -> MoEConfig:
    """Qwen3-MoE's experts as llama.cpp reads them: every layer sparse, the top-k weights
    renormalised (``expert_weights_norm``, true unless the file says otherwise)."""
    return MoEConfig(
        num_experts=require(metadata, key("expert_count")),
        top_k=require(metadata, key("expert_used_count")),
        intermediate_size=require(metadata, key("expert_feed_forward_length")),
        norm_topk_prob=bool(metadata.get(key("expert_weights_norm"), True)),
        sparse_layers=tuple(range(require(metadata, key("block_count")))),
    )


def _parse_sliding_window(
    hf: dict[str, Any], architecture: str
) -> tuple[int | None, tuple[int, ...]]:
    """The window, and the layers that attend fully despite it (``(None, ())``: no window).

    Mistral windows every layer when `sliding_window` is set. Qwen2 and Qwen3 window only with
    `use_sliding_window`, and then the layers from `max_window_layers` on. Gemma 3 windows all
    but every `sliding_window_pattern`-th layer. transformers 5 also writes the result as
    `layer_types`, which wins when present.
    """
    window = hf.get("sliding_window")
    if architecture in _QWEN_WINDOWS and not hf.get("use_sliding_window"):
        window = None
    if architecture not in (*_MISTRAL_WINDOWS, *_QWEN_WINDOWS, *_GEMMA) or window is None:
        return None, ()
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None and architecture in _QWEN_WINDOWS:
        first_windowed = hf.get("max_window_layers", num_layers)
        layer_types = [
            "full_attention" if i < first_windowed else "sliding_attention"
            for i in range(num_layers)
        ]
    if layer_types is None and architecture in _GEMMA:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if layer_types is None:
        return int(window), ()
    full = tuple(i for i, kind in enumerate(layer_types) if kind != "sliding_attention")
    return (None, ()) if len(full) == num_layers else (int(window), full)


def _parse_gemma_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3's global RoPE (theta, scaling) and its local layers' base: transformers 5 nests
    them per layer kind in `rope_parameters`; older files say `rope_theta`, `rope_scaling`
    and `rope_local_base_freq`."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = _parse_rope({"rope_parameters": params["full_attention"]})
        local_theta, local_scaling = _parse_rope({"rope_parameters": params["sliding_attention"]})
        if local_scaling is not None:
            raise ValueError(
                f"Gemma 3's local layers with RoPE scaling {local_scaling} are not supported"
            )
        return theta, scaling, local_theta
    theta, scaling = _parse_rope(hf)
    return theta, scaling, float(hf.get("rope_local_base_freq", 10000.0))


def _parse_moe(hf: dict[str, Any], architecture: str) -> MoEConfig | None:
    """Qwen3-MoE's experts (every `decoder_sparse_step`-th layer not in `mlp_only_layers`,
    top-k renormalised when `norm_topk_prob`) or Mixtral's (every layer, renormalised)."""
    num_layers = hf["num_hidden_layers"]
    if architecture in _DEEPSEEK:
        return _parse_deepseek_moe(hf, architecture)
    if architecture == "Qwen3MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        return MoEConfig(
            # Qwen's own files say num_experts; transformers 5 writes num_local_experts.
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            sparse_layers=tuple(
                i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
            ),
        )
    if architecture == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
            module_name="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        )
    return None


def _parse_deepseek_moe(hf: dict[str, Any], architecture: str) -> MoEConfig | None:
    """DeepSeek's experts: every ``moe_layer_freq``-th layer from ``first_k_dense_replace`` on,
    routed as V2 (softmax, optionally group-limited) or V3 (sigmoid plus a correction bias,
    always group-limited) scores them, beside ``n_shared_experts`` always-on experts."""
    num_layers = hf["num_hidden_layers"]
    first_sparse, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    sparse_layers = tuple(i for i in range(num_layers) if i >= first_sparse and i % every == 0)
    num_experts = hf.get("n_routed_experts")
    if not num_experts or not sparse_layers:
        return None
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if architecture == "DeepseekV3ForCausalLM":
        routing = DeepSeekRouting(
            scoring="sigmoid",
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_groups=groups,
            topk_groups=topk_groups,
            group_score_top=2,
            score_correction_bias=True,
        )
        normalise = hf.get("norm_topk_prob", True)
    else:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"DeepSeek-V2 topk_method {method!r} is not supported; "
                "supported: greedy, group_limited_greedy"
            )
        limited = method == "group_limited_greedy"
        routing = DeepSeekRouting(
            scoring="softmax",
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_groups=groups if limited else 1,
            topk_groups=topk_groups if limited else 1,
        )
        normalise = hf.get("norm_topk_prob", False)
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(normalise),
        sparse_layers=sparse_layers,
        deepseek_routing=routing,
        shared_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
    )


def _parse_mla(hf: dict[str, Any], architecture: str) -> MLAConfig | None:
    if architecture not in _DEEPSEEK:
        return None
    return MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf.get("q_lora_rank"),
        # DeepSeek's own layout; V3 configs may say otherwise (transformers' default: True).
        rope_interleave=architecture == "DeepseekV2ForCausalLM"
        or bool(hf.get("rope_interleave", True)),
    )


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or the torch dtype itself)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def resolve_device(device: str) -> str:
    """``auto``: cuda when this process sees a GPU (a Ray worker sees the ones it was given),
    else cpu; any other device as it is."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"
