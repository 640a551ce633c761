"""Function tools on ``/v1/chat/completions``: definitions, ``tool_choice``, and the grammar
that makes ``required`` and a named function produce valid calls.

    tool_choice  "none"        tools are not shown to the model; a plain reply
                 "auto"        tools shown; the reply is parsed for <tool_call> blocks
                 "required"    the reply is one or more calls (grammar), of the given tools
                 {"type": "function", "function": {"name": N}}   one call of N (grammar)

A constrained reply is written in the same ``<tool_call>`` form the parser reads, each
call's JSON held to ``{"name": <that tool>, "arguments": <its parameters' schema>}``, so even
a 135M model returns calls that parse and validate; ``parallel_tool_calls: false`` allows
one. The default is ``auto`` when tools are given, else ``none``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pdserve.gateway.structured_outputs import StructuredOutputError
from pdserve.grammar import GrammarError, GrammarSpec
from pdserve.tokenizer.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# OpenAI's rule for a function name.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into ``ChatCompletionRequest``)."""

    tools: Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if self.tool_choice != "none" and not self.tools:
            raise StructuredOutputError("tool_choice needs tools", "tool_choice")
        return self.tool_choice

    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them; None when the model is not to see them."""
        self._check_tools()
        if not self.tools or self.effective_tool_choice() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_grammar(self) -> GrammarSpec | None:
        """The grammar of a ``required`` or named-function reply; None for auto and none."""
        choice = self.effective_tool_choice()
        if not isinstance(choice, NamedToolChoice) and choice != "required":
            return None
        functions = [tool.function for tool in self.tools or []]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f.name == choice.function.name]
            if not functions:
                raise StructuredOutputError(
                    f"tool_choice names {choice.function.name!r}, which is not one of the "
                    f"tools ({', '.join(t.function.name for t in self.tools or [])})",
                    "tool_choice",
                )
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ],
            "x-guidance": {
                "whitespace_flexible": False,
                "key_separator": ": ",
                "item_separator": ", ",
            },
        }
        several = self.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
        lark = "\n".join(
            [
                'start: call ("\\n" call)*' if several else "start: call",
                f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} %json {json.dumps(call)} "
                f"{json.dumps(chr(10) + TOOL_CALL_CLOSE)}",
            ]
        )
        spec = GrammarSpec("lark", lark)
        try:
            spec.validate()
        except GrammarError as error:
            raise StructuredOutputError(f"the tools do not compile: {error}", "tools") from None
        return spec

    def _check_tools(self) -> None:
        """Each name once; each ``parameters`` a JSON Schema that compiles."""
        names: set[str] = set()
        for index, tool in enumerate(self.tools or []):
            function = tool.function
            if function.name in names:
                raise StructuredOutputError(
                    f"tools[{index}]: the name {function.name!r} is used twice",
                    f"tools.{index}.function.name",
                )
            names.add(function.name)
            param = f"tools.{index}.function.parameters"
            try:
                GrammarSpec("json_schema", json.dumps(function.parameters)).validate()
            except GrammarError as error:
                raise StructuredOutputError(f"{param}: {error}", param) from None
