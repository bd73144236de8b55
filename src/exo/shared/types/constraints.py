"""What a reply must look like, when a request fixes its shape: the structured
outputs (`response_format`), forced tool calls (`tool_choice` required or
named) and strict tools under `tool_choice` auto, which the runner enforces
token by token (`exo.engine.constraint_grammar` says which texts each one admits)."""

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from exo.shared.types.frozen import FrozenModel


class JsonObject(FrozenModel):
    """Any JSON object (OpenAI `response_format: {"type": "json_object"}`)."""

    kind: Literal["json_object"] = "json_object"


class JsonSchema(FrozenModel):
    """A JSON value valid against `json_schema`. Strict: a keyword the grammar
    library does not implement is an error; not strict: it is ignored (the
    output still has the schema's structure)."""

    kind: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any]
    strict: bool = True


class ToolSpec(FrozenModel):
    """A tool the model may call: its name and the JSON schema of its arguments
    (`strict` as for `JsonSchema`; agents' tool schemas are written for
    OpenAI's non-strict mode, hence off by default)."""

    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool = False


class ToolCalls(FrozenModel):
    """One or more tool calls in one model family's syntax, and nothing else.

    A call is `{"name": <tool>, <arguments_key>: <arguments>}`; the reply is
    `prefix + call + suffix` (with `list_form`: `prefix + [call, call, ...] + suffix`).
    With `parallel`, several calls (each wrapped in prefix and suffix, separated
    by whitespace, or several list items); otherwise exactly one. `named`
    restricts the calls to that tool. The markers are data: each family's
    parser owns them (e.g. Hermes: `<tool_call>\\n` and `\\n</tool_call>`).

    With `text_allowed` (strict tools under `tool_choice` auto) the reply may
    be text instead, or text and then the calls. The text never holds one of
    `markers` (the parser reads a call wherever one appears) nor, with
    `bare_json_start`, begins with `{` (the parser reads that as a call), so
    every call the parser sees went through the grammar. A prefix then starts
    with one of `markers`; an empty one lets calls follow any marker."""

    kind: Literal["tool_calls"] = "tool_calls"
    tools: tuple[ToolSpec, ...] = Field(min_length=1)
    prefix: str
    suffix: str
    arguments_key: str = Field(default="arguments", min_length=1)
    list_form: bool = False
    named: str | None = None
    parallel: bool = False
    text_allowed: bool = False
    markers: tuple[str, ...] = ()
    bare_json_start: bool = False

    @model_validator(mode="after")
    def _check(self) -> Self:
        names = [tool.name for tool in self.tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique, repeated: {', '.join(duplicates)}")
        if self.named is not None and self.named not in names:
            raise ValueError(f"named tool {self.named!r} is not among the tools")
        opens = not self.prefix or any(self.prefix.startswith(m) for m in self.markers if m)
        if self.text_allowed and not opens:
            raise ValueError("with text allowed, a prefix starts with one of the markers")
        return self


Constraint = Annotated[JsonObject | JsonSchema | ToolCalls, Field(discriminator="kind")]
