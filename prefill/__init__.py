"""The prefill side: gateway (HTTP + gRPC ingress), router, ``PrefillWorker``."""
