"""The Ollama API's `/api/chat` and `/api/generate` as a translation layer: a
request into the internal `ChatRequest`, one reply's events out as Ollama's
NDJSON chunks or one object.

Requests:
- A model named `name:latest` is `name` (exo's model ids have no tags).
- Chat messages become turns as they are; an assistant's `thinking` is its
  reasoning, its calls' arguments (objects) are written back as JSON text; a
  tool result carries its `tool_name` (or the name of the call its
  `tool_call_id` names).
- Generate renders `system` and `prompt` through the chat template; `raw`
  uses the prompt as is.
- `images` (base64 files) of a user or tool message, or of a generate, come
  ahead of its text (offset 0), as Ollama places them.
- `options` are the sampling and the limits (`num_predict` <= 0: up to the
  remaining context); `format` is `json` (any JSON object) or a JSON schema,
  enforced by constrained decoding; `think` switches the template's
  `enable_thinking`, a level (`low`, `medium`, `high`, `max`) also sets its
  `reasoning_effort`.

Replies: text streams as `message.content` (`response` for generate),
reasoning as `thinking`, a tool call as one `message.tool_calls` entry when it
is complete and checked (its `arguments` an object). The last chunk has
`done: true`, `done_reason` (`stop`, or `length` when the limit or the
context ran out) and the stats in nanoseconds: `load_duration` from the
request's arrival until its prompt was rendered with a slot of the model
(exo's models are loaded already: this is the queue), `prompt_eval_duration`
until the first token, `eval_duration` the rest; `prompt_eval_count` is the
prompt's tokens, `eval_count` the reply's. While nothing comes (a long
prefill) a stream sends empty chunks, so proxies and relays keep waiting.
"""

import json
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from exo.api.errors import APIError, ollama_error_body
from exo.api.ollama_types import (
    ChatMessage,
    FormatParam,
    GenerationFields,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    ThinkLevel,
    ToolParam,
)
from exo.api.reply_stream import (
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    TokenLogprob,
    TokenLogprobs,
)
from exo.api.request_fields import image_from_base64
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece, ToolCallEnd
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
    JsonSchemaFormat,
    ReasoningEffort,
    ResponseFormat,
    Sampling,
    TextFormat,
    TextPrompt,
    ToolCall,
    ToolFunction,
)

# The tag Ollama assumes when a name has none.
LATEST_TAG = ":latest"
# `repeat_last_n: -1` (all of the context): a window no prompt and reply outgrow.
WHOLE_CONTEXT = 2**31 - 1

# What a reply is: chat's message, or generate's response text.
Shape = Literal["chat", "generate"]


def model_name(name: str) -> str:
    """The exo model an Ollama name asks for."""
    return name.removesuffix(LATEST_TAG)


def rfc3339(seconds: float) -> str:
    """A time as Ollama writes it (UTC, `Z`)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def ndjson(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


# ---- request -> ChatRequest ----


def _images(images: Sequence[str] | None) -> tuple[ChatImage, ...]:
    """A message's images (base64, checked), all ahead of its text (offset 0)."""
    return tuple(image_from_base64(image) for image in images or ())


def to_turns(messages: Sequence[ChatMessage]) -> tuple[ChatTurn, ...]:
    """The conversation as the chat template sees it."""
    call_names: dict[str, str] = {}
    turns: list[ChatTurn] = []
    for message in messages:
        content = message.content or ""
        match message.role:
            case "assistant":
                calls = tuple(
                    ToolCall(
                        id=call.id or "",
                        name=call.function.name,
                        arguments=json.dumps(call.function.arguments, ensure_ascii=False),
                    )
                    for call in message.tool_calls or ()
                )
                call_names.update((call.id, call.name) for call in calls if call.id)
                turns.append(
                    ChatTurn(
                        role="assistant",
                        content=content,
                        tool_calls=calls,
                        reasoning=message.thinking or None,
                    )
                )
            case "tool":
                call_id = message.tool_call_id or None
                name = message.tool_name or call_names.get(call_id or "")
                turns.append(
                    ChatTurn(
                        role="tool",
                        content=content,
                        images=_images(message.images),
                        tool_call_id=call_id,
                        name=name,
                    )
                )
            case role:
                turns.append(ChatTurn(role=role, content=content, images=_images(message.images)))
    return tuple(turns)


def _tool(tool: ToolParam) -> ToolFunction:
    function = tool.function
    fields: dict[str, Any] = {"name": function.name, "description": function.description or ""}
    if function.parameters is not None:  # none: no parameters, ToolFunction's default
        fields["parameters"] = function.parameters
    return ToolFunction(**fields)


def _response_format(format_: FormatParam | None) -> ResponseFormat:
    match format_:
        case "json":
            return JsonObjectFormat()
        case dict():
            return JsonSchemaFormat(json_schema=format_)
        case _:
            return TextFormat()


def _thinking(think: bool | ThinkLevel | None) -> tuple[dict[str, Any], ReasoningEffort | None]:
    """The template's variables and reasoning effort `think` asks for."""
    match think:
        case None:
            return {}, None
        case bool():
            return {"enable_thinking": think}, None
        case level:
            return {"enable_thinking": True}, level


def _sampling(options: OllamaOptions) -> Sampling:
    window = options.repeat_last_n
    return Sampling(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        # repeat_last_n 0 turns the repetition penalty off
        repetition_penalty=1.0 if window == 0 else options.repeat_penalty,
        repetition_context_size=WHOLE_CONTEXT if window == -1 else window or None,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        seed=None if options.seed is None or options.seed < 0 else options.seed,
    )


def _generation_fields(body: GenerationFields) -> dict[str, Any]:
    """The ChatRequest fields that chat and generate share."""
    options = body.options or OllamaOptions()
    template_kwargs, effort = _thinking(body.think)
    limit = options.num_predict
    return {
        "model": body.model,
        "response_format": _response_format(body.format),
        "max_tokens": limit if limit is not None and limit > 0 else None,
        "stop": tuple(stop for stop in options.stop or () if stop),
        "sampling": _sampling(options),
        "logprobs": bool(body.logprobs),
        "top_logprobs": body.top_logprobs or 0,
        "template_kwargs": template_kwargs,
        "reasoning_effort": effort,
        "stream": body.streams(),
    }


def chat_request(body: OllamaChatRequest) -> ChatRequest:
    """A chat with at least one message as the internal request."""
    return ChatRequest(
        **_generation_fields(body),
        turns=to_turns(body.messages),
        tools=tuple(_tool(tool) for tool in body.tools or ()),
    )


def generate_request(body: OllamaGenerateRequest) -> ChatRequest:
    """A generate with a prompt as the internal request."""
    if body.raw:
        return ChatRequest(**_generation_fields(body), prompt=TextPrompt(text=body.prompt))
    system = (ChatTurn(role="system", content=body.system),) if body.system else ()
    user = ChatTurn(role="user", content=body.prompt, images=_images(body.images))
    return ChatRequest(**_generation_fields(body), turns=(*system, user))


# ---- reply events -> chunks ----


def _body(
    model: str,
    shape: Shape,
    content: str = "",
    thinking: str = "",
    calls: Sequence[dict[str, Any]] = (),
    logprobs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A chunk (or the whole reply) that is not done."""
    body: dict[str, Any] = {"model": model, "created_at": rfc3339(time.time())}
    if shape == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = list(calls)
        body["message"] = message
    else:
        body["response"] = content
        if thinking:
            body["thinking"] = thinking
    if logprobs:
        body["logprobs"] = list(logprobs)
    return body | {"done": False}


def loaded(model: str, shape: Shape) -> dict[str, Any]:
    """The answer to a request without messages (or prompt): Ollama loads the
    model then; exo's is loaded already."""
    return _body(model, shape) | {"done": True, "done_reason": "load"}


def _tool_call(call: ToolCall, index: int) -> dict[str, Any]:
    arguments = json.loads(call.arguments)  # a JSON object: the parser checked it
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def _logprob(token: TokenLogprob) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "token": token.token,
        "logprob": token.logprob,
        "bytes": list(token.bytes),
    }
    if token.top_logprobs:
        entry["top_logprobs"] = [
            {"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
            for top in token.top_logprobs
        ]
    return entry


class ReplyAssembler:
    """Reply events in; Ollama's chunks and, at the end, the whole reply out.
    Made when the reply is prepared (`started_ns`: when its request came, on
    `time.monotonic_ns`), for the stats."""

    def __init__(self, reply: PreparedReply, shape: Shape, started_ns: int) -> None:
        self.reply = reply
        self._shape: Shape = shape
        self._started = started_ns
        self._prepared = time.monotonic_ns()
        self._first: int | None = None  # when the first token came
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._logprobs: list[dict[str, Any]] = []
        self._done: dict[str, Any] | None = None

    def _chunk(
        self,
        content: str = "",
        thinking: str = "",
        calls: Sequence[dict[str, Any]] = (),
        logprobs: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        return _body(self.reply.model, self._shape, content, thinking, calls, logprobs)

    def _stats(self, finished: ReplyFinished) -> dict[str, Any]:
        ended = time.monotonic_ns()
        first = ended if self._first is None else self._first
        return {
            "done": True,
            "done_reason": "length" if finished.finish_reason == "length" else "stop",
            "total_duration": ended - self._started,
            "load_duration": self._prepared - self._started,
            "prompt_eval_count": finished.usage.prompt_tokens,
            "prompt_eval_duration": first - self._prepared,
            "eval_count": finished.usage.completion_tokens,
            "eval_duration": ended - first,
        }

    def feed(self, event: ReplyEvent) -> list[dict[str, Any]]:
        """The chunks for `event` (and the reply's record for `whole`)."""
        if self._first is None and not isinstance(event, KeepAlive | ReplyFinished):
            self._first = time.monotonic_ns()
        match event:
            case TextPiece(text=text) if text:
                self._text.append(text)
                return [self._chunk(content=text)]
            case ReasoningPiece(text=text) if text:
                self._thinking.append(text)
                return [self._chunk(thinking=text)]
            case ToolCallEnd(call=call):
                entry = _tool_call(call, len(self._calls))
                self._calls.append(entry)
                return [self._chunk(calls=[entry])]
            case TokenLogprobs(tokens=tokens):
                entries = [_logprob(token) for token in tokens]
                self._logprobs += entries
                return [self._chunk(logprobs=entries)]
            case KeepAlive():
                return [self._chunk()]
            case ReplyFinished():
                self._done = self._stats(event)
                return [self._chunk() | self._done]
            case _:
                # Call starts and argument pieces: the call goes out whole at its
                # end (an abandoned one comes back as text).
                return []

    def whole(self) -> dict[str, Any]:
        """The whole reply, once it finished."""
        if self._done is None:
            raise APIError(
                500, "the reply ended without finishing", "server_error", "generation_failed"
            )
        whole = self._chunk(
            content="".join(self._text),
            thinking="".join(self._thinking),
            calls=self._calls,
            logprobs=self._logprobs,
        )
        return whole | self._done


async def reply_object(assembler: ReplyAssembler) -> dict[str, Any]:
    """The non-streaming answer. Errors raise `APIError`."""
    async for event in assembler.reply.events:
        assembler.feed(event)
    return assembler.whole()


async def reply_lines(assembler: ReplyAssembler) -> AsyncIterator[str]:
    """The streaming answer as NDJSON; an error during the run ends it with an
    `{"error": ...}` line (the HTTP status was sent already)."""
    try:
        async for event in assembler.reply.events:
            for chunk in assembler.feed(event):
                yield ndjson(chunk)
    except APIError as error:
        yield ndjson(ollama_error_body(error.message))
