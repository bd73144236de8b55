"""The one internal chat request every API adapter (OpenAI chat/completions,
Anthropic Messages, Responses) translates into, and the structured pieces of a
reply (tool calls) they translate back from.

Tools, constrained decoding, sampling and the reasoning split are decided on
these types, below the adapters, so each is written once.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from exo.shared.types.frozen import FrozenModel


class ToolFunction(FrozenModel):
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    # The caller asks for arguments that validate against `parameters` exactly.
    strict: bool = False


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


class ChatImage(FrozenModel):
    """An image in a message: where it sits among the turn's text, and the image
    file (PNG, JPEG, ...) as the client sent it, or the http(s) address the
    node fetches it from (`api/images.py`) before the prompt is rendered."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    offset: int = Field(default=0, ge=0)  # characters of `content` before it
    url: str | None = None  # not fetched yet
    data: bytes = b""


class ChatTurn(FrozenModel):
    """One message of the conversation, as the chat template sees it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    # Images among `content`'s text, in order (user turns of vision models).
    images: tuple[ChatImage, ...] = ()
    # assistant turns: the calls it made and its reasoning (thinking) text
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    # tool turns: which call this is the result of
    tool_call_id: str | None = None
    name: str | None = None


class TextPrompt(FrozenModel):
    """A prompt given as text (legacy completions): tokenized as is, no chat template."""

    kind: Literal["text"] = "text"
    text: str


class TokenPrompt(FrozenModel):
    """A prompt given as token ids (legacy completions): used as is."""

    kind: Literal["tokens"] = "tokens"
    tokens: tuple[int, ...] = Field(min_length=1)


RawPrompt = Annotated[TextPrompt | TokenPrompt, Field(discriminator="kind")]

# Names the chat template call sets itself (or that steer the tokenizer, not the
# template): a request's template variables may not use them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class Sampling(FrozenModel):
    """How the next token is chosen. None: the model's default (its
    generation_config.json, else no effect). Each adapter checks the ranges its
    API documents; these types only carry the values."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: all tokens
    min_p: float | None = None
    repetition_penalty: float | None = None  # 1.0: none
    # Tokens (of prompt and reply) the repetition penalty looks back over; None: the engine's.
    repetition_context_size: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = Field(default_factory=dict[int, float])  # token id -> bias
    seed: int | None = None


class ChatRequest(FrozenModel):
    """What every API asks of a model: a conversation rendered through the chat
    template (`turns`), or a raw `prompt` that skips templating (legacy
    completions), plus how to generate the reply."""

    # The name the client asked for (an alias, any text): not a path, so not a
    # validated `ModelId`; the route puts the served model's id here.
    model: str
    turns: tuple[ChatTurn, ...] = ()
    prompt: RawPrompt | None = None
    tools: tuple[ToolFunction, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = TextFormat()
    max_tokens: int | None = Field(default=None, ge=1)  # None: up to the remaining context
    stop: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0)  # alternatives reported per token
    # Extra variables of the chat template, e.g. {"enable_thinking": False}.
    template_kwargs: dict[str, Any] = Field(default_factory=dict[str, Any])
    reasoning_effort: ReasoningEffort | None = None
    stream: bool = False
    include_usage: bool = False  # streams end with a usage chunk
    # Speculative decoding: drafts verified in the batch (False: none for this
    # request); `prediction`, text the reply is expected to repeat, drafted from.
    speculation: bool = True
    prediction: str | None = None
    # The last turn, an assistant one, is continued: the reply extends its text.
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "ChatRequest":
        if (self.prompt is None) == (not self.turns):
            raise ValueError("a chat request has either turns or a raw prompt")
        if self.prompt is not None and self.tools:
            raise ValueError("tools need a chat template; a raw prompt has none")
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs)):
            raise ValueError(f"template_kwargs may not set {', '.join(reserved)}")
        if self.continue_final_message and (not self.turns or self.turns[-1].role != "assistant"):
            raise ValueError("continue_final_message needs an assistant turn last")
        return self
