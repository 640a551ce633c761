"""The prefill gateway: the service's ingress, torch-free (an import contract keeps it so).

| module | holds |
|---|---|
| `http_ingress.py` | the Serve ingress deployment `Gateway`: OpenAI HTTP routes, SSE |
| `grpc_ingress.py` | the gRPC `Generate` service |
| `openai_schema.py` | request models, validation, OpenAI response and error bodies |
| `orchestrator.py` | a request's phases: admit, route, prefill, hand-off, decode stream, retry |
| `stream_emitter.py` | worker chunks → client deltas (each token once, stop-string hold-back) |
| `router.py` | prefix- and load-aware choice of workers |
| `kv_event_poller.py` | workers' KV events into the router; the poll is the health check, backing off while the service is idle |
| `worker_pool.py` | the workers' Serve handles |
| `request_provenance.py` | each request's KV provenance, merged from both workers; the last N |
| `dashboard.py` | `/dashboard` (the page in `static/`, uPlot vendored) and `/v1/requests` |
| `metrics.py` | the gateway's figures, `/stats` and `/metrics` over all workers |
| `replica_board.py` | several gateway replicas answering as one: the app's board of their figures |
| `config.py` | `GatewayConfig` |
"""
