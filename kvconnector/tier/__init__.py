"""The KV tier below a worker's pool: cpu and disk levels, their LRU, the tier connector."""
