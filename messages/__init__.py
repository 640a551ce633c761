"""Everything that crosses a process boundary, as typed messages, in one place.

Ray calls carry these dataclasses (STYLE: no dicts of loose keys between actors); the wire
protocols (client ``Generate``, worker ↔ worker ``KvTransfer``) are protobuf in ``proto/``.
Nothing here imports torch or model code: the gateway imports this package.

    deploy (app builder)                           PrefillWorker / DecodeWorker
       │── WorkerSpec (EngineConfig, KVConnectorConfig) ─▶ │  actor init
    gateway
       │── WorkerRequest (SamplingParams) ───────────────▶ │  engine.add_request(...)
       │◀─────────────────────── GenerationChunk (stream) ─│  one per engine step that changed it
       │          PrefillWorker's last chunk carries KVTransferParams; the gateway hands
       │          them to the DecodeWorker inside its WorkerRequest. Each worker's last
       │          chunk carries its KVProvenance (where the prompt's KV came from)
       │── kv_events(since_seq) ─────────────────────────▶ │
       │◀──────────────────────────────────── KVEventBatch ─│  feeds the router's prefix index
       │── stats() ──────────────────────────────────────▶ │
       │◀───────────────────────────────────── WorkerStats ─│  /stats, /metrics, `pdserve stats`
       │── model_info() ─────────────────────────────────▶ │
       │◀─────────────────────────────────────── ModelInfo ─│  what prompts are validated against

| module | messages |
|---|---|
| `worker_spec.py` | `WorkerSpec` |
| `engine_config.py` | `EngineConfig` |
| `connector_config.py` | `KVConnectorConfig` |
| `sampling_params.py` | `SamplingParams` |
| `generation.py` | `WorkerRequest`, `GenerationChunk`, `ModelInfo` |
| `kv_transfer_params.py` | `KVTransferParams` (the prefill → decode hand-off) |
| `kv_provenance.py` | `KVProvenance` (one worker's account of a request's prompt KV) |
| `kv_event_batch.py` | `KVEventBatch` (of `pdserve.cache` KV events) |
| `worker_stats.py` | `WorkerStats` |
"""
