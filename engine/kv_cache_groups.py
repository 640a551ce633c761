"""The ledger's KV cache groups for a model's layers: what an engine's pool serves."""

from __future__ import annotations

from pdserve.cache import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pdserve.messages.engine_config import EngineConfig
from pdserve.model.model_config import ModelConfig


def kv_cache_groups(model_config: ModelConfig, config: EngineConfig) -> list[KVCacheGroupSpec]:
    """The ledger's groups for the model's layers (``ModelConfig.kv_layer_groups``): windowed
    layers get sliding-window groups, whose blocks leave the request (null block 0 in their
    place) once no token can attend to them; attention masks those positions anyway. Latent
    attention pages hold one latent row per token."""
    _, heads, head_size = model_config.kv_token_shape
    dtype = config.resolved_kv_cache_dtype
    groups = []
    for layers in model_config.kv_layer_groups:
        spec: KVCacheSpec
        if model_config.is_windowed(layers[0]):
            window = model_config.sliding_window
            assert window is not None  # is_windowed says so
            spec = SlidingWindowSpec(config.block_size, heads, head_size, dtype, window)
        elif model_config.mla is not None:
            spec = MLAAttentionSpec(config.block_size, heads, head_size, dtype)
        else:
            spec = FullAttentionSpec(config.block_size, heads, head_size, dtype)
        groups.append(KVCacheGroupSpec([f"layers.{i}" for i in layers], spec))
    return groups
