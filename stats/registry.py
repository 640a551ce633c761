"""Every statistic pdserve reports, defined once.

One ``Stat`` per figure: its name (a ``WorkerStats`` / ``GatewayStats`` field and the
``/stats`` key), its kind and unit, a help line, the Prometheus name (vLLM's where vLLM
exports the same figure, else ``pdserve:*``), its ``pdserve stats`` column, and how the
figures of many workers combine into the service's total. ``/stats``, ``/metrics`` and the
CLI table are all derived from these tuples; tests check that the message fields match.

    Stat ──▶ /stats     {"workers": [{name: value}], "totals": {name: total(values)}}
         ──▶ /metrics   <metric>{model_name, worker, role} value   (counters get _total)
         ──▶ pdserve stats   one column per Stat with a ``column``
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    COUNTER = "counter"  # only grows while the process lives
    GAUGE = "gauge"  # a present-tense reading
    HISTOGRAM = "histogram"  # a ``HistogramSnapshot``


class Total(enum.Enum):
    """How one figure of many workers becomes the service's figure."""

    SUM = "sum"
    MAX = "max"
    NONE = "none"  # no meaningful total (a median of medians is not a median)
    RATIO = "ratio"  # total numerator / total denominator (``Stat.ratio_of``)
    POOL_WEIGHTED = "pool_weighted"  # weighted by each worker's ``num_blocks``
    MERGE = "merge"  # histograms: bucket counts added; labelled counters: added per label


@dataclass(frozen=True, slots=True)
class Stat:
    name: str
    kind: Kind
    unit: str  # "requests", "tokens", "blocks", "bytes", "ratio", "seconds", ...
    help: str
    metric: str | None  # Prometheus name; None: /stats and the table only
    column: str | None = None  # `pdserve stats` header; None: not in the table
    total: Total = Total.SUM
    ratio_of: tuple[str, str] | None = None  # (numerator, denominator) for Total.RATIO
    label: str | None = None  # a counter kept per label value (a dict of counts)


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM

WORKER_STATS: tuple[Stat, ...] = (
    Stat(
        "num_requests_running",
        G,
        "requests",
        "Requests in the running batch.",
        "vllm:num_requests_running",
        "run",
    ),
    Stat(
        "num_requests_waiting",
        G,
        "requests",
        "Requests waiting to be scheduled.",
        "vllm:num_requests_waiting",
        "wait",
    ),
    Stat(
        "num_prompt_tokens_to_compute",
        G,
        "tokens",
        "Prompt tokens of queued and running requests that no step has computed yet.",
        "pdserve:prompt_tokens_to_compute",
    ),
    Stat(
        "busy_seconds",
        C,
        "seconds",
        "Seconds the engine spent in steps that had requests (a worker's load).",
        "pdserve:worker_busy_seconds",
    ),
    Stat(
        "num_requests",
        C,
        "requests",
        "Requests the worker received.",
        "pdserve:worker_requests",
        "reqs",
    ),
    Stat(
        "num_requests_withdrawn",
        C,
        "requests",
        "Requests the worker gave back unstarted, for the gateway to run on an idler worker "
        "(move_waiting_prefills): the worker served num_requests less these.",
        "pdserve:worker_requests_withdrawn",
    ),
    Stat(
        "num_generation_tokens",
        C,
        "tokens",
        "Tokens the worker's engine sampled (an aborted request stops adding to it).",
        "pdserve:worker_generation_tokens",
    ),
    Stat(
        "prefix_cache_queries",
        C,
        "tokens",
        "Prompt tokens looked up in the prefix cache.",
        "vllm:prefix_cache_queries",
    ),
    Stat(
        "prefix_cache_hits",
        C,
        "tokens",
        "Prompt tokens found in the prefix cache.",
        "vllm:prefix_cache_hits",
    ),
    Stat(
        "prefix_cache_hit_rate",
        G,
        "ratio",
        "Prefix-cache hits over queries since start.",
        None,
        "hit%",
        Total.RATIO,
        ratio_of=("prefix_cache_hits", "prefix_cache_queries"),
    ),
    Stat("num_blocks", G, "blocks", "KV blocks in the pool.", "pdserve:kv_cache_blocks"),
    Stat(
        "num_free_blocks",
        G,
        "blocks",
        "KV blocks free (cached or empty).",
        "pdserve:kv_cache_free_blocks",
        "free",
    ),
    Stat(
        "kv_cache_usage",
        G,
        "ratio",
        "KV-cache usage (1 = full).",
        "vllm:kv_cache_usage_perc",
        "usage%",
        Total.POOL_WEIGHTED,
    ),
    Stat(
        "num_evictions",
        C,
        "blocks",
        "Cached blocks evicted for reuse.",
        "pdserve:kv_cache_evictions",
        "evict",
    ),
    Stat(
        "num_preemptions",
        C,
        "requests",
        "Requests preempted (recomputed later).",
        "vllm:num_preemptions",
        "preempt",
    ),
    Stat(
        "num_leases_held",
        G,
        "requests",
        "Finished prefills whose blocks a lease holds.",
        "pdserve:kv_transfer_leases_held",
        "leases",
    ),
    Stat(
        "num_blocks_sent",
        C,
        "blocks",
        "KV blocks served to decode workers.",
        "pdserve:kv_transfer_blocks_sent",
        "sent",
    ),
    Stat(
        "num_blocks_received",
        C,
        "blocks",
        "KV blocks pulled from prefill workers.",
        "pdserve:kv_transfer_blocks_received",
        "recv",
    ),
    Stat(
        "num_blocks_received_early",
        C,
        "blocks",
        "KV blocks pulled by chunk-wise hand-off offers, while the prompt was still being "
        "prefilled (part of the blocks received).",
        "pdserve:kv_transfer_blocks_received_early",
        "early",
    ),
    Stat(
        "num_blocks_received_in_handoff",
        C,
        "blocks",
        "KV blocks a hand-off carried in itself (the last chunk's, after offers), landed "
        "without a read (not among the blocks received, which counts reads).",
        "pdserve:kv_transfer_blocks_received_in_handoff",
        "inline",
    ),
    Stat("num_bytes_sent", C, "bytes", "KV bytes served.", "pdserve:kv_transfer_bytes_sent"),
    Stat(
        "num_bytes_received", C, "bytes", "KV bytes pulled.", "pdserve:kv_transfer_bytes_received"
    ),
    Stat(
        "num_dedup_skipped_blocks",
        C,
        "blocks",
        "Blocks not pulled because the decode worker already held them.",
        "pdserve:kv_transfer_dedup_skipped_blocks",
        "dedup",
    ),
    Stat(
        "num_bytes_received_by_peer",
        C,
        "bytes",
        "KV bytes pulled, by the prefill worker's host (its advertised IP).",
        "pdserve:kv_transfer_bytes_received_by_peer",
        None,
        Total.MERGE,
        label="peer",
    ),
    Stat(
        "transfer_latency",
        H,
        "seconds",
        "Latency of one pull, from start to last block.",
        "pdserve:kv_transfer_latency_seconds",
        None,
        Total.MERGE,
    ),
    Stat(
        "transfer_latency_p50_s",
        G,
        "seconds",
        "Median latency of recent pulls.",
        None,
        "xfer50ms",
        Total.NONE,
    ),
    Stat(
        "transfer_latency_p99_s",
        G,
        "seconds",
        "p99 latency of recent pulls.",
        None,
        "xfer99ms",
        Total.MAX,
    ),
    Stat(
        "num_failed_transfers",
        C,
        "transfers",
        "Pulls that lost at least one block.",
        "pdserve:kv_transfer_failures",
        "fail",
    ),
    Stat(
        "num_lease_expiries",
        C,
        "leases",
        "Leases that expired before their release.",
        "pdserve:kv_transfer_lease_expiries",
        "expired",
    ),
    Stat(
        "num_tls_connections_refused",
        C,
        "connections",
        "KV connections refused by the mutual-TLS handshake (or closed before a call).",
        "pdserve:kv_tls_connections_refused",
    ),
    Stat(
        "num_recompute_fallbacks",
        C,
        "requests",
        "Requests that computed KV a transfer did not deliver.",
        "pdserve:kv_transfer_recompute_fallbacks",
        "recompute",
    ),
    # Structured outputs (grammar-constrained sampling).
    Stat(
        "num_structured_requests",
        C,
        "requests",
        "Requests with a structured output (a grammar masks their tokens).",
        "pdserve:structured_output_requests",
        "struct",
    ),
    Stat(
        "num_constrained_rows",
        C,
        "tokens",
        "Tokens sampled under a grammar's mask.",
        "pdserve:structured_output_constrained_tokens",
    ),
    Stat(
        "num_masked_tokens",
        C,
        "tokens",
        "Vocabulary entries the masks forbade, summed over the constrained tokens.",
        "pdserve:structured_output_masked_tokens",
    ),
    Stat(
        "masked_tokens_per_row",
        G,
        "tokens",
        "Vocabulary entries forbidden per constrained token (the mask's mean width).",
        None,
        total=Total.RATIO,
        ratio_of=("num_masked_tokens", "num_constrained_rows"),
    ),
    Stat(
        "num_grammar_compiles",
        C,
        "grammars",
        "Grammars compiled (a cache miss).",
        "pdserve:structured_output_grammar_compiles",
    ),
    Stat(
        "num_grammar_cache_hits",
        C,
        "grammars",
        "Grammars found compiled in the worker's cache.",
        "pdserve:structured_output_grammar_cache_hits",
        "gram-hit",
    ),
    Stat(
        "grammar_compile_seconds",
        C,
        "seconds",
        "Time spent compiling grammars.",
        "pdserve:structured_output_grammar_compile_seconds",
    ),
    # Speculative decoding (engine/spec_decode/): drafts verified on the decode side.
    Stat(
        "num_spec_decode_drafts",
        C,
        "steps",
        "Verified steps that carried drafts.",
        "vllm:spec_decode_num_drafts",
        "drafts",
    ),
    Stat(
        "num_spec_decode_draft_tokens",
        C,
        "tokens",
        "Draft tokens proposed and verified.",
        "vllm:spec_decode_num_draft_tokens",
    ),
    Stat(
        "num_spec_decode_accepted_tokens",
        C,
        "tokens",
        "Draft tokens accepted (emitted without a step of their own).",
        "vllm:spec_decode_num_accepted_tokens",
    ),
    Stat(
        "spec_decode_accepted_tokens_per_pos",
        C,
        "tokens",
        "Verified steps whose draft at this position was accepted.",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        label="position",
    ),
    Stat(
        "spec_decode_acceptance_rate",
        G,
        "ratio",
        "Draft tokens accepted over draft tokens verified, since start.",
        None,
        "accept%",
        Total.RATIO,
        ratio_of=("num_spec_decode_accepted_tokens", "num_spec_decode_draft_tokens"),
    ),
    Stat(
        "spec_decode_mean_accepted_length",
        G,
        "tokens",
        "Tokens emitted per verified step: accepted drafts plus the one sampled after them.",
        None,
        "tok/step",
        Total.NONE,
    ),
    # The KV tier below the pool, per medium (cpu, disk).
    Stat(
        "kv_tier_bytes_used",
        G,
        "bytes",
        "Bytes of pages the KV tier holds.",
        "pdserve:kv_tier_bytes_used",
        label="tier",
    ),
    Stat(
        "kv_tier_pinned_bytes",
        G,
        "bytes",
        "Page-locked host memory the KV tier holds (a GPU pool's cpu tier: its budget).",
        "pdserve:kv_tier_pinned_bytes",
        label="tier",
    ),
    Stat(
        "kv_tier_blocks_stored",
        C,
        "blocks",
        "Blocks copied into the KV tier.",
        "pdserve:kv_tier_blocks_stored",
        label="tier",
    ),
    Stat(
        "kv_tier_blocks_loaded",
        C,
        "blocks",
        "Blocks loaded back from the KV tier intact.",
        "pdserve:kv_tier_blocks_loaded",
        label="tier",
    ),
    Stat(
        "kv_tier_hit_tokens",
        C,
        "tokens",
        "Prompt tokens past the pool's prefix hit that the KV tier held.",
        "pdserve:kv_tier_hit_tokens",
        label="tier",
    ),
    Stat(
        "kv_tier_store_bytes",
        C,
        "bytes",
        "Bytes stored into the KV tier.",
        "pdserve:kv_tier_store_bytes",
        label="tier",
    ),
    Stat(
        "kv_tier_load_bytes",
        C,
        "bytes",
        "Bytes loaded from the KV tier.",
        "pdserve:kv_tier_load_bytes",
        label="tier",
    ),
    Stat(
        "kv_tier_store_seconds",
        C,
        "seconds",
        "Time spent storing pages (over blocks stored: the mean store latency).",
        "pdserve:kv_tier_store_seconds",
        label="tier",
    ),
    Stat(
        "kv_tier_load_seconds",
        C,
        "seconds",
        "Time spent loading pages (over blocks loaded: the mean load latency).",
        "pdserve:kv_tier_load_seconds",
        label="tier",
    ),
    Stat(
        "kv_tier_evictions",
        C,
        "blocks",
        "Pages the KV tier dropped (or moved down) for room.",
        "pdserve:kv_tier_evictions",
        label="tier",
    ),
    Stat(
        "kv_tier_store_failures",
        C,
        "blocks",
        "Pages not kept: a failed write (disk full, directory gone) or a full write queue.",
        "pdserve:kv_tier_store_failures",
        label="tier",
    ),
    Stat(
        "kv_tier_load_failures",
        C,
        "blocks",
        "Pages that came back missing, short or corrupt (recomputed).",
        "pdserve:kv_tier_load_failures",
        label="tier",
    ),
    Stat(
        "start_seconds",
        G,
        "seconds",
        "How long the worker's start took, per phase: imports, model_build, weights, "
        "kv_pool, connector, the rest of its engine (stats/start_phases.py); the total adds "
        "the workers' up.",
        "pdserve:worker_start_seconds",
        label="phase",
    ),
    Stat(
        "lora_requests",
        C,
        "requests",
        "Requests that ran a LoRA adapter, by the adapter's name.",
        "pdserve:lora_requests",
        None,
        Total.MERGE,
        label="lora_name",
    ),
    Stat(
        "lora_adapters_resident",
        G,
        "adapters",
        "1 per LoRA adapter the worker holds in memory, by name (max_loras at most); the "
        "total: how many workers hold each.",
        "pdserve:lora_adapter_resident",
        None,
        Total.MERGE,
        label="lora_name",
    ),
)

GATEWAY_STATS: tuple[Stat, ...] = (
    Stat(
        "num_requests",
        C,
        "requests",
        "Requests admitted by the gateway.",
        "pdserve:gateway_requests",
    ),
    Stat(
        "num_requests_in_flight",
        G,
        "requests",
        "Requests in the gateway now.",
        "pdserve:gateway_requests_in_flight",
    ),
    Stat(
        "finished_by_reason",
        C,
        "requests",
        "Finished requests, by finish reason.",
        "vllm:request_success",
        label="finished_reason",
    ),
    Stat(
        "lora_requests",
        C,
        "requests",
        "Requests admitted for a LoRA adapter, by the adapter's name.",
        "pdserve:gateway_lora_requests",
        label="lora_name",
    ),
    Stat(
        "rejected_by_status",
        C,
        "requests",
        "Requests refused (4xx, 5xx), by status.",
        "pdserve:requests_rejected",
        label="status",
    ),
    Stat(
        "num_retries",
        C,
        "requests",
        "Requests run again after their worker was lost.",
        "pdserve:gateway_retries",
    ),
    Stat(
        "num_stream_migrations",
        C,
        "requests",
        "Of those, streams given up because their worker hung (out of routing: its poll "
        "unanswered, or its engine inside one step past hung_step_s): moved to another.",
        "pdserve:gateway_stream_migrations",
    ),
    Stat(
        "num_prefills_moved",
        C,
        "requests",
        "Prefills taken back unstarted from a worker and routed again, where the router "
        "would now place them elsewhere (move_waiting_prefills).",
        "pdserve:gateway_prefills_moved",
    ),
    Stat(
        "num_deadlines_exceeded",
        C,
        "requests",
        "Requests ended because they ran past their deadline (timeout, request_timeout_s).",
        "pdserve:gateway_deadlines_exceeded",
    ),
    Stat(
        "num_requests_prefilled_on_decode",
        C,
        "requests",
        "Requests run whole on a decode worker (conditional disaggregation: little to compute).",
        "pdserve:requests_prefilled_on_decode",
    ),
    Stat(
        "num_turns_run_where_kv_is",
        C,
        "requests",
        "Of those, requests run on the decode worker because it held more of their prompt "
        "than any prefill worker (a conversation's next turn: decode_reuse_min_tokens).",
        "pdserve:turns_run_where_kv_is",
    ),
    Stat(
        "num_prompt_tokens",
        C,
        "tokens",
        "Prompt tokens of finished requests.",
        "vllm:prompt_tokens",
    ),
    Stat(
        "prompt_tokens_by_source",
        C,
        "tokens",
        "Prompt tokens of finished requests, by where the replying engine got their KV.",
        "vllm:prompt_tokens_by_source",
        label="source",
    ),
    Stat(
        "prompt_tokens_by_kv_source",
        C,
        "tokens",
        "Prompt tokens of finished requests, by KV source on each worker (prefill: cache "
        "hit or computed; decode: held, pulled, recomputed or prefilled there).",
        "pdserve:prompt_tokens_by_kv_source",
        label="source",
    ),
    Stat("num_generation_tokens", C, "tokens", "Tokens sent to clients.", "vllm:generation_tokens"),
    # Several gateway replicas (replica_board.py) add their histograms bucket by bucket and
    # show the worst replica's recent percentiles.
    Stat(
        "time_to_first_token",
        H,
        "seconds",
        "Time to first token, at the gateway.",
        "vllm:time_to_first_token_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "inter_token_latency",
        H,
        "seconds",
        "Time between output tokens, at the gateway.",
        "vllm:inter_token_latency_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "decode_inter_token_latency",
        H,
        "seconds",
        "Time between output tokens after a reply's second: the decode steps' pace, without "
        "the first gap (in P/D, the hand-off's).",
        "pdserve:decode_inter_token_latency_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "e2e_request_latency",
        H,
        "seconds",
        "End-to-end request latency.",
        "vllm:e2e_request_latency_seconds",
        total=Total.MERGE,
    ),
    # From each request's timeline (gateway/request_timeline.py); the first stream
    # is the prefill phase wherever it ran.
    Stat(
        "request_queue_time",
        H,
        "seconds",
        "Time the first worker held a request before computing it (the step in progress, "
        "then its queue).",
        "vllm:request_queue_time_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "request_prefill_time",
        H,
        "seconds",
        "Time the first worker computed until the first token.",
        "vllm:request_prefill_time_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "kv_load_time",
        H,
        "seconds",
        "Time a decode worker took from admitting a request to holding its prompt's KV "
        "(handshake, read, hand-back).",
        "pdserve:kv_load_seconds",
        total=Total.MERGE,
    ),
    Stat(
        "worker_call_overhead",
        H,
        "seconds",
        "Ray's share of a worker stream's round trip to its first chunk (the call and the "
        "chunk's way back), per stream.",
        "pdserve:worker_call_overhead_seconds",
        total=Total.MERGE,
    ),
    Stat("ttft_p50_s", G, "seconds", "Median TTFT of recent requests.", None, total=Total.MAX),
    Stat("ttft_p99_s", G, "seconds", "p99 TTFT of recent requests.", None, total=Total.MAX),
    Stat(
        "itl_p50_s",
        G,
        "seconds",
        "Median inter-token latency, recent tokens.",
        None,
        total=Total.MAX,
    ),
    Stat(
        "itl_p99_s", G, "seconds", "p99 inter-token latency, recent tokens.", None, total=Total.MAX
    ),
)
