"""The model's text side, without torch: which files a ``--model`` names, its tokenizer,
and incremental detokenization.

The gateway and the engine both use it; it imports no torch and no model code, so the
gateway (which tokenizes and hashes prompts) never loads either.
"""
