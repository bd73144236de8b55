"""Request bodies of the Anthropic Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens`.

No field is dropped silently: every field of Anthropic's requests (the
official client's, beta ones included) is declared here and is honoured,
rejected with a 400 naming it when set, or accepted and ignored
(`*_MESSAGES_FIELDS` below; the README lists them). A field no list names is
rejected as unknown (`extra="forbid"`). The ignored fields of blocks, tools
and settings are in the same list (`IGNORED_MESSAGES_FIELDS`), marked
`# ignored` where they are declared.

The headers `anthropic-version`, `anthropic-beta` and `x-api-key` are accepted;
the versions and betas change nothing in what exo does.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from exo.api.request_fields import (
    RequestBody,
    check_raw_image,
    choice_not_among_tools,
    declared_types,
    reject_repeated_names,
    unsupported,
)
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import TopP

# Ignored wherever it appears: exo's prefix cache finds shared prefixes itself.
CacheControl = dict[str, Any]


_BLOCK_REJECTIONS = {
    "image": "image content blocks are accepted in user messages and tool results only",
    "document": "document content blocks are not supported: send the document's text",
    "search_result": "search_result content blocks are not supported: send the results as text",
    "container_upload": "container_upload content blocks are not supported: exo runs no code",
    "tool_addition": "mid-conversation tool changes are not supported: send every tool in tools",
    "tool_removal": "mid-conversation tool changes are not supported: send every tool in tools",
}


def _only_blocks(content: Any, allowed: tuple[str, ...]) -> Any:
    # Names the block type a client sent, rather than a union mismatch.
    for kind in declared_types(content):
        if isinstance(kind, str) and kind not in allowed:
            raise unsupported(
                _BLOCK_REJECTIONS.get(
                    kind,
                    f"{kind!r} content blocks are not supported here (allowed: {', '.join(allowed)})",
                )
            )
    return content


# ---- content blocks ----


class TextBlockParam(FrozenModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # ignored
    citations: list[dict[str, Any]] | None = None  # ignored


# An image's source is checked on the raw message (`_check_images`), named by
# its block: past the `str | list` content union pydantic would report the
# string mismatch first.


class Base64ImageSource(FrozenModel):
    type: Literal["base64"]
    media_type: str  # ignored
    data: str


class URLImageSource(FrozenModel):
    type: Literal["url"]
    url: str  # an http(s) URL the node fetches (or a base64 data URL)


ImageSource = Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]


class ImageBlockParam(FrozenModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None  # ignored


def _check_image(block: Any, where: str) -> None:
    source: Any = block.get("source") if isinstance(block, dict) else None  # pyright: ignore[reportUnknownMemberType]
    if not isinstance(source, dict):
        raise unsupported(f"{where}: an image block needs a source object")
    match source.get("type"):  # pyright: ignore[reportUnknownMemberType]
        case "base64":
            check_raw_image(source.get("data"), f"{where} (source.data)", base64_only=True)  # pyright: ignore[reportUnknownMemberType]
        case "url":
            check_raw_image(source.get("url"), f"{where} (source.url)")  # pyright: ignore[reportUnknownMemberType]
        case "file":
            raise unsupported(
                f"{where}: image sources of type 'file' are not supported: exo stores no "
                "files; send the image as base64 or a url"
            )
        case kind:
            raise unsupported(f"{where}: an image source's type is base64 or url, not {kind!r}")


class ThinkingBlockParam(FrozenModel):
    """Reasoning in history; `signature` is what exo wrote (see `anthropic.py`)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(FrozenModel):
    """Another server's encrypted reasoning: accepted, and not shown to the model."""

    type: Literal["redacted_thinking"]
    data: str  # ignored


class ToolUseBlockParam(FrozenModel):
    type: Literal["tool_use"]
    id: str  # kept as sent: some templates render it, so the prompt depends on it
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None  # ignored
    caller: dict[str, Any] | None = None  # ignored
    toolset_name: str | None = None  # ignored


ToolResultContent = Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]


class ToolResultBlockParam(FrozenModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None  # ignored
    cache_control: CacheControl | None = None  # ignored
    toolset_name: str | None = None  # ignored

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _only_blocks(content, ("text", "image"))


UserBlock = Annotated[
    TextBlockParam | ImageBlockParam | ToolResultBlockParam, Field(discriminator="type")
]
AssistantBlock = Annotated[
    TextBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam | ToolUseBlockParam,
    Field(discriminator="type"),
]


# ---- messages ----

Effort = Literal["low", "medium", "high", "xhigh", "max"]


class JsonOutputFormat(FrozenModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(FrozenModel):
    effort: Effort | None = None  # the template's reasoning_effort
    format: JsonOutputFormat | None = None  # structured output, by constrained decoding


class UserMessageParam(FrozenModel):
    role: Literal["user"]
    content: str | list[UserBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any) -> Any:
        # A result's own blocks are checked here too: past the `str | list`
        # union, pydantic would report the string mismatch first.
        _only_blocks(content, ("text", "image", "tool_result"))
        for index, block in enumerate(content if isinstance(content, list) else ()):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            if not isinstance(block, dict):
                continue
            if block.get("type") == "image":  # pyright: ignore[reportUnknownMemberType]
                _check_image(block, f"block {index}")
            if block.get("type") == "tool_result":  # pyright: ignore[reportUnknownMemberType]
                inner: Any = block.get("content")  # pyright: ignore[reportUnknownMemberType]
                _only_blocks(inner, ("text", "image"))
                for part, item in enumerate(inner if isinstance(inner, list) else ()):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
                    if isinstance(item, dict) and item.get("type") == "image":  # pyright: ignore[reportUnknownMemberType]
                        _check_image(item, f"block {index} (tool_result) block {part}")
        return content


class AssistantMessageParam(FrozenModel):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any) -> Any:
        return _only_blocks(content, ("text", "thinking", "redacted_thinking", "tool_use"))


class SystemMessageParam(FrozenModel):
    """A system message inside `messages` (Claude Code sends its environment so)."""

    role: Literal["system"]
    content: str | list[TextBlockParam]
    # "next_user_message": shown only until a later user message exists
    clear_at: Literal["next_user_message", "never"] | None = None
    output_config: OutputConfig | None = None  # ignored

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content: Any) -> Any:
        return _only_blocks(content, ("text",))


MessageParam = Annotated[
    UserMessageParam | AssistantMessageParam | SystemMessageParam, Field(discriminator="role")
]


# ---- tools ----


class ToolParam(FrozenModel):
    """A client tool: the model calls it, the client runs it."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None  # ignored
    defer_loading: bool | None = None  # ignored
    eager_input_streaming: bool | None = None  # ignored
    input_examples: list[dict[str, Any]] | None = None  # ignored
    allowed_callers: list[str] | None = None  # ignored


class AutoToolChoice(FrozenModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyToolChoice(FrozenModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedToolChoiceParam(FrozenModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class NoToolChoice(FrozenModel):
    type: Literal["none"]


ToolChoiceParam = Annotated[
    AutoToolChoice | AnyToolChoice | NamedToolChoiceParam | NoToolChoice,
    Field(discriminator="type"),
]

# ---- thinking ----

# "omitted": thinking blocks come with empty text (the reasoning rides in the signature)
ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingEnabled(FrozenModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)  # ignored
    display: ThinkingDisplay | None = None


class ThinkingAdaptive(FrozenModel):
    type: Literal["adaptive"]
    display: ThinkingDisplay | None = None


class ThinkingDisabled(FrozenModel):
    type: Literal["disabled"]


ThinkingParam = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class MetadataParam(FrozenModel):
    user_id: str | None = None


# ---- requests ----

REJECTED_MESSAGES_FIELDS: dict[str, str] = {
    "mcp_servers": "MCP servers are not supported: exo connects to no tools itself; "
    "declare them as client tools",
    "container": "containers are not supported: exo runs no code",
    "thread": "threads are not supported: send the whole conversation in messages",
}
_CACHE_BY_TOKENS = "the prefix cache finds shared prefixes itself: it needs no breakpoints"
_ANTHROPIC_ACCOUNTS = "Anthropic's accounts and billing: none here"
# Accepted and ignored, with why: the README's list. A top-level name is a
# field of the request; a dotted path, a field of a part of it (lists and
# unions looked through). A test checks that each path names a declared field.
IGNORED_MESSAGES_FIELDS: dict[str, str] = {
    "metadata": "an end user's id, for Anthropic's abuse monitoring: exo has none",
    "service_tier": "exo serves every request alike",
    "speed": "exo serves every request alike",
    "inference_geo": "the model runs in this cluster",
    "cache_control": _CACHE_BY_TOKENS,
    "context_management": "exo never clears context: the client sends what the model sees",
    "compaction": "exo does not summarize conversations: the reply is a normal answer",
    "diagnostics": "exo explains no cache misses in the reply",
    "billing_policy": _ANTHROPIC_ACCOUNTS,
    "fallbacks": "exo never declines for policy reasons, so never falls back",
    "fallback_credit_token": _ANTHROPIC_ACCOUNTS,
    "user_profile_id": _ANTHROPIC_ACCOUNTS,
    "workspace_id": _ANTHROPIC_ACCOUNTS,
    "thinking.budget_tokens": "the thinking counts toward max_tokens and is not capped on its own",
    "messages.output_config": "a turn's own effort: the request's output_config.effort applies",
    "system.cache_control": _CACHE_BY_TOKENS,
    "messages.content.cache_control": _CACHE_BY_TOKENS,
    "messages.content.citations": "exo cites nothing",
    "messages.content.data": "redacted_thinking: another server's encrypted reasoning, "
    "not shown to the model",
    "messages.content.caller": "every call is the model's",
    "messages.content.toolset_name": "not shown to the model",
    "messages.content.is_error": "clients write the error into the content, which the model reads",
    "messages.content.source.media_type": "the image's own bytes say its format",
    "tools.cache_control": _CACHE_BY_TOKENS,
    "tools.defer_loading": "exo has no tool search: the model sees every tool from the start",
    "tools.eager_input_streaming": "a call goes out when it is complete and checked",
    "tools.input_examples": "not shown to the model",
    "tools.allowed_callers": "every call is the model's",
}


class MessagesRequestBase(RequestBody):
    """What a message and a token count share: the prompt and its tools."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    # rejected when set (REJECTED_MESSAGES_FIELDS)
    mcp_servers: Any = None
    # accepted and ignored (IGNORED_MESSAGES_FIELDS)
    cache_control: CacheControl | None = None
    speed: str | None = None
    context_management: dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    billing_policy: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("messages")
    @classmethod
    def _conversation(cls, messages: list[MessageParam]) -> list[MessageParam]:
        if not messages:
            raise unsupported("messages must contain at least one message")
        if isinstance(messages[-1], AssistantMessageParam):
            raise unsupported(
                "a final assistant message (prefill) is not supported: end with a user message"
            )
        return messages

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, system: Any) -> Any:
        return _only_blocks(system, ("text",))

    # `container` and `thread` are MessagesRequest's own fields
    @field_validator(*REJECTED_MESSAGES_FIELDS, check_fields=False)
    @classmethod
    def _rejected(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise unsupported(REJECTED_MESSAGES_FIELDS[info.field_name or ""])
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, tools: Any) -> Any:
        for kind in declared_types(tools):
            if kind not in (None, "custom"):
                raise unsupported(
                    f"server tools are not supported ({kind!r}): exo runs no tools itself; "
                    "declare client tools with name, description and input_schema"
                )
        return tools

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        reject_repeated_names(tool.name for tool in tools or [])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, choice: ToolChoiceParam | None, info: ValidationInfo
    ) -> ToolChoiceParam | None:
        if "tools" not in info.data:
            return choice  # the tools were invalid; that error is reported
        names = {tool.name for tool in info.data["tools"] or []}
        if isinstance(choice, AnyToolChoice) and not names:
            raise unsupported('tool_choice "any" needs tools')
        if isinstance(choice, NamedToolChoiceParam) and choice.name not in names:
            raise choice_not_among_tools("tool", choice.name, names)
        return choice


class MessagesRequest(MessagesRequestBase):
    """`POST /v1/messages`."""

    # Required. Above what the context leaves it is clamped to that, never a 400.
    max_tokens: int
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=0)  # 0: all tokens
    # exo's extension: false turns speculative decoding's drafts off for this request.
    speculation: bool | None = None
    # rejected when set (REJECTED_MESSAGES_FIELDS)
    container: Any = None
    thread: Any = None
    # accepted and ignored (IGNORED_MESSAGES_FIELDS)
    metadata: MetadataParam | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    fallbacks: Any = None
    fallback_credit_token: Any = None

    @field_validator("max_tokens")
    @classmethod
    def _generates(cls, max_tokens: int) -> int:
        if max_tokens < 1:
            raise unsupported("max_tokens must be at least 1 (exo has no cache pre-warming)")
        return max_tokens


class CountTokensRequest(MessagesRequestBase):
    """`POST /v1/messages/count_tokens`: the prompt of a message, not generated."""


# Honoured. With the two lists above these name every field of MessagesRequest
# (a test checks it).
HONOURED_MESSAGES_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "max_tokens",
        "stream",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "speculation",
    }
)


class TokenCount(BaseModel):
    """The answer of `POST /v1/messages/count_tokens`."""

    input_tokens: int
