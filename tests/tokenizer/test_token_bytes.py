"""Each token's own bytes (OpenAI's chat ``logprobs.bytes``): joined over a reply's tokens
they are its UTF-8, also where one character spans tokens and each token alone decodes to
U+FFFD, for the vocabularies pdserve loads: byte-level (tiny, smollm2) and SentencePiece's
byte fallback (Llama 2, Mistral, Gemma's tokenizer.json)."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from pdserve.checkpoint.model_source import resolve_model
from pdserve.gateway.logprobs_format import LogprobsRenderer
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.tokenizer.loading import load_tokenizer
from pdserve.tokenizer.tokenizer import HFTokenizer

TEXT = "ꙮ🫠𓀀 café, naïve"


def sentencepiece_tokenizer() -> HFTokenizer:
    """A SentencePiece-style BPE: "▁" for spaces, unknown characters as <0xNN> bytes."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    vocab |= {"▁caf": 300, "é": 301, "▁": 302, ",": 303, "▁na": 304}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return HFTokenizer(backend, [0])


@pytest.mark.parametrize("source", ["tiny", "smollm2", "sentencepiece"])
def test_a_replys_token_bytes_join_into_its_utf8_where_tokens_split_characters(source):
    if source == "sentencepiece":
        tokenizer = sentencepiece_tokenizer()
    else:
        tokenizer = load_tokenizer(resolve_model(source))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert split, "no token of the text holds part of a character: the test shows nothing"
    expected = TEXT.encode() if source != "sentencepiece" else (" " + TEXT).encode()
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == expected
    rendered = LogprobsRenderer(tokenizer).chat(ids, [TokenLogprobs(i, -0.5, ()) for i in ids])
    assert bytes(b for entry in rendered["content"] for b in entry["bytes"]) == expected


def test_a_special_token_has_the_bytes_of_its_decoded_text_none():
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""
