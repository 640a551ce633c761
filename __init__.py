"""pdserve: prefill/decode disaggregated LLM serving on Ray.

The repository root is this import package; each top-level folder is one side
of the system (see docs/architecture.md):

    deploy/       pdserve.deploy       Ray application, config, CLI
    prefill/      pdserve.prefill      gateway (ingresses, orchestrator, router), PrefillWorker
    decode/       pdserve.decode       DecodeWorker
    kvconnector/  pdserve.kvconnector  moving hashed KV blocks prefill -> decode
    engine/       pdserve.engine       model, runner, scheduler, colocated LLMEngine, EngineHost
    messages/     pdserve.messages     everything that crosses a process boundary
    cache/        pdserve.cache        the KV cache ledger (specs, hashing, pool, manager)
    tokenizer/    pdserve.tokenizer    model names, tokenizers, detokenization (no torch)
    stats/        pdserve.stats        the statistics registry and latency helpers
    proto/        pdserve.proto        wire messages (gRPC)

Each folder imports only from those listed below it (import-linter contracts in pyproject.toml).
"""

import time as _time

__version__ = "0.1.0"

# When this process first imported pdserve: a worker's start counts its imports from here
# (``worker/engine_host.py``: the ``imports`` phase of its ``start_seconds``).
IMPORTED_AT = _time.perf_counter()
