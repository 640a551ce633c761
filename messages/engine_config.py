"""Every setting of one engine, in one typed place.

Each field's docstring (the string under it) is its description everywhere: a deployment's
``--flag`` help and YAML key are generated from this class (``deploy/part_settings.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from pdserve.cache.kv_cache_spec import KVCacheGroupSpec, longest_request_in_pool
from pdserve.checkpoint.sim_profiles import SIM_PREFIX

KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8"]
SpeculativeMethod = Literal["off", "ngram", "draft_model"]
# More drafts than this per step cost more verification than a run of them ever saves.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class EngineConfig:
    """Settings for one ``LLMEngine`` (one worker's model, ledger and scheduler).

    ``hash_seed`` must be the same on every worker of a deployment: block hashes are
    compared across workers (router, dedup on transfer), and a different seed turns every
    cross-worker prefix hit into a silent miss.
    """

    model: str = "tiny"
    """'tiny', 'smollm2', a local HF directory or a .gguf file."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations (and the KV cache unless kv_cache_dtype says otherwise)."""
    quantization: Quantization = "auto"
    """How linear weights are held and multiplied: auto, the checkpoint's own format (a
    GGUF's quantized tensors and an AWQ or GPTQ folder's linears stay packed:
    ``model/quantization/``; an fp8 folder is refused, naming none and int8); none, dequantized to
    dtype at load; int8, weight-only int8 per output channel for every float linear weight
    (a quantized GGUF tensor keeps its own format). Every worker of a deployment must hold
    the same (the KV handshake's fingerprint covers it)."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """The KV cache's dtype; auto: dtype's. A 16-bit cache under a float32 model halves the
    KV bytes stored, moved and read; every worker of a deployment must use the same (the
    KV handshake refuses a mismatch, naming both)."""
    device: str = "auto"
    """The torch device; auto: cuda when this process sees a GPU (a worker: when Ray gave
    it one), else cpu."""
    seed: int = 0
    """Seeds the per-request sampling seeds of requests that bring none."""
    block_size: int = 16
    """Tokens per KV block (a power of two)."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool, the null block included; unset: as many as
    kv_cache_memory_bytes holds."""
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    """The KV pool's memory budget when num_kv_blocks is unset (a draft model's pool, as
    many blocks, is paid from it too)."""
    max_model_len: int | None = None
    """Longest prompt plus output, in tokens; unset: the model's own limit. Capped by what
    one request can hold alone in the pool, every KV group counted (max_model_len_for)."""
    max_num_seqs: int = 64
    """Requests running at once."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one step, over every request (at least block_size)."""
    long_prefill_token_threshold: int = 512
    """A prompt computes at most this many tokens a step, so running decodes keep stepping
    beside a long prompt (vLLM's name; 0: no cap beyond max_num_batched_tokens)."""
    enable_prefix_caching: bool = True
    """Reuse computed blocks of a shared prefix."""
    hash_algorithm: Literal["xxh3_128", "sha256"] = "xxh3_128"
    """Block hashes: xxh3_128 (fast, needs a secret seed) or sha256."""
    hash_seed: int | str = 0
    """Seeds the block hashes; equal on every worker of a deployment."""
    torch_threads: int = 1
    """torch's intra-op threads in this process (and in each tensor-parallel rank's)."""
    cuda_graphs: Literal["auto", "off"] = "auto"
    """Decode steps on CUDA replay graphs captured at start, one per padded batch size up to
    max_num_seqs (engine/decode_graphs.py); auto: on for decode workers and colocated
    engines, off for prefill workers (whose decode steps are few); off: every step eager.
    Uniform decode steps run over persistent buffers either way (engine/static_decode_batch.py)."""
    sim_time_scale: float = 1.0
    """A simulated model's clock (``sim:<profile>`` only): its forwards and hand-offs take
    this many times the profile's time. Above 1 where one host's few cores stand in for a
    cluster's (time dilation, ``checkpoint/sim_profiles.py``): scale arrivals, targets, the
    autoscaler's windows and the limits on simulated work (lease_ttl_s, transfer_timeout_s,
    hung_step_s) by the same factor, and read the latencies divided by it."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served beside the base model, loaded at start by every worker: name ->
    a PEFT adapter folder. A request names one as its ``model``; more load at run time
    (``POST /v1/load_lora_adapter``)."""
    max_loras: int = 4
    """Adapters a worker holds in memory at most; more may be registered, and are read
    again from their folders when a request names them (``engine/lora_registry.py``)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; a larger one is refused at load."""
    load_lora_on_demand: bool = True
    """Whether a request that names an adapter this worker lacks, with the path its peers
    read it from (a hand-off to a decode worker that joined after the load), loads it here;
    False: such a request is refused, naming the adapter."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (heads, MLP features and vocabulary), each a process
    of the worker's node (engine/tensor_parallel_peers.py); CPU only for now."""
    speculative_method: SpeculativeMethod = "off"
    """Speculative decoding: off; ngram (prompt lookup: a decode step drafts the tokens
    that followed the latest earlier occurrence of its context's last n tokens); or
    draft_model (speculative_model guesses them, over its own KV pages). One forward of the
    model verifies the drafts (engine/spec_decode/)."""
    speculative_model: str | None = None
    """draft_model: the draft, named as model is ('tiny', a local HF directory or a .gguf
    file), with the model's vocabulary and one KV group; it runs in the worker's process."""
    num_speculative_tokens: int = 4
    """Draft tokens proposed per decode step (vLLM's name), 1 to 16."""
    prompt_lookup_min: int = 3
    """ngram: the shortest context suffix to look up (vLLM's name). Two-token matches
    ("of the") are mostly chance in free text: three is the default."""
    prompt_lookup_max: int = 4
    """ngram: the longest context suffix to look up, tried first (vLLM's name)."""
    speculative_min_acceptance: float = 0.3
    """What one draft costs, as a fraction of a decode step, so the acceptance a draft needs
    to pay: each step drafts as many tokens as the request's recent acceptance pays for,
    and a request accepted less often than this pauses drafting (16 steps, then twice as
    long each time it falls low again; engine/spec_decode/draft_acceptance.py). On CPU a
    verification over 1 + 4 tokens costs about two decode steps (0.25-0.3 a draft,
    bench/bench_spec_decode.py); on a GPU far less, so a lower value pays there. 0: always
    draft the most."""
    speculative_draft_cost: float | None = None
    """draft_model: what one forward of the draft costs, as a fraction of the model's decode
    step, added to speculative_min_acceptance in each step's trade (a draft as dear as the
    model never pays, so never drafts); None: measured at start-up, one-token forwards of
    both side by side."""
    publish_kv_events: bool = False
    """Record KV events (blocks stored, removed) for the router to poll."""
    engine_id: str = "engine-0"
    """This engine's name among KV peers."""

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache's dtype, ``auto`` resolved to ``dtype``."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def max_model_len_for(
        self,
        max_position_embeddings: int,
        num_blocks: int,
        groups: Sequence[KVCacheGroupSpec],
    ) -> int:
        """The longest sequence an engine of this config serves: ``max_model_len`` (unset:
        the model's limit), capped by the model's positions and by the pool, since one
        request must always fit alone in it or preemption could loop forever: with every
        KV group's blocks counted (``longest_request_in_pool``), a sliding window's as
        much of it as one chunk reads."""
        max_chunk_tokens = self.max_num_batched_tokens
        if self.long_prefill_token_threshold:
            max_chunk_tokens = min(max_chunk_tokens, self.long_prefill_token_threshold)
        return min(
            self.max_model_len or max_position_embeddings,
            max_position_embeddings,
            longest_request_in_pool(groups, num_blocks, max_chunk_tokens),
        )

    def __post_init__(self) -> None:
        if self.model.startswith(SIM_PREFIX) and (
            self.tensor_parallel_size > 1
            or self.lora_modules
            or self.speculative_method == "draft_model"
        ):
            raise ValueError(
                f"a simulated model ({self.model}) runs at tensor_parallel_size 1, without "
                "LoRA adapters or a draft model: it has no weights to split or adapt"
            )
        if self.sim_time_scale <= 0:
            raise ValueError(f"sim_time_scale must be positive, got {self.sim_time_scale}")
        if self.sim_time_scale != 1.0 and not self.model.startswith(SIM_PREFIX):
            raise ValueError(
                f"sim_time_scale ({self.sim_time_scale}) slows a simulated model's clock; "
                f"{self.model} is a real model"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
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
        if self.kv_cache_dtype not in get_args(KVCacheDtype):
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(get_args(KVCacheDtype))}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in get_args(Quantization):
            raise ValueError(
                f"quantization must be one of {', '.join(get_args(Quantization))}, "
                f"got {self.quantization!r}"
            )
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")
        if self.cuda_graphs not in ("auto", "off"):
            raise ValueError(f"cuda_graphs must be auto or off, got {self.cuda_graphs!r}")
        if self.speculative_method not in get_args(SpeculativeMethod):
            raise ValueError(
                f"speculative_method must be one of {', '.join(get_args(SpeculativeMethod))}, "
                f"got {self.speculative_method!r}"
            )
        if (self.speculative_method == "draft_model") != (self.speculative_model is not None):
            raise ValueError(
                "speculative_model names the draft of speculative_method draft_model, and "
                f"only that: got speculative_method {self.speculative_method!r} and "
                f"speculative_model {self.speculative_model!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError(
                "speculative_min_acceptance must be between 0 and 1, "
                f"got {self.speculative_min_acceptance}"
            )
        if self.speculative_draft_cost is not None and self.speculative_draft_cost < 0:
            raise ValueError(
                f"speculative_draft_cost must be at least 0, got {self.speculative_draft_cost}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
