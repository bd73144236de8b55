"""Constraints the generation tests run on the built-in model, whether one
process or a pipeline samples: a JSON schema and a named tool call."""

from typing import Any

from exo.shared.types.constraints import ToolCalls, ToolSpec

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_ARGUMENTS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_CALL = ToolCalls(
    tools=(ToolSpec(name="get_weather", parameters=WEATHER_ARGUMENTS), ToolSpec(name="get_time")),
    prefix="<tool_call>\n",
    suffix="\n</tool_call>",
    named="get_weather",
)
