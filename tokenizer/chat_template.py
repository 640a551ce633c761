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
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.tokenizer.tool_prompt import fold_tools

CHAT_ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role: templates know only "system", so it renders so.
_ROLE_ALIASES = {"developer": "system"}


class _GenerationTags(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` ... ``{% endgeneration %}``: it marks the
    assistant's tokens for training masks; rendered, it is its body. Without it a template
    that uses it does not compile, and the model does not load."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplate:
    """A compiled chat template and the special-token strings it may write."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTags],
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
            # A template that reads ``tools`` renders definitions, calls and results itself.
            self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(
                environment.parse(source)
            )
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the model's chat template does not compile: {error}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages`` (OpenAI chat format), ending with the assistant's turn
        opened when ``add_generation_prompt``. ``tools``: OpenAI function definitions, given
        to a template that reads them, else written into the system prompt (``fold_tools``).

        ``ValueError`` for empty messages, an unknown role, or content that is neither a
        string nor a list of ``{"type": "text", "text": ...}`` parts (joined with newlines),
        and when the template itself refuses the conversation (``raise_exception``).
        ``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``); one that would replace
        a variable the renderer sets is a ``ValueError``.
        """
        plain_messages = validate_messages(messages)
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
        clashes = sorted(reserved & set(template_kwargs or {}))
        if clashes:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clashes)}")
        extra: dict[str, Any] = dict(template_kwargs or {})
        if self.supports_tools:
            extra["tools"] = list(tools) if tools else None
        else:
            plain_messages = fold_tools(plain_messages, tools)
        try:
            return self._template.render(
                messages=plain_messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template refused these messages: {error}") from None


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """``messages`` as plain ``{"role", "content"}`` dicts of strings (an assistant's
    ``tool_calls``, a tool result's ``tool_call_id`` and any message's ``name`` kept), or
    a ``ValueError`` that says which message is wrong and why (``object``: it is the
    client's JSON, checked here, not yet a list of mappings)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}].role is {message.get('role')!r}; expected one of "
                f"{', '.join((*CHAT_ROLES, *_ROLE_ALIASES))}"
            )
        calls = message.get("tool_calls") if role == "assistant" else None
        checked_calls = None if calls is None else _tool_calls(calls, index)
        content = message.get("content")
        plain_message: dict[str, Any] = {
            "role": role,
            "content": "" if checked_calls and content is None else _content_text(content, index),
        }
        if checked_calls is not None:
            plain_message["tool_calls"] = checked_calls
        name = message.get("name")  # a participant's (or a tool result's function's) name
        if name is not None:
            if not isinstance(name, str):
                raise ValueError(f"messages[{index}].name must be a string")
            plain_message["name"] = name
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"messages[{index}] (a tool result) needs its tool_call_id")
            plain_message["tool_call_id"] = call_id
        plain.append(plain_message)
    return plain


def _tool_calls(calls: object, index: int) -> list[dict[str, Any]]:
    """An assistant's past calls, arguments decoded to objects (as transformers' templates
    expect them; OpenAI sends them as JSON text)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where} must be a non-empty list of calls")
    checked = []
    for position, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ValueError(
                f"{where}[{position}] must be {{id, type: function, function: {{name, arguments}}}} "
                "with arguments as JSON text"
            )
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"{where}[{position}].function.arguments is not JSON") from None
        checked.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": name, "arguments": decoded},
            }
        )
    return checked


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
