"""What a ``--model`` name resolves to (built-in, GGUF, Hugging Face directory) and
reading GGUF metadata; no torch (the gateway resolves its tokenizer with it)."""
