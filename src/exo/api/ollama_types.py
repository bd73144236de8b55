"""Request bodies of the Ollama API: `POST /api/chat`, `/api/generate`,
`/api/show` and `/api/pull`.

No field is dropped silently: every field of Ollama's requests (the server's
and the official `ollama` client's) is declared here and is honoured,
rejected with a 400 naming it when set, or accepted and ignored
(`*_OLLAMA_FIELDS` below; the README lists them). A field no list names is
rejected as unknown (`extra="forbid"`), an unknown option too. Empty values
(`""`, `[]`) count as unset, as in Ollama, whose clients send them.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from exo.api.request_fields import (
    RequestBody,
    declared_types,
    image_from_base64,
    reject_repeated_names,
    unsupported,
)
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import (
    MAX_TOP_LOGPROBS,
    MinP,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopP,
)


def _base64_image(image: str) -> str:
    image_from_base64(image)  # a 400 naming the image, before any translation
    return image


# An image file (PNG, JPEG, ...) as base64, as Ollama takes them.
Base64Image = Annotated[str, AfterValidator(_base64_image)]
_LOADING = "a setting of how Ollama loads a model: exo places and loads models itself"
_NEVER_SHIFTS = (
    "exo never drops or shifts context: a prompt over the context is a 400, "
    "a reply that fills it ends with done_reason length"
)

# ---- options ----

# Sampling options exo cannot apply: rejected unless they hold the value that
# turns them off (which some clients send).
REJECTED_OPTIONS: dict[str, tuple[float, str]] = {
    "typical_p": (1.0, "typical sampling is not supported"),
    "tfs_z": (1.0, "tail-free sampling is not supported"),
    "mirostat": (0, "mirostat sampling is not supported"),
}
# Accepted and ignored, with why: the README's list.
IGNORED_OPTIONS: dict[str, str] = {
    "num_ctx": "exo gives every request the model's whole context length",
    "num_keep": _NEVER_SHIFTS,
    "num_batch": _LOADING,
    "num_gpu": _LOADING,
    "main_gpu": _LOADING,
    "num_thread": _LOADING,
    "use_mmap": _LOADING,
    "use_mlock": _LOADING,
    "numa": _LOADING,
    "low_vram": _LOADING,
    "f16_kv": _LOADING,
    "logits_all": _LOADING,
    "vocab_only": _LOADING,
    "embedding_only": _LOADING,
    "draft_num_predict": "exo's speculative decoding chooses its own draft lengths",
    "mirostat_tau": "mirostat sampling is not supported (mirostat must be 0)",
    "mirostat_eta": "mirostat sampling is not supported (mirostat must be 0)",
    "penalize_newline": "an option Ollama no longer applies",
}


class OllamaOptions(FrozenModel):
    """`options`: sampling and limits; omitted ones take the model's defaults
    (its `generation_config.json`), not Ollama's."""

    # num_predict <= 0 (-1 in Ollama's docs): up to the remaining context.
    num_predict: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=0)  # 0: all tokens
    min_p: MinP | None = None
    seed: int | None = None  # negative: a random seed
    stop: list[str] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    # Tokens the repetition penalty looks back over; 0: no repetition penalty,
    # -1: the whole prompt and reply.
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # rejected unless off (REJECTED_OPTIONS)
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    # accepted and ignored (IGNORED_OPTIONS)
    num_ctx: int | None = None
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    embedding_only: bool | None = None
    draft_num_predict: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None

    @field_validator(*REJECTED_OPTIONS)
    @classmethod
    def _off(cls, value: float | None, info: ValidationInfo) -> float | None:
        off, reason = REJECTED_OPTIONS[info.field_name or ""]
        if value is not None and value != off:
            raise unsupported(f"{reason}: leave it out or set it to {off:g}")
        return value


HONOURED_OPTIONS = frozenset(
    {
        "num_predict",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
    }
)

# ---- what chat and generate share ----

# `think`: true/false switch the template's thinking; a level is its reasoning effort.
ThinkLevel = Literal["low", "medium", "high", "max"]
# `format`: "json" (any JSON object) or a JSON schema; "" is no format.
FormatParam = Literal["", "json"] | dict[str, Any]

_IGNORED_COMMON_FIELDS: dict[str, str] = {
    "keep_alive": "exo keeps a model loaded until its instance is deleted "
    "(DELETE /instance/{id}); an empty request answers done_reason load",
    "truncate": _NEVER_SHIFTS,
    "shift": _NEVER_SHIFTS,
}


class GenerationFields(RequestBody):
    """The fields of `/api/chat` and `/api/generate` alike."""

    model: str = Field(min_length=1)
    stream: bool | None = None  # None: true, Ollama's default
    format: FormatParam | None = None
    options: OllamaOptions | None = None
    think: bool | ThinkLevel | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # accepted and ignored
    keep_alive: float | str | None = None
    truncate: bool | None = None
    shift: bool | None = None

    @field_validator("format", mode="before")
    @classmethod
    def _json_or_schema(cls, format_: Any) -> Any:
        # Named here: past the union, pydantic would report each of its members.
        if isinstance(format_, str) and format_ not in ("", "json"):
            raise unsupported(f'format is "json" or a JSON schema object, not {format_!r}')
        return format_

    @field_validator("top_logprobs")
    @classmethod
    def _need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise unsupported("top_logprobs needs logprobs: true")
        return top

    def streams(self) -> bool:
        return self.stream is not False


# ---- /api/chat ----


class ToolCallFunctionParam(FrozenModel):
    name: str
    arguments: dict[str, Any]
    index: int | None = None  # ignored


class ToolCallParam(FrozenModel):
    id: str | None = None  # None: no id (its result names the call by tool_name)
    function: ToolCallFunctionParam


class ChatMessage(FrozenModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None  # an assistant's reasoning, shown to the model again
    images: list[Base64Image] | None = None  # ahead of the content (user, tool)
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_name: str | None = None  # a tool result: the name of its call
    tool_call_id: str | None = None  # a tool result: the id of its call

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, role: Any) -> Any:
        return role.lower() if isinstance(role, str) else role  # as Ollama reads it

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> "ChatMessage":
        if self.role not in ("user", "tool") and self.images:
            raise unsupported(f"{self.role} messages have no images (user and tool messages do)")
        if self.role != "assistant" and (self.thinking or self.tool_calls):
            raise unsupported(f"a {self.role} message has no thinking or tool_calls")
        if self.role != "tool" and (self.tool_name or self.tool_call_id):
            raise unsupported(f"a {self.role} message has no tool_name or tool_call_id")
        return self


class FunctionParam(FrozenModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no parameters


class ToolParam(FrozenModel):
    type: Literal["function"] = "function"
    function: FunctionParam


# Accepted and ignored, with why: the README's list (dotted: a field of a part).
IGNORED_CHAT_FIELDS: dict[str, str] = {
    **_IGNORED_COMMON_FIELDS,
    "messages.tool_calls.function.index": "a call's place in the list says it",
}


class OllamaChatRequest(GenerationFields):
    """`POST /api/chat`. No messages: the model is checked, nothing generated."""

    messages: list[ChatMessage] = Field(default_factory=list[ChatMessage])
    tools: list[ToolParam] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for kind in declared_types(tools):
            if kind not in ("function", None):
                raise unsupported(f"only function tools are supported, not {kind!r}")
        return tools

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        reject_repeated_names(tool.function.name for tool in tools or [])
        return tools

    @model_validator(mode="after")
    def _format_without_tools(self) -> "OllamaChatRequest":
        if self.format not in (None, "") and self.tools:
            raise unsupported(
                "format and tools cannot be combined (the reply is either a tool call "
                "or the formatted answer): send one of them"
            )
        return self


HONOURED_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "stream",
        "format",
        "options",
        "think",
        "logprobs",
        "top_logprobs",
    }
)

# ---- /api/generate ----

REJECTED_GENERATE_FIELDS: dict[str, str] = {
    "suffix": "fill-in-the-middle (suffix) is not supported: put the text in the prompt",
    "template": "exo renders prompts with the model's own chat template; "
    "send raw: true with the prompt rendered yourself",
    "context": "a previous reply's context is not supported: send the conversation "
    "through /api/chat",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}
IGNORED_GENERATE_FIELDS: dict[str, str] = _IGNORED_COMMON_FIELDS


class OllamaGenerateRequest(GenerationFields):
    """`POST /api/generate`: one prompt, through the chat template (with
    `system`, and `images` ahead of the prompt) unless `raw`. An empty prompt
    without images: the model is checked, nothing generated."""

    prompt: str = ""
    images: list[Base64Image] | None = None  # ahead of the prompt
    system: str | None = None
    raw: bool | None = None
    # rejected when set (REJECTED_GENERATE_FIELDS)
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    @field_validator(*REJECTED_GENERATE_FIELDS)
    @classmethod
    def _rejected(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise unsupported(REJECTED_GENERATE_FIELDS[info.field_name or ""])
        return value

    @model_validator(mode="after")
    def _raw_is_as_is(self) -> "OllamaGenerateRequest":
        if self.raw and (self.system or self.think is not None or self.images):
            raise unsupported(
                "system, think and images need the chat template: a raw prompt is used as is"
            )
        return self


HONOURED_GENERATE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "images",
        "system",
        "raw",
        "stream",
        "format",
        "options",
        "think",
        "logprobs",
        "top_logprobs",
    }
)

# ---- /api/show, /api/pull ----


class ModelNamed(RequestBody):
    """A request naming a model as `model` or (Ollama's older name) `name`."""

    model: str = ""
    name: str = ""

    @model_validator(mode="after")
    def _named(self) -> "ModelNamed":
        if not (self.model or self.name):
            raise unsupported("model is required")
        return self

    def model_name(self) -> str:
        return self.model or self.name


IGNORED_SHOW_FIELDS: dict[str, str] = {"verbose": "exo lists no tensors"}


class ShowRequest(ModelNamed):
    """`POST /api/show`."""

    verbose: bool | None = None


_DEPRECATED = "deprecated in Ollama, which ignores it too"
IGNORED_PULL_FIELDS: dict[str, str] = {
    "insecure": _DEPRECATED,
    "username": _DEPRECATED,
    "password": _DEPRECATED,
}


class PullRequest(ModelNamed):
    """`POST /api/pull`: place the model on the cluster, whose nodes download it."""

    stream: bool | None = None  # None: true
    insecure: bool | None = None
    username: str | None = None
    password: str | None = None
