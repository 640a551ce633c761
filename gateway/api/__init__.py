"""The API surfaces the gateway answers, one file each, around one internal request shape
(``openai_schema.ParsedCompletion``, with ``APIError`` for refusals)::

    openai_schema.py        OpenAI completions; the shared validation, the parsed request
    chat.py                 OpenAI chat completions (the chat template, tools)
    anthropic_messages.py   Anthropic's Messages API        ─┐ parsed into the chat request,
    responses_api.py        OpenAI's Responses API          ─┘ rendered from the chat reply
    tokenize_api.py         vLLM's /tokenize and /detokenize

Each parses its body into the parsed request and renders the reply out of the chat or
completions reply; the orchestrator never sees an API's shape.
"""
