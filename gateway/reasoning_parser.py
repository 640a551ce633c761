"""Reasoning parsers: a reasoning model's reply is its reasoning, then its answer; the chat
reply carries them apart (``message.reasoning``, and ``reasoning_content``, the older name),
as vLLM's ``--reasoning-parser`` does, streamed as deltas of each.

    deepseek_r1   the reply starts inside the reasoning (the template opened it); an
                  opening <think> is dropped; </think> ends it; no </think>: all reasoning
    qwen3         reasoning only when the reply opens with <think> (thinking on); else all
                  answer (thinking off: the template closed an empty block in the prompt)

    "<think>The user wants… </think>Paris."  →  reasoning "The user wants… ", content "Paris."

A splitter reads the reply delta by delta and holds back a tail that could still become a
tag, so streamed deltas join to exactly the whole reply's split (one code path for both). A
new parser is a subclass with its tags and where the reply starts
(``starts_in_reasoning``), registered in ``REASONING_PARSERS``.

The grammar of a structured output or a tool call constrains only what follows the end tag
(``reasoning_end``: its token ids, carried in ``SamplingParams.reasoning_end_token_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence


class ReasoningParser:
    """Where a reply's reasoning starts and ends (the tags; subclasses say how it starts)."""

    name = ""
    start = "<think>"
    end = "</think>"
    # Whether the reply starts inside the reasoning without a start tag.
    starts_in_reasoning = True

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply."""
        splitter = self.splitter()
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return reasoning + more_reasoning, content + more_content

    def reasoning_ended_in(self, prompt: Sequence[int], start: list[int], end: list[int]) -> bool:
        """Whether the prompt already closed the reasoning (a template that turns thinking
        off writes an empty block): its last end tag comes after its last start tag. The
        token ids of the tags are the tokenizer's (``start``, ``end``)."""
        last_end = _last_index(prompt, end)
        return last_end is not None and last_end > (_last_index(prompt, start) or -1)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


class ReasoningSplitter:
    """One reply's split, delta by delta::

    state      deciding ──<think>──▶ reasoning ──</think>──▶ content
               (qwen3: anything else goes to content; deepseek_r1 starts in reasoning,
                an opening <think> dropped)
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = "deciding"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content this delta adds (a tag's possible start held back)."""
        self._held += text
        reasoning = content = ""
        if self._state == "deciding":
            head = self._held.lstrip()
            start = self.parser.start
            if head.startswith(start):
                self._held = head[len(start) :]
                self._state = "reasoning"
            elif start.startswith(head):  # could still be the start tag: wait
                return "", ""
            else:
                self._state = "reasoning" if self.parser.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self.parser.end
            at = self._held.find(end)
            if at >= 0:
                reasoning = self._held[:at]
                self._held = self._held[at + len(end) :]
                self._state = "content"
            else:
                keep = _possible_tag_start(self._held, end)
                reasoning, self._held = (
                    self._held[: len(self._held) - keep],
                    self._held[len(self._held) - keep :],
                )
                return reasoning, ""
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply ended: a tag that never completed is text."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (
            self._state == "deciding" and self.parser.starts_in_reasoning
        ):
            return held, ""
        return "", held


def _possible_tag_start(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _last_index(ids: Sequence[int], needle: list[int]) -> int | None:
    if not needle:
        return None
    for at in range(len(ids) - len(needle), -1, -1):
        if list(ids[at : at + len(needle)]) == needle:
            return at
    return None
