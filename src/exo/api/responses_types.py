"""Request bodies of the OpenAI Responses API (`POST /v1/responses`).

exo is stateless here: nothing is stored, so each request carries the whole
conversation in `input` (the `store: false` behaviour). `store` is accepted
(it is the API's default) and nothing is stored; `previous_response_id` and
`conversation`, which would need stored state, are a 400.

No field is dropped silently: every field of the official client's request is
declared here and is honoured, rejected with a 400 naming it when set, or
accepted and ignored (`*_RESPONSES_FIELDS` below; the README lists them). A
field no list names is rejected as unknown (`extra="forbid"`). The ignored
fields of items, tools and settings are in the same list
(`IGNORED_RESPONSES_FIELDS`), marked `# ignored` where they are declared.
"""

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from exo.api.request_fields import (
    CACHE_BY_TOKENS,
    NO_END_USERS,
    SCHEMA_NOT_SHOWN,
    RequestBody,
    check_raw_image,
    choice_not_among_tools,
    declared_types,
    image_from_url,
    reject_non_function_choice,
    reject_repeated_names,
    text_with_images,
    unsupported,
)
from exo.shared.types.chat import ChatImage, ReasoningEffort
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import Temperature, TopP


def _only_parts(content: Any, allowed: tuple[str, ...]) -> Any:
    # Names the part type a client sent, rather than a union mismatch.
    for kind in declared_types(content):
        if isinstance(kind, str) and kind not in allowed:
            if kind == "input_image":
                raise unsupported("'input_image' content is accepted in user messages only")
            raise unsupported(
                f"{kind!r} content is not supported: exo reads text and images "
                "(input_image, in user messages)"
                if kind.startswith("input_")
                else f"{kind!r} content is not supported here (allowed: {', '.join(allowed)})"
            )
    return content


# ---- input items ----


class InputTextPart(FrozenModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # ignored


class InputImagePart(FrozenModel):
    """Checked on the raw input (`_check_image`), named by its item and part:
    past the `str | list` unions pydantic would report a string mismatch first."""

    type: Literal["input_image"]
    image_url: str  # a base64 data URL, or an http(s) URL the node fetches
    file_id: None = None  # rejected: no file storage
    detail: str | None = None  # ignored


def _check_image(part: dict[str, Any], where: str) -> None:
    if part.get("file_id") is not None:
        raise unsupported(
            f"{where}: file_id is not supported: exo stores no files; send image_url "
            "(a base64 data URL or an http(s) URL)"
        )
    if part.get("image_url") is None:
        raise unsupported(f"{where}: an input_image needs image_url")
    if not isinstance(part.get("image_url"), str):
        raise unsupported(f"{where}: image_url is a string: a base64 data URL or an http(s) URL")
    check_raw_image(part.get("image_url"), f"{where} (image_url)")


class OutputTextPart(FrozenModel):
    """An earlier reply's text, sent back in history."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None  # ignored
    logprobs: list[Any] | None = None  # ignored


class RefusalPart(FrozenModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    InputTextPart | InputImagePart | OutputTextPart | RefusalPart, Field(discriminator="type")
]


def _part_text(part: ContentPart) -> str:
    match part:
        case RefusalPart():
            return part.refusal
        case InputImagePart():
            return ""  # only in user messages (checked), read by `user_content`
        case _:
            return part.text


def parts_text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(part) for part in content)


def user_content(content: str | list[ContentPart]) -> tuple[str, tuple[ChatImage, ...]]:
    """A user message's text parts joined (as `parts_text`), and its images, each
    at the length of the text before it."""
    if isinstance(content, str):
        return content, ()
    return text_with_images(
        image_from_url(part.image_url) if isinstance(part, InputImagePart) else _part_text(part)
        for part in content
    )


class MessageItem(FrozenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None  # ignored
    status: str | None = None  # ignored
    phase: str | None = None  # ignored


class FunctionCallItem(FrozenModel):
    """A call an earlier reply made."""

    type: Literal["function_call"]
    call_id: str  # kept as sent: some templates render it
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None  # ignored
    status: str | None = None  # ignored
    namespace: str | None = None  # ignored
    caller: dict[str, Any] | None = None  # ignored


class FunctionCallOutputItem(FrozenModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None  # ignored
    status: str | None = None  # ignored
    name: str | None = None  # the function's name; the call's own name wins
    namespace: str | None = None  # ignored
    caller: dict[str, Any] | None = None  # ignored


class ReasoningText(FrozenModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(FrozenModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(FrozenModel):
    """An earlier reply's reasoning: its `content` is shown to the model again
    with the turn that follows it (summaries and encrypted content are not)."""

    type: Literal["reasoning"]
    id: str | None = None  # ignored
    summary: list[SummaryText] = Field(default_factory=list[SummaryText])  # ignored
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # ignored
    status: str | None = None  # ignored


_SUPPORTED_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        kind = item.get("type", "message")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        return kind if isinstance(kind, str) else ""
    return str(getattr(item, "type", ""))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


# ---- tools, formats ----


class FunctionToolParam(FrozenModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema; none: no parameters
    strict: bool | None = None
    defer_loading: bool | None = None  # ignored
    allowed_callers: list[str] | None = None  # ignored
    output_schema: dict[str, Any] | None = None  # ignored


class FunctionToolChoice(FrozenModel):
    type: Literal["function"]
    name: str


ToolChoiceParam = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormatParam(FrozenModel):
    type: Literal["text"]


class JsonObjectFormatParam(FrozenModel):
    type: Literal["json_object"]


class JsonSchemaFormatParam(FrozenModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)  # ignored
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None  # ignored
    strict: bool | None = None


FormatParam = Annotated[
    TextFormatParam | JsonObjectFormatParam | JsonSchemaFormatParam, Field(discriminator="type")
]


class TextConfig(FrozenModel):
    format: FormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored


class ReasoningConfig(FrozenModel):
    effort: ReasoningEffort | None = None  # the template's reasoning_effort
    summary: str | None = None  # ignored
    generate_summary: str | None = None  # ignored


# ---- the request ----

REJECTED_RESPONSES_FIELDS: dict[str, str] = {
    "previous_response_id": "exo stores no responses: send the whole conversation in input",
    "conversation": "exo stores no conversations: send the whole conversation in input",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported: send the prompt in input",
    "max_tool_calls": "max_tool_calls is not supported",
    "moderation": "moderation is not supported",
    "top_logprobs": "logprobs are not supported in the Responses API: use chat completions",
}
_NOT_STORED = "items are not stored or looked up: the request carries them whole"
_NOT_SHOWN = "not shown to the model"
# Accepted and ignored, with why: the README's list. A top-level name is a
# field of the request; a dotted path, a field of a part of it (lists and
# unions looked through). A test checks that each path names a declared field.
IGNORED_RESPONSES_FIELDS: dict[str, str] = {
    "store": "nothing is stored either way",
    "include": "exo returns what it has (the reasoning's text included) whatever is asked",
    "metadata": "tags of stored responses: exo stores none",
    "user": NO_END_USERS,
    "safety_identifier": NO_END_USERS,
    "service_tier": "exo serves every request alike",
    "prompt_cache_key": CACHE_BY_TOKENS,
    "prompt_cache_options": CACHE_BY_TOKENS,
    "prompt_cache_retention": "cache entries live until evicted (LRU, memory pressure)",
    "stream_options": "its one option asks for obfuscation padding, which exo does not send",
    "context_management": "exo never compacts a conversation: the client sends what the model sees",
    "access_programs": "OpenAI's domain-specific programs: none here",
    "image": "image options: exo generates text only",
    "text.verbosity": "a setting of OpenAI's models that chat templates do not have",
    "text.format.name": SCHEMA_NOT_SHOWN,
    "text.format.description": SCHEMA_NOT_SHOWN,
    "reasoning.summary": "exo returns the reasoning itself, not a summary",
    "reasoning.generate_summary": "exo returns the reasoning itself, not a summary",
    "input.id": _NOT_STORED,
    "input.status": _NOT_STORED,
    "input.phase": _NOT_SHOWN,
    "input.namespace": _NOT_SHOWN,
    "input.caller": "every call is the model's",
    "input.summary": "the reasoning's own text (content) is shown to the model instead",
    "input.encrypted_content": "another server's reasoning, which exo cannot read",
    "input.content.annotations": _NOT_SHOWN,
    "input.content.logprobs": _NOT_SHOWN,
    "input.content.prompt_cache_breakpoint": CACHE_BY_TOKENS,
    "input.content.detail": "the model's image processor chooses the resolution "
    "(detail sets OpenAI's)",
    "input.output.prompt_cache_breakpoint": CACHE_BY_TOKENS,
    "tools.defer_loading": "exo has no tool search: the model sees every tool from the start",
    "tools.allowed_callers": "every call is the model's",
    "tools.output_schema": "a tool's output is shown to the model as the client sends it",
}


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None  # a system turn ahead of the input
    tools: list[FunctionToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns: not supported
    # exo's extension: false turns speculative decoding's drafts off for this request.
    speculation: bool | None = None
    # rejected when set (REJECTED_RESPONSES_FIELDS)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    moderation: Any = None
    top_logprobs: int | None = None
    # accepted and ignored (IGNORED_RESPONSES_FIELDS)
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, items: Any) -> Any:
        if isinstance(items, list):
            for index, item in enumerate(items):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
                kind = _item_type(item)
                if kind not in _SUPPORTED_ITEMS:
                    raise unsupported(
                        f"{kind!r} input items are not supported "
                        f"(supported: {', '.join(_SUPPORTED_ITEMS)})"
                    )
                # Parts are checked here: past the `str | list` union, pydantic
                # would report the string mismatch first.
                if not isinstance(item, dict):
                    continue
                if kind == "message":
                    allowed = ("input_text", "output_text", "refusal")
                    if item.get("role") == "user":  # pyright: ignore[reportUnknownMemberType]
                        allowed = (*allowed, "input_image")
                    content: Any = item.get("content")  # pyright: ignore[reportUnknownMemberType]
                    _only_parts(content, allowed)
                    for part, block in enumerate(content if isinstance(content, list) else ()):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
                        if isinstance(block, dict) and block.get("type") == "input_image":  # pyright: ignore[reportUnknownMemberType]
                            _check_image(block, f"item {index} part {part}")  # pyright: ignore[reportUnknownArgumentType]
                elif kind == "function_call_output":
                    _only_parts(item.get("output"), ("input_text",))  # pyright: ignore[reportUnknownMemberType]
        return items

    @field_validator("input")
    @classmethod
    def _not_empty(cls, items: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(items, list) and not items:
            raise unsupported("input must contain at least one item")
        return items

    @field_validator(*REJECTED_RESPONSES_FIELDS)
    @classmethod
    def _rejected(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise unsupported(REJECTED_RESPONSES_FIELDS[info.field_name or ""])
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for kind in declared_types(tools):
            if kind != "function":
                raise unsupported(
                    f"only function tools are supported, not {kind!r}: exo runs no tools itself"
                )
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        return reject_non_function_choice(choice)

    @field_validator("tools")
    @classmethod
    def _distinct_names(
        cls, tools: list[FunctionToolParam] | None
    ) -> list[FunctionToolParam] | None:
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
        if choice == "required" and not names:
            raise unsupported('tool_choice "required" needs tools')
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise choice_not_among_tools("function", choice.name, names)
        return choice


# Honoured; `truncation` only as "disabled". With the two lists above these
# name every field (a test checks it).
HONOURED_RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "reasoning",
        "stream",
        "truncation",
        "speculation",
    }
)
