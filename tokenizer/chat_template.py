"""A model's chat template: a list of ``{role, content}`` messages rendered to one prompt string.

Templates ship with the model (``tokenizer.chat_template`` in a GGUF, ``chat_template``
in ``tokenizer_config.json``) and are untrusted code, so they run in jinja2's
``ImmutableSandboxedEnvironment``, set up as transformers' ``apply_chat_template`` sets it
up: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
that does not escape HTML, and the globals ``raise_exception`` and ``strftime_now``. The
template sees ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``, so
a prompt renders to the same string as transformers renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_ROLES = ("system", "user", "assistant")


class ChatTemplate:
    """A compiled chat template and the special-token strings it may write."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the model's chat template does not compile: {error}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt for ``messages`` (OpenAI chat format), ending with the assistant's turn
        opened when ``add_generation_prompt``.

        ``ValueError`` for empty messages, an unknown role, or content that is neither a
        string nor a list of ``{"type": "text", "text": ...}`` parts (joined with newlines),
        and when the template itself refuses the conversation (``raise_exception``).
        """
        plain_messages = validate_messages(messages)
        try:
            return self._template.render(
                messages=plain_messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template refused these messages: {error}") from None


def validate_messages(messages: object) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts of strings, or a ``ValueError``
    that says which message is wrong and why (``object``: it is the client's JSON, checked
    here, not yet a list of mappings)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}].role is {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        plain.append({"role": role, "content": _content_text(message.get("content"), index)})
    return plain


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [
            part.get("text")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        texts = [text for text in parts if isinstance(text, str)]
        if len(texts) == len(content):
            return "\n".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a non-empty list of "
        '{"type": "text", "text": "..."} parts'
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
