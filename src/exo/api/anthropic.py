"""The Anthropic Messages API as a translation layer: a request into the
internal `ChatRequest`, one reply's events out as a message or its event stream.

Requests:
- The system prompt's text blocks join as lines. A `system` message inside
  `messages` before the first assistant message (Claude Code sends its
  environment so, after the first user message) joins the system prompt as a
  paragraph: many chat templates accept a system prompt only first, and that
  part of a conversation never changes. A later one stays a system turn where
  it stands, so the turns before it (and their cache) are untouched. One with
  `clear_at: "next_user_message"` is left out once a later user message exists.
- A user message's `tool_result` blocks become tool turns and its text blocks a
  user turn, in the order sent; `image` blocks go on the turn of the text
  around them (a tool result's images on its tool turn). Assistant text blocks
  join as the model wrote them; `tool_use` blocks become calls with their ids
  kept as sent (templates that render ids put them in the prompt, so the
  prefix cache depends on them).
- `thinking` switches the template's `enable_thinking` (enabled/disabled;
  adaptive leaves the model's default), `output_config.effort` is its
  `reasoning_effort`; templates without such variables ignore them.

Replies: reasoning streams as `thinking` blocks, text as `text` blocks, and a
tool call as one `tool_use` block when it is complete and checked (a call the
model wrote malformed comes as text, never as a broken `tool_use`). A thinking
block's signature carries its reasoning, so a client that passes it back (as
Anthropic asks) gets the reasoning re-rendered exactly, even with
`display: "omitted"`, where the block's text is left empty.

Usage: `cache_read_input_tokens` are the prompt tokens found in the prefix
cache and `cache_creation_input_tokens` the ones prefilled now (then cached),
so `input_tokens` (neither) is 0 once generation ran; the three sum to the
prompt's length, as Anthropic defines them.
"""

import base64
import binascii
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from exo.api.anthropic_types import (
    AnyToolChoice,
    AssistantMessageParam,
    AutoToolChoice,
    Base64ImageSource,
    CountTokensRequest,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    MessagesRequestBase,
    NamedToolChoiceParam,
    NoToolChoice,
    RedactedThinkingBlockParam,
    SystemMessageParam,
    TextBlockParam,
    ThinkingAdaptive,
    ThinkingBlockParam,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    URLImageSource,
    UserMessageParam,
)
from exo.api.errors import APIError, anthropic_error_body
from exo.api.reply_stream import (
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    ReplyFinishReason,
    sse_event,
)
from exo.api.request_fields import image_from_base64, image_from_url
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece, ToolCallEnd
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Sampling,
    TextFormat,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.tasks import Usage

# ---- request -> ChatRequest ----


def _text(content: str | Sequence[TextBlockParam], separator: str) -> str:
    if isinstance(content, str):
        return content
    return separator.join(block.text for block in content)


_SIGNATURE_PREFIX = "exo-reasoning:"


def reasoning_signature(reasoning: str) -> str:
    """The signature of a thinking block exo wrote: its reasoning, opaque to the client."""
    return _SIGNATURE_PREFIX + base64.b64encode(reasoning.encode()).decode("ascii")


def _signed_reasoning(signature: str) -> str | None:
    """The reasoning in a signature exo wrote; None for another server's."""
    if not signature.startswith(_SIGNATURE_PREFIX):
        return None
    try:
        return base64.b64decode(signature[len(_SIGNATURE_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _assistant_turn(message: AssistantMessageParam) -> ChatTurn:
    if isinstance(message.content, str):
        return ChatTurn(role="assistant", content=message.content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for block in message.content:
        match block:
            case TextBlockParam():
                texts.append(block.text)
            case ThinkingBlockParam():
                signed = _signed_reasoning(block.signature)
                reasoning.append(signed if signed is not None else block.thinking)
            case RedactedThinkingBlockParam():
                pass  # another server's encrypted reasoning: nothing the model can read
            case ToolUseBlockParam():
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
    return ChatTurn(
        role="assistant",
        content="".join(texts),
        tool_calls=tuple(calls),
        reasoning="".join(reasoning) if reasoning else None,
    )


def _image(block: ImageBlockParam) -> ChatImage:
    match block.source:
        case Base64ImageSource(data=data):
            return image_from_base64(data)
        case URLImageSource(url=url):
            return image_from_url(url)


def _text_and_images(
    blocks: Sequence[TextBlockParam | ImageBlockParam],
) -> tuple[str, tuple[ChatImage, ...]]:
    """Text blocks joined as lines, and the images among them, each at the
    length of the text before it (ahead of the line break the next text adds)."""
    texts: list[str] = []
    length = 0
    images: list[ChatImage] = []
    for block in blocks:
        if isinstance(block, ImageBlockParam):
            images.append(_image(block).model_copy(update={"offset": length}))
            continue
        length += len(block.text) + (1 if texts else 0)
        texts.append(block.text)
    return "\n".join(texts), tuple(images)


def _user_turns(message: UserMessageParam, call_names: dict[str, str]) -> list[ChatTurn]:
    if isinstance(message.content, str):
        return [ChatTurn(role="user", content=message.content)]
    turns: list[ChatTurn] = []
    pending: list[TextBlockParam | ImageBlockParam] = []
    for block in message.content:
        if not isinstance(block, ToolResultBlockParam):
            pending.append(block)
            continue
        if pending:
            text, images = _text_and_images(pending)
            turns.append(ChatTurn(role="user", content=text, images=images))
            pending = []
        turns.append(_tool_turn(block, call_names))
    if pending:
        text, images = _text_and_images(pending)
        turns.append(ChatTurn(role="user", content=text, images=images))
    return turns


def _tool_turn(block: ToolResultBlockParam, call_names: dict[str, str]) -> ChatTurn:
    """A tool result, with the images among its content (a screenshot) on the tool turn."""
    content = block.content or ""
    text, images = (content, ()) if isinstance(content, str) else _text_and_images(content)
    return ChatTurn(
        role="tool",
        content=text,
        images=images,
        tool_call_id=block.tool_use_id,
        name=call_names.get(block.tool_use_id),
    )


def to_turns(
    system: str | Sequence[TextBlockParam] | None, messages: Sequence[MessageParam]
) -> tuple[ChatTurn, ...]:
    """The conversation as the chat template sees it (see the module docstring)."""
    system_parts = [_text(system, "\n")] if system else []  # "" or []: no system prompt
    turns: list[ChatTurn] = []
    call_names: dict[str, str] = {}
    answered = False  # an assistant message came
    last_user = max(
        (i for i, m in enumerate(messages) if isinstance(m, UserMessageParam)), default=-1
    )
    for index, message in enumerate(messages):
        match message:
            case SystemMessageParam(clear_at="next_user_message") if index < last_user:
                pass  # shown only for the user turn it follows, which is past
            case SystemMessageParam():
                text = _text(message.content, "\n")
                if answered:
                    turns.append(ChatTurn(role="system", content=text))
                else:
                    system_parts.append(text)
            case UserMessageParam():
                turns.extend(_user_turns(message, call_names))
            case AssistantMessageParam():
                answered = True
                turn = _assistant_turn(message)
                call_names.update((call.id, call.name) for call in turn.tool_calls)
                turns.append(turn)
    if system_parts:
        turns.insert(0, ChatTurn(role="system", content="\n\n".join(system_parts)))
    return tuple(turns)


def _tool(tool: ToolParam) -> ToolFunction:
    return ToolFunction(
        name=tool.name,
        description=tool.description or "",
        parameters=tool.input_schema,
        strict=bool(tool.strict),
    )


def _tool_choice(body: MessagesRequestBase) -> tuple[ToolChoice, bool]:
    """The internal tool choice and whether parallel calls are allowed."""
    match body.tool_choice:
        case None:
            return "auto", True
        case NoToolChoice():
            return "none", True
        case AnyToolChoice(disable_parallel_tool_use=single):
            return "required", not single
        case NamedToolChoiceParam(name=name, disable_parallel_tool_use=single):
            return NamedToolChoice(name=name), not single
        case AutoToolChoice(disable_parallel_tool_use=single):
            return "auto", not single


def _response_format(body: MessagesRequestBase) -> ResponseFormat:
    if body.output_config is None or body.output_config.format is None:
        return TextFormat()
    return JsonSchemaFormat(json_schema=body.output_config.format.schema_)


def _template_kwargs(body: MessagesRequestBase) -> dict[str, Any]:
    match body.thinking:
        case ThinkingEnabled():
            return {"enable_thinking": True}
        case ThinkingDisabled():
            return {"enable_thinking": False}
        case ThinkingAdaptive() | None:
            return {}


def _prompt_fields(body: MessagesRequestBase) -> dict[str, Any]:
    """The ChatRequest fields that a message and a token count share."""
    tool_choice, parallel = _tool_choice(body)
    return {
        "model": ModelId(body.model),
        "turns": to_turns(body.system, body.messages),
        "tools": tuple(_tool(tool) for tool in body.tools or ()),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "response_format": _response_format(body),
        "template_kwargs": _template_kwargs(body),
        "reasoning_effort": body.output_config.effort if body.output_config else None,
    }


def to_chat_request(body: MessagesRequest) -> ChatRequest:
    """A valid Messages request as the internal request. `max_tokens` is carried
    as sent: the generation service clamps it to what the context leaves."""
    return ChatRequest(
        **_prompt_fields(body),
        max_tokens=body.max_tokens,
        stop=tuple(stop for stop in body.stop_sequences or () if stop),
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        stream=bool(body.stream),
        speculation=body.speculation is not False,
    )


def count_tokens_to_chat_request(body: CountTokensRequest) -> ChatRequest:
    """The prompt a message with these fields would have: its length is the count."""
    return ChatRequest(**_prompt_fields(body))


def shows_thinking(body: MessagesRequestBase) -> bool:
    """Whether the reply's thinking blocks carry their text (not `display: "omitted"`)."""
    match body.thinking:
        case ThinkingEnabled(display=display) | ThinkingAdaptive(display=display):
            return display != "omitted"
        case _:
            return True


# ---- reply events -> message / stream events ----

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

_STOP_REASONS: dict[ReplyFinishReason, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "stop_sequence": "stop_sequence",
    "tool_calls": "tool_use",
}


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": 0,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class MessageAssembler:
    """Reply events in; Anthropic stream events (as JSON objects) and, at the
    end, the whole message out. One content block is open at a time."""

    def __init__(
        self, message_id: str, model: str, prompt_tokens: int, show_thinking: bool
    ) -> None:
        self._id = message_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._show_thinking = show_thinking
        self._blocks: list[dict[str, Any]] = []
        self._open: Literal["text", "thinking"] | None = None
        self._finished: ReplyFinished | None = None

    def _message(self, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        finished = self._finished
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": _STOP_REASONS[finished.finish_reason] if finished else None,
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage,
        }

    def start(self) -> list[dict[str, Any]]:
        # The cached share is known only at the end; message_delta corrects it.
        usage = {
            "input_tokens": self._prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        return [{"type": "message_start", "message": self._message([], usage)}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index = len(self._blocks) - 1
        events: list[dict[str, Any]] = []
        if self._open == "thinking":
            block = self._blocks[index]
            block["signature"] = reasoning_signature(block.pop("reasoning"))
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        self._open = None
        return [*events, {"type": "content_block_stop", "index": index}]

    def _open_block(self, block: dict[str, Any], shown: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._blocks.append(block)
        start = {"type": "content_block_start", "index": len(self._blocks) - 1}
        return [*events, start | {"content_block": shown}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}

    def feed(self, event: ReplyEvent) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        match event:
            case ReasoningPiece(text=text) if text:
                if self._open != "thinking":
                    block = {"type": "thinking", "thinking": "", "signature": "", "reasoning": ""}
                    shown = {"type": "thinking", "thinking": "", "signature": ""}
                    events += self._open_block(block, shown)
                    self._open = "thinking"
                self._blocks[-1]["reasoning"] += text
                if self._show_thinking:
                    self._blocks[-1]["thinking"] += text
                    events.append(self._delta({"type": "thinking_delta", "thinking": text}))
            case TextPiece(text=text) if text:
                if self._open != "text":
                    events += self._open_block(
                        {"type": "text", "text": ""}, {"type": "text", "text": ""}
                    )
                    self._open = "text"
                self._blocks[-1]["text"] += text
                events.append(self._delta({"type": "text_delta", "text": text}))
            case ToolCallEnd(call=call):
                block = {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": json.loads(call.arguments),
                }
                events += self._open_block(block, block | {"input": {}})
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                )
                events.append({"type": "content_block_stop", "index": len(self._blocks) - 1})
            case ReplyFinished():
                events += self._close()
                self._finished = event
                delta = {
                    "stop_reason": _STOP_REASONS[event.finish_reason],
                    "stop_sequence": event.stop_sequence,
                }
                events.append(
                    {"type": "message_delta", "delta": delta, "usage": _usage(event.usage)}
                )
                events.append({"type": "message_stop"})
            case _:
                # Call starts and argument pieces: the call goes out whole at its
                # end (an abandoned one comes back as text). No logprobs here.
                pass
        return events

    def message(self) -> dict[str, Any]:
        """The whole message, once the reply finished."""
        if self._finished is None:
            raise APIError(
                500, "the reply ended without finishing", "server_error", "generation_failed"
            )
        return self._message(self._blocks, _usage(self._finished.usage))


async def message_response(reply: PreparedReply, show_thinking: bool) -> dict[str, Any]:
    """The non-streaming answer: the whole message. Errors raise `APIError`."""
    assembler = MessageAssembler(new_message_id(), reply.model, reply.prompt_tokens, show_thinking)
    async for event in reply.events:
        assembler.feed(event)
    return assembler.message()


# Sent while nothing else is (a long prefill), so clients and proxies keep waiting.
PING_EVENT = sse_event({"type": "ping"})


async def message_stream(reply: PreparedReply, show_thinking: bool) -> AsyncIterator[str]:
    """The streaming answer as SSE text; an error during the run ends it with an
    `error` event (the HTTP status was sent already)."""
    assembler = MessageAssembler(new_message_id(), reply.model, reply.prompt_tokens, show_thinking)
    for payload in assembler.start():
        yield sse_event(payload)
    try:
        async for event in reply.events:
            if isinstance(event, KeepAlive):
                yield PING_EVENT
            for payload in assembler.feed(event):
                yield sse_event(payload)
    except APIError as error:
        yield sse_event(anthropic_error_body(error.status, error.message))
