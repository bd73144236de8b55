"""The one internal chat request every API adapter (OpenAI chat/completions,
Anthropic Messages, Responses) translates into, and the structured pieces of a
reply (tool calls) they translate back from.

Tools, constrained decoding, sampling and the reasoning split are decided on
these types, below the adapters, so each is written once.
"""

from typing import Annotated, Any, Literal

from pydantic import Field

from exo.shared.types.frozen import FrozenModel


class ToolFunction(FrozenModel):
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolCall(FrozenModel):
    """A call the model made; `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str


class NamedToolChoice(FrozenModel):
    kind: Literal["named"] = "named"
    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class TextFormat(FrozenModel):
    kind: Literal["text"] = "text"


class JsonObjectFormat(FrozenModel):
    kind: Literal["json_object"] = "json_object"


class JsonSchemaFormat(FrozenModel):
    kind: Literal["json_schema"] = "json_schema"
    name: str = "response"
    json_schema: dict[str, Any]
    strict: bool = True


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="kind")
]


class ChatTurn(FrozenModel):
    """One message of the conversation, as the chat template sees it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    # assistant turns: the calls it made and its reasoning (thinking) text
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    # tool turns: which call this is the result of
    tool_call_id: str | None = None
    name: str | None = None
