"""Incremental detokenization (tokenizers' DecodeStream) emits the same text as a whole decode,
holds back a cut UTF-8 character, hides every EOS and cuts at stop strings."""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models

from pdserve.tokenizer.detokenizer import IncrementalDetokenizer
from pdserve.tokenizer.tokenizer import ByteTokenizer, HFTokenizer

TOKENIZER = ByteTokenizer()
TEXT = "Grüße, 世界! 🙂 done"


def stream(token_ids: list[int], stop: list[str] | None = None) -> tuple[list[str], str | None]:
    """The text after each token, fed one at a time, and the stop string that ended it."""
    detokenizer = IncrementalDetokenizer(TOKENIZER, stop or [])
    texts = []
    for end in range(1, len(token_ids) + 1):
        met = detokenizer.update(token_ids[:end])
        if met is not None:
            return texts + [detokenizer.text], met
        texts.append(detokenizer.text)
    return texts, None


def test_streamed_text_equals_the_whole_decode_and_hides_eos():
    ids = TOKENIZER.encode(TEXT) + [TOKENIZER.eos_token_id]
    texts, stopped = stream(ids)
    assert texts[-1] == TEXT and stopped is None
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))


def test_a_character_split_over_byte_tokens_waits_for_its_last_byte():
    ids = TOKENIZER.encode("a🙂")
    assert len(ids) == 5
    texts, _ = stream(ids)
    assert texts == ["a", "a", "a", "a", "a🙂"]


def test_several_new_tokens_in_one_update():
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    ids = TOKENIZER.encode(TEXT)
    detokenizer.update(ids[:3])
    detokenizer.update(ids)
    assert detokenizer.text == TEXT


def test_stop_string_spanning_tokens_cuts_the_text_before_it():
    texts, stopped = stream(TOKENIZER.encode(TEXT), stop=["🙂", "世界"])
    assert stopped == "世界" and texts[-1] == "Grüße, "  # the one met, first in the text


def test_specials_above_eos_decode_to_nothing_and_text_never_becomes_one():
    assert TOKENIZER.encode("<|special_300|>") == list(b"<|special_300|>")
    assert TOKENIZER.decode([72, 300, 511, 105]) == "Hi"


def test_a_token_completing_several_stop_strings_cuts_at_the_earliest():
    """smollm2's " world" is one token: it completes both "d" and "w"; the text is cut
    before "w", the earlier, whatever the order of the list."""
    from pdserve.checkpoint.model_source import resolve_model
    from pdserve.tokenizer.loading import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2"))
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode(ids[-1:]) == " world"
    # Two stops starting together: the longer is the one met.
    for stops, met in ((["d", "w"], "w"), (["w", "d"], "w"), (["w", "wor"], "wor")):
        detokenizer = IncrementalDetokenizer(tokenizer, stops)
        assert detokenizer.update(ids) == met
        assert detokenizer.text == "Hello "


def test_no_stop_string_ends_an_output_of_min_tokens_or_fewer():
    """vLLM's rule: the stop string in the first min_tokens tokens stays; the next ends it."""
    ids = TOKENIZER.encode("ab;cd;ef")
    detokenizer = IncrementalDetokenizer(TOKENIZER, [";"], min_tokens=3)
    assert detokenizer.update(ids) == ";"
    assert detokenizer.text == "ab;cd" and detokenizer.num_tokens_at_stop == 6


def test_include_stop_str_in_output_keeps_the_stop_string():
    ids = TOKENIZER.encode("one END two")
    detokenizer = IncrementalDetokenizer(TOKENIZER, ["END"], include_stop_str_in_output=True)
    assert detokenizer.update(ids) == "END"
    assert detokenizer.text == "one END"


def _wordpiece_with_added_tokens() -> HFTokenizer:
    """WordPiece's decoder puts a space before every token that is no ``##`` piece, added
    tokens included: the case vLLM's ``spaces_between_special_tokens`` is for."""
    backend = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    backend.add_tokens([AddedToken("<think>", special=False)])
    return HFTokenizer(backend, eos_token_ids=[3])


def test_without_spaces_between_special_tokens_an_added_token_after_another_is_bare():
    """vLLM's fast detokenizer's rule: the first added token of a run keeps the decoder's
    space, the ones after it are their bare text, a plain token after the run its own."""
    tokenizer = _wordpiece_with_added_tokens()
    ids = [0, 2, 3, 4, 1, 4]  # a <s> </s> <think> b <think>

    def text(**flags: bool) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [], **flags)
        detokenizer.update(ids)
        return detokenizer.text

    whole = tokenizer.backend.decode(ids, skip_special_tokens=False)
    assert whole == "a <s> </s> <think> b <think>"
    assert text(skip_special_tokens=False) == whole
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == (
        "a <s></s><think> b <think>"
    )
    # skipping special tokens wins, as in vLLM: only the non-special added token is left
    assert text(spaces_between_special_tokens=False) == text() == "a <think> b <think>"
