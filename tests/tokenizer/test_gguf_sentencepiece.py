"""A SentencePiece GGUF tokenizer of the Llama 2 / Mistral kind (``tokenizer.ggml.model``
"llama" under a non-Gemma architecture: ``"▁"`` prepended, merges ranked by score, byte
fallback) encodes and decodes as transformers' own GGUF tokenizer for the same file.

The file is written here: a small vocabulary with the 256 byte tokens, scores with ties, and
a control EOS."""

from __future__ import annotations

import gguf
import pytest
import transformers

from pdserve.checkpoint.gguf_file import gguf_metadata, open_gguf
from pdserve.tokenizer.gguf_tokenizer import tokenizer_from_gguf

_UNKNOWN, _NORMAL, _CONTROL, _BYTE = 2, 1, 3, 6
PIECES = {  # token: score (higher merges first; some tie)
    "▁": -1.0, "t": -2.0, "h": -2.0, "e": -2.0, "a": -3.0, "n": -3.0, "d": -3.0, "o": -3.0,
    "s": -3.0, "i": -3.0, "r": -3.0, "1": -4.0, "2": -4.0, "é": -4.0,
    "▁t": -5.0, "he": -5.0, "▁a": -6.0, "an": -6.0, "▁the": -7.0, "▁and": -8.0, "nd": -8.0,
    "▁▁": -9.0, "▁o": -9.0, "on": -9.0, "▁on": -10.0, "er": -10.0, "▁é": -11.0, "12": -11.0,
    "is": -12.0, "▁is": -12.0, "ri": -13.0, "▁▁▁▁": -14.0,
}  # fmt: skip
TEXTS = [
    "the and on",
    " the  and   on    ",
    "there is a rider\nand another\n\n",
    "été à 12 21 1212",
    "unknown letters: xyz Ω 🙂",
    "</s>inline",
    "",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentencepiece")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *PIECES]
    writer = gguf.GGUFWriter(str(folder / "sp.gguf"), arch="llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0, *([0.0] * 256), *PIECES.values()])
    writer.add_token_types(
        [_UNKNOWN, _CONTROL, _CONTROL, *([_BYTE] * 256), *([_NORMAL] * len(PIECES))]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / "sp.gguf"


@pytest.fixture(scope="module")
def ours(gguf_file):
    return tokenizer_from_gguf(gguf_metadata(open_gguf(gguf_file)))


@pytest.fixture(scope="module")
def reference(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ids[0] == 1  # BOS, llama.cpp's default for SentencePiece
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_merges_follow_scores_and_bytes_fall_back(ours):
    assert ours.encode(" the", add_special_tokens=False) == [ours.backend.token_to_id("▁the")]
    omega = ours.encode("Ω", add_special_tokens=False)[1:]  # after the prepended "▁"
    assert [ours.token_bytes(piece) for piece in omega] == [b"\xce", b"\xa9"]
