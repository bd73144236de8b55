"""The OpenAI Responses API as a translation layer: a request into the internal
`ChatRequest`, one reply's events out as a response object or its event stream.

Requests: `instructions` is a system turn ahead of the input; a string input
is one user message; a user message's `input_image` parts are its images, at
their place among its text. Items that an earlier reply produced (its `reasoning`,
assistant `message` and `function_call` items, in a row) make one assistant
turn, with the call ids kept as sent; a `function_call_output` is a tool turn.

Replies: reasoning is a `reasoning` item (its text as `reasoning_text`
content), text a `message` item, and each tool call a `function_call` item sent
when the call is complete and checked (a call the model wrote malformed comes
as text). A reply cut by `max_output_tokens` (or the context) is `incomplete`.
Usage: `input_tokens` is the whole prompt, `cached_tokens` the part found in the
prefix cache, `cache_write_tokens` the part prefilled now; `reasoning_tokens`
the part of `output_tokens` the model spent thinking.
"""

import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from exo.api.errors import APIError
from exo.api.reply_stream import (
    KEEPALIVE_COMMENT,
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    sse_event,
)
from exo.api.responses_types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    FunctionToolParam,
    InputItem,
    JsonObjectFormatParam,
    JsonSchemaFormatParam,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    parts_text,
    user_content,
)
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece, ToolCallEnd
from exo.shared.types.chat import (
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
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


class _AssistantTurn:
    """The items of one earlier reply, gathered into its turn."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def turn(self) -> ChatTurn:
        return ChatTurn(
            role="assistant",
            content="".join(self.texts),
            tool_calls=tuple(self.calls),
            reasoning="".join(self.reasoning) if self.reasoning else None,
        )


def to_turns(instructions: str | None, items: str | list[InputItem]) -> tuple[ChatTurn, ...]:
    """The conversation as the chat template sees it (see the module docstring)."""
    turns: list[ChatTurn] = []
    if instructions:
        turns.append(ChatTurn(role="system", content=instructions))
    if isinstance(items, str):
        return (*turns, ChatTurn(role="user", content=items))
    call_names: dict[str, str] = {}
    reply: _AssistantTurn | None = None
    for item in items:
        if isinstance(item, ReasoningItem | FunctionCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        ):
            reply = reply or _AssistantTurn()
            match item:
                case ReasoningItem(content=content):
                    reply.reasoning.extend(part.text for part in content or ())
                case FunctionCallItem(call_id=call_id, name=name, arguments=arguments):
                    reply.calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
                    call_names[call_id] = name
                case MessageItem(content=content):
                    reply.texts.append(parts_text(content))
            continue
        if reply is not None:
            turns.append(reply.turn())
            reply = None
        match item:
            case MessageItem(role="user", content=content):
                text, images = user_content(content)
                turns.append(ChatTurn(role="user", content=text, images=images))
            case MessageItem(content=content):  # system, developer
                turns.append(ChatTurn(role="system", content=parts_text(content)))
            case FunctionCallOutputItem(call_id=call_id, output=output, name=name):
                text = output if isinstance(output, str) else "".join(p.text for p in output)
                turns.append(
                    ChatTurn(
                        role="tool",
                        content=text,
                        tool_call_id=call_id,
                        name=call_names.get(call_id, name),
                    )
                )
    if reply is not None:
        turns.append(reply.turn())
    return tuple(turns)


def _tool(tool: FunctionToolParam) -> ToolFunction:
    return ToolFunction(
        name=tool.name,
        description=tool.description or "",
        strict=bool(tool.strict),
        **({} if tool.parameters is None else {"parameters": tool.parameters}),
    )


def _tool_choice(body: ResponsesRequest) -> ToolChoice:
    if isinstance(body.tool_choice, FunctionToolChoice):
        return NamedToolChoice(name=body.tool_choice.name)
    return body.tool_choice or "auto"


def _response_format(body: ResponsesRequest) -> ResponseFormat:
    match body.text.format if body.text else None:
        case JsonObjectFormatParam():
            return JsonObjectFormat()
        case JsonSchemaFormatParam(name=name, schema_=schema, strict=strict):
            return JsonSchemaFormat(name=name, json_schema=schema, strict=bool(strict))
        case _:
            return TextFormat()


def to_chat_request(body: ResponsesRequest) -> ChatRequest:
    """A valid Responses request as the internal request. `max_output_tokens` is
    carried as sent: the generation service clamps it to what the context leaves."""
    return ChatRequest(
        model=ModelId(body.model),
        turns=to_turns(body.instructions, body.input),
        tools=tuple(_tool(tool) for tool in body.tools or ()),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body),
        max_tokens=body.max_output_tokens,
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p),
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        stream=bool(body.stream),
        speculation=body.speculation is not False,
    )


# ---- reply events -> response / stream events ----


def _usage(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def request_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as a response object repeats them."""
    format_ = body.text.format if body.text and body.text.format else None
    return {
        "instructions": body.instructions,
        "tools": [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
                "strict": tool.strict,
            }
            for tool in body.tools or ()
        ],
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, FunctionToolChoice)
            # the wire name of "none"/"auto"/"required"
            else body.tool_choice or "auto"
        ),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": {"format": format_.model_dump(by_alias=True) if format_ else {"type": "text"}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None},
        "metadata": body.metadata or {},
        "truncation": "disabled",
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    return _item_id("resp")


class ResponseAssembler:
    """Reply events in; Responses stream events (as JSON objects, numbered) and,
    at the end, the whole response out. One reasoning or message item is open
    at a time."""

    def __init__(self, response_id: str, model: str, created: int, echo: dict[str, Any]) -> None:
        self._id = response_id
        self._model = model
        self._created = created
        self._echo = echo
        self._output: list[dict[str, Any]] = []
        self._open: Literal["reasoning", "message"] | None = None
        self._status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
        self._usage: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._sequence = 0

    def response(self) -> dict[str, Any]:
        """The response as it stands (whole once the reply finished)."""
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "status": self._status,
            "model": self._model,
            "output": self._output,
            **self._echo,
            "usage": self._usage,
            "error": self._error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if self._status == "incomplete" else None
            ),
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": f"response.{kind}", "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        # Snapshots: the output grows after they are sent.
        return [
            self._event("created", response=copy.deepcopy(self.response())),
            self._event("in_progress", response=copy.deepcopy(self.response())),
        ]

    def _where(self) -> dict[str, Any]:
        index = len(self._output) - 1
        return {"item_id": self._output[index]["id"], "output_index": index}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item = self._output[-1]
        item["status"] = "completed"
        part = item["content"][0]
        where = self._where() | {"content_index": 0}
        done = (
            self._event("reasoning_text.done", **where, text=part["text"])
            if self._open == "reasoning"
            else self._event("output_text.done", **where, text=part["text"], logprobs=[])
        )
        self._open = None
        return [
            done,
            self._event("content_part.done", **where, part=part),
            self._event("output_item.done", output_index=len(self._output) - 1, item=item),
        ]

    def _open_item(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self._close()
        self._output.append(item)
        index = len(self._output) - 1
        events.append(self._event("output_item.added", output_index=index, item=dict(item)))
        if part is not None:
            item["content"] = [part]
            events.append(
                self._event("content_part.added", **self._where(), content_index=0, part=dict(part))
            )
        return events

    def feed(self, event: ReplyEvent) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        match event:
            case ReasoningPiece(text=text) if text:
                if self._open != "reasoning":
                    item = {
                        "type": "reasoning",
                        "id": _item_id("rs"),
                        "summary": [],
                        "content": [],
                        "status": "in_progress",
                    }
                    events += self._open_item(item, {"type": "reasoning_text", "text": ""})
                    self._open = "reasoning"
                self._output[-1]["content"][0]["text"] += text
                where = self._where() | {"content_index": 0}
                events.append(self._event("reasoning_text.delta", **where, delta=text))
            case TextPiece(text=text) if text:
                if self._open != "message":
                    item = {
                        "type": "message",
                        "id": _item_id("msg"),
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    }
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    events += self._open_item(item, part)
                    self._open = "message"
                self._output[-1]["content"][0]["text"] += text
                where = self._where() | {"content_index": 0}
                events.append(self._event("output_text.delta", **where, delta=text, logprobs=[]))
            case ToolCallEnd(call=call):
                item = {
                    "type": "function_call",
                    "id": _item_id("fc"),
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._open_item(item, None)
                events.append(
                    self._event(
                        "function_call_arguments.delta", **self._where(), delta=call.arguments
                    )
                )
                item["arguments"] = call.arguments
                item["status"] = "completed"
                events.append(
                    self._event(
                        "function_call_arguments.done", **self._where(), arguments=call.arguments
                    )
                )
                events.append(
                    self._event("output_item.done", output_index=len(self._output) - 1, item=item)
                )
            case ReplyFinished(finish_reason=reason, usage=usage):
                events += self._close()
                self._status = "incomplete" if reason == "length" else "completed"
                self._usage = _usage(usage, event.reasoning_tokens)
                events.append(self._event(self._status, response=self.response()))
            case _:
                # Call starts and argument pieces: the call goes out whole at its
                # end (an abandoned one comes back as text). No logprobs here.
                pass
        return events

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        """The events that end a stream whose run failed."""
        events = self._close()
        self._status = "failed"
        self._error = {"code": "server_error", "message": error.message}
        return [*events, self._event("failed", response=self.response())]


async def response_object(reply: PreparedReply, body: ResponsesRequest) -> dict[str, Any]:
    """The non-streaming answer: the whole response. Errors raise `APIError`."""
    assembler = ResponseAssembler(new_response_id(), reply.model, reply.created, request_echo(body))
    finished = False
    async for event in reply.events:
        assembler.feed(event)
        finished = finished or isinstance(event, ReplyFinished)
    if not finished:
        raise APIError(
            500, "the reply ended without finishing", "server_error", "generation_failed"
        )
    return assembler.response()


async def response_stream(reply: PreparedReply, body: ResponsesRequest) -> AsyncIterator[str]:
    """The streaming answer as SSE text; an error during the run ends it with
    `response.failed` (the HTTP status was sent already)."""
    assembler = ResponseAssembler(new_response_id(), reply.model, reply.created, request_echo(body))
    for payload in assembler.start():
        yield sse_event(payload)
    try:
        async for event in reply.events:
            if isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            for payload in assembler.feed(event):
                yield sse_event(payload)
    except APIError as error:
        for payload in assembler.fail(error):
            yield sse_event(payload)
