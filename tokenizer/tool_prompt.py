"""Tools for a chat template that has no notion of them: the definitions go into the system
prompt, and past calls and results into plain text, in the Hermes tag format that
``gateway/tool_calls.py`` parses back out of the reply.

A template that uses ``tools`` (Qwen, Hermes, Llama 3.1 ...) gets them as transformers
passes them and renders calls and results itself; this is only the fallback, e.g. for
SmolLM2's plain ChatML template:

    system   <its own text, if any>

             # Tools
             You can call the functions below. ...
             <tools>
             {"type": "function", "function": {"name": ..., "parameters": {...}}}
             </tools>
             ... <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    assistant (with tool_calls)  <content>\n<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>
    tool                          user: <tool_response>\n<content>\n</tool_response>
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

_INSTRUCTIONS = """# Tools

You can call the functions below. Their definitions, one JSON object per line, are inside the <tools></tools> tags:
<tools>
{definitions}
</tools>

To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> tags, holding the function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (the same form the reply parser reads)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def fold_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` with tool definitions, calls and results as text (see the module doc)."""
    folded = [_as_text(message) for message in messages]
    if tools:
        definitions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        instructions = _INSTRUCTIONS.format(definitions=definitions)
        if folded and folded[0]["role"] == "system":
            folded[0] = {**folded[0], "content": f"{folded[0]['content']}\n\n{instructions}"}
        else:
            folded.insert(0, {"role": "system", "content": instructions})
    return folded


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)  # a participant's name stays
    texts = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    content = "\n".join(filter(None, [message["content"], *texts]))
    kept = {key: value for key, value in message.items() if key != "tool_calls"}
    return {**kept, "content": content}
