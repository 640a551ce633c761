"""Tool calls out of a reply's text, as it streams: Hermes-style ``<tool_call>`` blocks.

    Sure.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    └content┘└──────────── one call: header (id, name), then argument deltas ─────────────┘

One parser serves the streamed and the whole reply: the whole reply is the same parser fed
the whole text at once, so both carry exactly the same content and calls. While a block
streams, the name is sent once it is complete, then the arguments' raw JSON text as it
grows (a value that is not complete yet is all argument text; once ``json.raw_decode``
reads it whole, its exact text is known). Text that may be the start of a tag, and
whitespace with nothing after it, is held back until the next piece shows what it is.

A parser for another model's format implements ``ToolCallParser`` (``feed`` / ``finish``).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.tokenizer.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()
# What may follow a whole JSON number in a call's object; the end of the text so far may not
# (more digits may come).
_AFTER_A_NUMBER = frozenset(" \t\r\n,}")


@dataclass(slots=True)
class ToolCallDelta:
    """What one call gained: its header the first time (id and name), then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """The delta in OpenAI's ``chat.completion.chunk`` shape."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments_sent: str = ""
    arguments_done: bool = False


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    def __init__(self) -> None:
        self._text = ""  # everything fed so far
        self._position = 0  # where the text not yet parsed starts
        self._block_start: int | None = None  # inside a block: where its body starts
        self._held_space = ""  # whitespace not yet known to be followed by content
        self._calls: list[_Call] = []
        self._num_closed_calls = 0
        self._unreadable = False  # a call ended with arguments JSON cannot read

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        delta = ParsedDelta()
        while self._step(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        """The end of the reply: held-back text that turned out to be plain content (as is
        an unclosed block whose name never came; and, in a reply with no call, its trailing
        whitespace, kept as written)."""
        delta = ParsedDelta()
        if self._block_start is None:
            self._emit_content(delta, self._text[self._position :])
        elif not self._in_call:
            self._emit_content(delta, self._text[self._block_start - len(TOOL_CALL_OPEN) :])
        elif not self._calls[-1].arguments_done:  # the reply ended inside its arguments
            self._unreadable = True
        if not self._calls:
            delta.content += self._held_space
            self._held_space = ""
        self._position = len(self._text)
        return delta

    @property
    def calls_readable(self) -> bool:
        """After ``finish``: every call's arguments were read whole. A call cut off (the
        model stopped, or was stopped, inside its arguments) or malformed is none a client
        can run."""
        return not self._unreadable

    @property
    def _in_call(self) -> bool:
        """The open block has a call (its name was read)."""
        return len(self._calls) > self._num_closed_calls

    def _step(self, delta: ParsedDelta) -> bool:
        """Parses what it can from ``_position``; True when it moved past a tag."""
        if self._block_start is None:
            rest = self._text[self._position :]
            opened = rest.find(TOOL_CALL_OPEN)
            if opened < 0:
                keep = _partial_tag(rest)
                self._emit_content(delta, rest[: len(rest) - keep])
                self._position = len(self._text) - keep
                return False
            self._emit_content(delta, rest[:opened])
            self._position += opened + len(TOOL_CALL_OPEN)
            self._block_start = self._position
            return True
        body_end = self._text.find(TOOL_CALL_CLOSE, self._block_start)
        closed = body_end >= 0
        body = self._text[self._block_start : body_end if closed else len(self._text)]
        self._advance_call(delta, body, closed)
        if not closed:
            return False
        block_end = body_end + len(TOOL_CALL_CLOSE)
        if not self._in_call:  # closed without a readable name: it was content after all
            self._emit_content(
                delta, self._text[self._block_start - len(TOOL_CALL_OPEN) : block_end]
            )
        elif not self._calls[-1].arguments_done:
            self._unreadable = True
        self._num_closed_calls = len(self._calls)
        self._position, self._block_start = block_end, None
        return True

    def _advance_call(self, delta: ParsedDelta, body: str, closed: bool) -> None:
        named = _NAME.match(body)
        if named is None:
            return
        if not self._in_call:  # this block's header
            try:
                name = json.loads(f'"{named.group(1)}"')
            except json.JSONDecodeError:  # "get\_weather", a raw newline: no readable name
                return  # the block stays content, as one with no name does
            self._calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}", name))
            call = self._calls[-1]
            delta.tool_calls.append(ToolCallDelta(len(self._calls) - 1, "", call.id, name))
        call = self._calls[-1]
        if call.arguments_done:
            return
        start = named.end()
        # Not whole yet (JSON cannot read it): its text so far, less what the next piece may
        # take back (trailing whitespace, a tail that may begin the closing tag).
        arguments = body[start:]
        if not closed:
            arguments = arguments[: len(arguments) - _partial_tag(arguments, TOOL_CALL_CLOSE)]
        arguments = arguments.rstrip()
        with contextlib.suppress(json.JSONDecodeError):
            value, end = _DECODER.raw_decode(body, start)
            # A number is whole once what follows it cannot go on with it ("1" of "12",
            # "1" of "1.5", "1.5" of "1.5e3" are not); anything else read whole is whole.
            if closed or not _is_number(value) or body[end : end + 1] in _AFTER_A_NUMBER:
                arguments, call.arguments_done = body[start:end], True
        if len(arguments) > len(call.arguments_sent) and arguments.startswith(call.arguments_sent):
            delta.tool_calls.append(
                ToolCallDelta(len(self._calls) - 1, arguments[len(call.arguments_sent) :])
            )
            call.arguments_sent = arguments

    def _emit_content(self, delta: ParsedDelta, text: str) -> None:
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        delta.content += stripped


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _partial_tag(text: str, tag: str = TOOL_CALL_OPEN) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def parse_whole(text: str) -> tuple[str, list[dict[str, Any]], bool]:
    """A whole reply's content, its calls in OpenAI's ``message.tool_calls`` shape, and
    whether every call was readable: the streaming parser fed everything at once, so it
    equals what a stream carried. A reply with a call JSON cannot read (cut off, malformed)
    is all content and no call, as vLLM returns it (a stream had sent that call's deltas)."""
    parser = HermesToolParser()
    parts = [parser.feed(text), parser.finish()]
    if not parser.calls_readable:
        return text, [], False
    calls: list[dict[str, Any]] = []
    for delta in (d for part in parts for d in part.tool_calls):
        if delta.id is not None:  # a message's call has no index (a stream's delta has)
            calls.append({k: v for k, v in delta.openai().items() if k != "index"})
        else:
            calls[delta.index]["function"]["arguments"] += delta.arguments
    return "".join(part.content for part in parts), calls, True
