"""pdserve: prefill/decode disaggregated LLM serving on Ray.

The repository root is this import package; each top-level folder is one side
of the system (see docs/architecture.md):

    cache/        pdserve.cache        the KV cache ledger (specs, hashing, pool, manager)
    engine/       pdserve.engine       model, runner, scheduler, colocated LLMEngine
    kvconnector/  pdserve.kvconnector  moving hashed KV blocks prefill -> decode
    proto/        pdserve.proto        wire messages (gRPC)
    prefill/      pdserve.prefill      gateway, router, PrefillWorker
    decode/       pdserve.decode       DecodeWorker
    deploy/       pdserve.deploy       Ray application, config, CLI
"""

__version__ = "0.1.0"
