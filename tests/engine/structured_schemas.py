"""JSON Schemas and tools the structured-output suites use: nested objects, arrays with minItems,
enums, required keys, bounded numbers and string patterns (strings bounded, so a model with
random weights still closes every string within the token budget)."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
MEASUREMENT = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["cm", "kg", "s"]},
        "value": {"type": "number", "minimum": -10, "maximum": 10},
        "tags": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "string", "maxLength": 4},
        },
        "source": {
            "type": "object",
            "properties": {"lab": {"type": "string", "maxLength": 6}},
            "required": ["lab"],
            "additionalProperties": False,
        },
    },
    "required": ["unit", "value", "tags", "source"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "measurement": MEASUREMENT}

# Two function tools, their parameters bounded for the same reason.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}
