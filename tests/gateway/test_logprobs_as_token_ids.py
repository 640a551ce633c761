"""Logprobs name tokens by text, or by id with ``return_tokens_as_token_ids`` (vLLM's
extension): two byte tokens of a split UTF-8 character both decode to U+FFFD, so keyed by
text one hides the other in ``top_logprobs``; keyed by id both are there."""

from __future__ import annotations

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import parse_completion
from pdserve.gateway.logprobs_format import LogprobsRenderer
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.tokenizer.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(512)
# Position 0 sampled byte 0x80; its best alternatives are bytes 0x80 and 0x81 (both "�").
ENTRY = TokenLogprobs(0x80, -0.5, [(0x80, -0.5), (0x81, -1.0)])


def test_by_text_two_tokens_that_decode_alike_share_a_key():
    top = LogprobsRenderer(TOKENIZER).completion(0, [0x80], [ENTRY])["top_logprobs"][0]
    assert top == {"\ufffd": -1.0}  # the second overwrote the first: what ids avoid


def test_by_id_every_alternative_keeps_its_own_key_in_both_shapes():
    renderer = LogprobsRenderer(TOKENIZER, as_token_ids=True)
    completion = renderer.completion(0, [0x80], [ENTRY])
    assert completion["tokens"] == ["token_id:128"]
    assert completion["top_logprobs"] == [{"token_id:128": -0.5, "token_id:129": -1.0}]
    assert completion["text_offset"] == [0]
    chat = renderer.chat([0x80], [ENTRY])["content"][0]
    assert chat["token"] == "token_id:128"
    assert [t["token"] for t in chat["top_logprobs"]] == ["token_id:128", "token_id:129"]


def test_both_endpoints_take_the_flag():
    completion = parse_completion(
        {"model": "m", "prompt": "hi", "logprobs": 2, "return_tokens_as_token_ids": True}
    )
    chat = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        },
        TOKENIZER,
    )
    assert completion.return_tokens_as_token_ids and chat.return_tokens_as_token_ids
    assert not parse_completion({"model": "m", "prompt": "hi"}).return_tokens_as_token_ids


def test_completions_top_logprobs_always_hold_the_sampled_token():
    """OpenAI's completions: up to logprobs + 1 entries, the sampled token among them even
    where it is not among the most likely (sampled at a temperature) or logprobs is 0."""
    renderer = LogprobsRenderer(TOKENIZER, as_token_ids=True)
    unlikely = TokenLogprobs(65, -4.0, [(66, -0.1)])
    alone = TokenLogprobs(67, -0.2, [])
    rendered = renderer.completion(0, [65, 67], [unlikely, alone])["top_logprobs"]
    assert rendered == [{"token_id:65": -4.0, "token_id:66": -0.1}, {"token_id:67": -0.2}]
