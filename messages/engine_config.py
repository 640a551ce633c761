"""Every setting of one engine, in one typed place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(slots=True)
class EngineConfig:
    """Settings for one ``LLMEngine`` (one worker's model, ledger and scheduler).

    ``hash_seed`` must be the same on every worker of a deployment: block hashes are
    compared across workers (router, dedup on transfer), and a different seed turns every
    cross-worker prefix hit into a silent miss.
    """

    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prompt computes at most this many tokens a step (0: no cap beyond the budget), so
    # running decodes keep stepping while a long prompt is computed (vLLM's name).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    hash_algorithm: Literal["xxh3_128", "sha256"] = "xxh3_128"
    hash_seed: int | str = 0
    torch_threads: int = 1
    publish_kv_events: bool = False
    engine_id: str = "engine-0"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or positive, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"block_size ({self.block_size})"
            )
