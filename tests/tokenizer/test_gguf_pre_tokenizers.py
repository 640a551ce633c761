"""Each byte-level pre-tokenizer a GGUF may name (``tokenizer.ggml.pre``: Llama 3's, Qwen2's,
Mistral's Tekken) splits text as transformers' own GGUF tokenizer for the same file does.

The files are written here: the 256 byte tokens plus merges that join digits, letters of
either case and spaces, so a wrong split shows as different ids."""

from __future__ import annotations

import gguf
import pytest
import transformers

from pdserve.checkpoint.gguf_file import gguf_metadata, open_gguf
from pdserve.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pdserve.tokenizer.tokenizer import bytes_to_unicode

MERGES = ["1 2", "12 3", "Ġ t", "Ġt h", "Ġth e", "H e", "He l", "l o", "Hel lo", "W o", "Ġ W",
          "ĠW o", "' s", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ", "a b", "ab C", "C D"]  # fmt: skip
TEXTS = [
    "12345 123 1 12",
    "HelloWorld the World's abCD ABcd",
    "it's  the   end\n\n\nlines\r\n  ",
    "naïve café 東京 🙂 e\u0301",
    "path/to/file.py x=1;y=2",
]


def write_byte_level_gguf(path, pre: str) -> None:
    alphabet = list(bytes_to_unicode().values())
    tokens = [*alphabet, *(merge.replace(" ", "") for merge in MERGES), "<|end|>"]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken"])
def test_split_equals_transformers(tmp_path, pre):
    path = tmp_path / f"{pre}.gguf"
    write_byte_level_gguf(path, pre)
    ours = tokenizer_from_gguf(gguf_metadata(open_gguf(path)))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), (pre, text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text
