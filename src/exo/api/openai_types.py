"""Request and response bodies of the OpenAI chat completions and legacy
completions APIs.

No field is dropped silently: every field of OpenAI's requests is declared
here and is either honoured, rejected with a 400 naming it when set, or listed
as accepted and ignored (`*_FIELDS` below; the README lists them). A field no
list names is rejected as unknown (`extra="forbid"`). The ignored fields of a
request's parts are in the same list (`IGNORED_CHAT_FIELDS`), marked `# ignored`
where they are declared.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from exo.api.reply_stream import TokenLogprob
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
from exo.shared.types.chat import RESERVED_TEMPLATE_KWARGS, ChatImage, ReasoningEffort
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import (
    LOGIT_BIAS_LIMIT,
    MAX_TOP_LOGPROBS,
    MinP,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopP,
)

MAX_STOP_SEQUENCES = 4


def _only_text_parts(content: Any, allowed: tuple[str, ...]) -> Any:
    # Names the part type a client sent, rather than a union mismatch.
    for kind in declared_types(content):
        if isinstance(kind, str) and kind not in allowed:
            if kind == "image_url":
                raise unsupported("'image_url' content parts are accepted in user messages only")
            raise unsupported(
                f"{kind!r} content parts are not supported: exo reads text and images "
                "(image_url, in user messages)"
            )
    return content


# ---- chat completions request ----


class TextPart(FrozenModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # ignored
    cache_control: dict[str, Any] | None = None  # ignored


class RefusalPart(FrozenModel):
    type: Literal["refusal"]
    refusal: str


class ImageURL(FrozenModel):
    # A base64 data URL, or an http(s) URL the node fetches; checked on the raw
    # message (`UserMessageParam`), named by its part.
    url: str
    detail: str | None = None  # ignored


class ImagePart(FrozenModel):
    type: Literal["image_url"]
    image_url: ImageURL


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def parts_text(content: str | list[TextPart] | list[TextPart | RefusalPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in content)


def user_content(content: str | list[UserPart]) -> tuple[str, tuple[ChatImage, ...]]:
    """A user message's text parts joined (as `parts_text`), and its images, each
    at the length of the text before it."""
    if isinstance(content, str):
        return content, ()
    return text_with_images(
        image_from_url(part.image_url.url) if isinstance(part, ImagePart) else part.text
        for part in content
    )


class SystemMessageParam(FrozenModel):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None  # ignored

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _only_text_parts(content, ("text",))


class UserMessageParam(FrozenModel):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None  # ignored

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        _only_text_parts(content, ("text", "image_url"))
        for index, part in enumerate(content if isinstance(content, list) else ()):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            if isinstance(part, dict) and part.get("type") == "image_url":  # pyright: ignore[reportUnknownMemberType]
                image = part.get("image_url")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
                if not isinstance(image, dict):
                    raise unsupported(
                        f'part {index}: image_url is an object: {{"url": a data or http(s) URL}}'
                    )
                url = image.get("url") if isinstance(image, dict) else None  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
                check_raw_image(url, f"part {index} (image_url.url)")
        return content


class FunctionCallParam(FrozenModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(FrozenModel):
    id: str
    type: Literal["function"]
    function: FunctionCallParam


_REJECTED_MESSAGE_FIELDS = {
    "audio": "audio in history is not supported",
    "function_call": "the deprecated function_call is not supported: send tool_calls",
}


class AssistantMessageParam(FrozenModel):
    role: Literal["assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    refusal: str | None = None
    name: str | None = None  # ignored
    tool_calls: list[ToolCallParam] | None = None
    # The reasoning (thinking) text a reasoning-capable client sends back
    # (`reasoning`: the newer name some servers and clients use).
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: Any = None
    function_call: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _only_text_parts(content, ("text", "refusal"))

    @field_validator(*_REJECTED_MESSAGE_FIELDS)
    @classmethod
    def _rejected(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise unsupported(_REJECTED_MESSAGE_FIELDS[info.field_name or ""])
        return value

    def text(self) -> str:
        # A refusal in history is what the assistant said.
        return parts_text(self.content) or (self.refusal or "")

    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class ToolMessageParam(FrozenModel):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str
    name: str | None = None  # the function's name, as older clients send it

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _only_text_parts(content, ("text",))


ChatMessage = Annotated[
    SystemMessageParam | UserMessageParam | AssistantMessageParam | ToolMessageParam,
    Field(discriminator="role"),
]


class FunctionDefinition(FrozenModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema; none: no parameters
    strict: bool | None = None


class ToolParam(FrozenModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(FrozenModel):
    name: str


class NamedToolChoiceParam(FrozenModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceParam = Literal["none", "auto", "required"] | NamedToolChoiceParam


class TextResponseFormat(FrozenModel):
    type: Literal["text"]


class JsonObjectResponseFormat(FrozenModel):
    type: Literal["json_object"]


class JsonSchemaSpec(FrozenModel):
    name: str = Field(min_length=1, max_length=64)  # ignored
    description: str | None = None  # ignored
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any JSON
    strict: bool | None = None


class JsonSchemaResponseFormat(FrozenModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatParam = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


class StreamOptions(FrozenModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored


class CommonRequestFields(RequestBody):
    """What chat and legacy completions requests share: limits, sampling, streaming."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # Extensions as in llama.cpp and vLLM; top_k -1 or 0: all tokens.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None  # ignored
    # exo's extension: false turns speculative decoding's drafts off for this request.
    speculation: bool | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise unsupported("exo generates one choice per request: n must be 1")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise unsupported(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, biases: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (biases or {}).items():
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
            if not (token.isascii() and token.isdigit()):
                raise unsupported(f"logit_bias keys are token ids; {token!r} is not one")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise unsupported(
                    f"logit_bias values lie in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]; "
                    f"token {token} has {bias:g}"
                )
        return biases

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class PredictionTextPart(FrozenModel):
    type: Literal["text"]
    text: str


class PredictionParam(FrozenModel):
    """OpenAI's predicted output: text the reply is expected to repeat, which
    speculative decoding drafts from."""

    type: Literal["content"]
    content: str | list[PredictionTextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any) -> Any:
        return _only_text_parts(content, ("text",))

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


REJECTED_CHAT_FIELDS: dict[str, str] = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "functions": "the deprecated functions is not supported: send tools",
    "function_call": "the deprecated function_call is not supported: send tool_choice",
}
# Accepted and ignored, with why: the README's list. A top-level name is a
# field of the request; a dotted path, a field of a part of it (lists and
# unions looked through). A test checks that each path names a declared field.
IGNORED_CHAT_FIELDS: dict[str, str] = {
    "user": NO_END_USERS,
    "safety_identifier": NO_END_USERS,
    "metadata": "tags of stored completions: exo stores none",
    "store": "exo stores no completions",
    "service_tier": "exo serves every request alike",
    "prompt_cache_key": CACHE_BY_TOKENS,
    "prompt_cache_options": CACHE_BY_TOKENS,
    "prompt_cache_retention": "cache entries live until evicted (LRU, memory pressure)",
    "verbosity": "a setting of OpenAI's models that chat templates do not have",
    "stream_options.include_obfuscation": "exo sends no obfuscation padding",
    "messages.name": "participant names are not shown to the model "
    "(a tool message's name stands in for its call's when the call is not in the history)",
    "messages.content.prompt_cache_breakpoint": CACHE_BY_TOKENS,
    "messages.content.cache_control": "Anthropic's cache breakpoints, sent by some clients: "
    + CACHE_BY_TOKENS,
    "messages.content.image_url.detail": "the model's image processor chooses the resolution "
    "(detail sets OpenAI's)",
    "response_format.json_schema.name": SCHEMA_NOT_SHOWN,
    "response_format.json_schema.description": SCHEMA_NOT_SHOWN,
}


class ChatCompletionRequest(CommonRequestFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatParam | None = None
    modalities: list[str] | None = None
    # Extra variables of the model's chat template (vLLM's name), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    prediction: PredictionParam | None = None
    # vLLM's extension: the last message, an assistant one, is continued (its
    # text is the start of the reply) rather than answered by a new message.
    continue_final_message: bool | None = None
    # rejected when set (REJECTED_CHAT_FIELDS)
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    # accepted and ignored (IGNORED_CHAT_FIELDS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise unsupported("messages must contain at least one message")
        return messages

    @field_validator(*REJECTED_CHAT_FIELDS)
    @classmethod
    def _rejected(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise unsupported(REJECTED_CHAT_FIELDS[info.field_name or ""])
        return value

    @field_validator("prediction", mode="before")
    @classmethod
    def _content_prediction(cls, prediction: Any) -> Any:
        if isinstance(prediction, dict) and prediction.get("type") != "content":  # pyright: ignore[reportUnknownMemberType]
            raise unsupported(
                f"prediction type {prediction.get('type')!r} is not supported: "  # pyright: ignore[reportUnknownMemberType]
                'send {"type": "content", "content": the predicted text}'
            )
        return prediction

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities is not None and set(modalities) != {"text"}:
            raise unsupported('exo generates text only: modalities must be ["text"]')
        return modalities

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for kind in declared_types(tools):
            if kind != "function":
                raise unsupported(f"only function tools are supported, not {kind!r}")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        return reject_non_function_choice(choice)

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        reject_repeated_names(tool.function.name for tool in tools or [])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, choice: ToolChoiceParam | None, info: ValidationInfo
    ) -> ToolChoiceParam | None:
        if "tools" not in info.data:
            return choice  # the tools were invalid; that error is reported
        names = {tool.function.name for tool in info.data["tools"] or []}
        if choice == "required" and not names:
            raise unsupported('tool_choice "required" needs tools')
        if isinstance(choice, NamedToolChoiceParam) and choice.function.name not in names:
            raise choice_not_among_tools("function", choice.function.name, names)
        return choice

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {})):
            raise unsupported(f"exo sets {', '.join(reserved)} itself; leave it out")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise unsupported("top_logprobs needs logprobs: true")
        return top

    @field_validator("continue_final_message")
    @classmethod
    def _assistant_last(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        messages = info.data.get("messages")
        if not value or not messages:
            return value  # (invalid messages: that error is reported)
        last = messages[-1]
        if not isinstance(last, AssistantMessageParam) or last.tool_calls:
            raise unsupported(
                "continue_final_message needs an assistant message without tool calls last"
            )
        return value


# Honoured; `n` only as 1 and `modalities` only as ["text"]. With the two
# lists above these name every field (a test checks it).
HONOURED_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "seed",
        "stop",
        "n",
        "modalities",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template_kwargs",
        "reasoning_effort",
        "prediction",
        "speculation",
        "continue_final_message",
    }
)


# ---- chat completions response ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # of completion_tokens, those the model spent thinking
    # Of the prediction's tokens, those the reply took from it and the rest.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # exo's: speculative decoding's draft tokens checked, and of them those accepted.
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithoutNone(BaseModel):
    """Leaves out the fields that are None, as OpenAI does for optional parts."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None

    @model_serializer(mode="wrap")
    def _extras_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in ("reasoning_content", "tool_calls")
        }


class ChoiceLogprobs(BaseModel):
    # Each token's UTF-8 `bytes` are listed: a token may hold part of a character.
    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: ChatFinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: CompletionUsage


class FunctionCallDelta(_WithoutNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_WithoutNone):
    """A piece of a streamed tool call: the first carries id, type and name, the
    next ones pieces of the arguments, all with the call's index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class Delta(_WithoutNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: ChatFinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


# ---- legacy completions ----


class CompletionRequest(CommonRequestFields):
    """`POST /v1/completions`: one prompt, as text or token ids, no chat template."""

    # text or token ids; a list of one of these is unwrapped (`_one_prompt`)
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:  # pyright: ignore[reportUnknownArgumentType]
                raise unsupported("exo completes one prompt per request: send a single prompt")
            return prompt[0]  # pyright: ignore[reportUnknownVariableType]
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise unsupported("prompt is empty")
        if isinstance(prompt, list) and any(token < 0 for token in prompt):
            raise unsupported("prompt token ids must be >= 0")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise unsupported("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix (insertion) is not supported: put the text in the prompt")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise unsupported("exo generates one candidate per request: best_of must be 1")
        return best_of


# Honoured (`speculation` too): all but these; `n`/`best_of` only as 1, `echo` only
# false, `suffix` only empty.
IGNORED_COMPLETION_FIELDS: dict[str, str] = {"user": NO_END_USERS}


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A legacy completion, whole or (with `finish_reason` None until the end) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


# ---- models, errors ----


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exo"
    status: str
    context_length: int | None  # None: served by another node
    # Whether it reads images (`models/vision.py`); None: served by another node.
    images: bool | None = None
    # With the node's `--draft-model`: the model drafting for it, or why none does.
    draft_model: str | None = None
    draft_model_refused: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def error_body(
    message: str, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}
