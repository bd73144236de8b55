"""The OpenAI adapters' output side: a reply's events as a chat completion (whole
or as `chat.completion.chunk` SSE) and as a legacy text completion."""

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from exo.api.errors import APIError
from exo.api.openai_types import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatFinishReason,
    ChatToolCall,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    CompletionUsage,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCallDelta,
)
from exo.api.reply_stream import (
    KEEPALIVE_COMMENT,
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    TokenLogprob,
    TokenLogprobs,
)
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece, ToolCallArgumentsPiece, ToolCallStart


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def completion_usage(finished: ReplyFinished) -> CompletionUsage:
    usage = finished.usage
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=finished.reasoning_tokens,
            accepted_prediction_tokens=usage.accepted_prediction_tokens,
            rejected_prediction_tokens=usage.rejected_prediction_tokens,
            drafted_tokens=usage.drafted_tokens,
            accepted_draft_tokens=usage.accepted_draft_tokens,
        ),
    )


def _finish_reason(finished: ReplyFinished) -> ChatFinishReason:
    return "stop" if finished.finish_reason == "stop_sequence" else finished.finish_reason


class ChatCompletionAssembler:
    """Reply events -> chat completion chunks, and the whole completion."""

    def __init__(self, reply: PreparedReply, include_usage: bool) -> None:
        self.reply = reply
        self.include_usage = include_usage
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.finished: ReplyFinished | None = None

    def _chunk(self, choices: list[ChunkChoice], finished: ReplyFinished | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=f"chatcmpl-{self.reply.reply_id}",
                created=self.reply.created,
                model=self.reply.model,
                choices=choices,
                usage=completion_usage(finished) if finished else None,
            ).model_dump()
        )

    def _delta(self, delta: Delta, logprobs: list[TokenLogprob] | None = None) -> str:
        choice_logprobs = ChoiceLogprobs(content=logprobs) if logprobs is not None else None
        return self._chunk([ChunkChoice(delta=delta, logprobs=choice_logprobs)])

    def start(self) -> str:
        return self._delta(Delta(role="assistant", content=""))

    def feed(self, event: ReplyEvent) -> list[str]:
        """The SSE texts for `event` (and the reply's record for `completion`)."""
        match event:
            case TextPiece(text=text):
                self.text.append(text)
                return [self._delta(Delta(content=text))]
            case ReasoningPiece(text=text):
                self.reasoning.append(text)
                return [self._delta(Delta(reasoning_content=text))]
            case ToolCallStart(index=index, id=call_id, name=name):
                function = FunctionCallDelta(name=name, arguments="")
                call = ToolCallDelta(index=index, id=call_id, type="function", function=function)
                return [self._delta(Delta(tool_calls=[call]))]
            case ToolCallArgumentsPiece(index=index, text=text):
                call = ToolCallDelta(index=index, function=FunctionCallDelta(arguments=text))
                return [self._delta(Delta(tool_calls=[call]))]
            case TokenLogprobs():
                entries = list(event.tokens)
                self.logprobs = (self.logprobs or []) + entries
                return [self._delta(Delta(), entries)]
            case KeepAlive():
                return [KEEPALIVE_COMMENT]
            case ReplyFinished():
                self.finished = event
                last = [
                    self._chunk([ChunkChoice(delta=Delta(), finish_reason=_finish_reason(event))])
                ]
                if self.include_usage:
                    last.append(self._chunk([], event))
                return last
            case _:
                return []  # a call's end or abandonment: its pieces went out already

    def completion(self) -> ChatCompletion:
        finished = self.finished
        if finished is None:
            raise APIError(500, "the reply ended without finishing", "server_error")
        calls = [
            ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in finished.tool_calls
        ]
        text = "".join(self.text)
        message = AssistantMessage(
            content=text if text or not calls else None,
            reasoning_content="".join(self.reasoning) or None,
            tool_calls=calls or None,
        )
        logprobs = ChoiceLogprobs(content=self.logprobs) if self.logprobs is not None else None
        return ChatCompletion(
            id=f"chatcmpl-{self.reply.reply_id}",
            created=self.reply.created,
            model=self.reply.model,
            choices=[
                Choice(message=message, finish_reason=_finish_reason(finished), logprobs=logprobs)
            ],
            usage=completion_usage(finished),
        )


async def chat_completion(reply: PreparedReply) -> ChatCompletion:
    assembler = ChatCompletionAssembler(reply, include_usage=False)
    async for event in reply.events:
        assembler.feed(event)
    return assembler.completion()


async def _sse_until_done(
    events: AsyncIterator[ReplyEvent], feed: Callable[[ReplyEvent], list[str]]
) -> AsyncGenerator[str]:
    """The events as an assembler's SSE chunks, then `[DONE]`; an error during the
    run is sent in-stream (the status is sent)."""
    try:
        async for event in events:
            for text in feed(event):
                yield text
    except APIError as error:
        yield sse(error.body())
    yield sse("[DONE]")


async def chat_completion_stream(reply: PreparedReply, include_usage: bool) -> AsyncIterator[str]:
    assembler = ChatCompletionAssembler(reply, include_usage)
    yield assembler.start()
    async with aclosing(_sse_until_done(reply.events, assembler.feed)) as chunks:
        async for text in chunks:
            yield text


class TextCompletionAssembler:
    """Reply events -> legacy completions (`text_completion` objects)."""

    def __init__(self, reply: PreparedReply, include_usage: bool) -> None:
        self.reply = reply
        self.include_usage = include_usage
        self.text: list[str] = []
        self.logprobs: CompletionLogprobs | None = None
        self.finished: ReplyFinished | None = None
        self._offset = 0

    def _object(
        self, choices: list[CompletionChoice], finished: ReplyFinished | None = None
    ) -> Completion:
        return Completion(
            id=f"cmpl-{self.reply.reply_id}",
            created=self.reply.created,
            model=self.reply.model,
            choices=choices,
            usage=completion_usage(finished) if finished else None,
        )

    def _add_logprobs(self, event: TokenLogprobs) -> CompletionLogprobs:
        piece = CompletionLogprobs(
            tokens=[t.token for t in event.tokens],
            token_logprobs=[t.logprob for t in event.tokens],
            top_logprobs=[{a.token: a.logprob for a in t.top_logprobs} for t in event.tokens],
            text_offset=[],
        )
        for token in event.tokens:
            piece.text_offset.append(self._offset)
            self._offset += len(token.token)
        whole = self.logprobs or CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]
        )
        self.logprobs = CompletionLogprobs(
            tokens=whole.tokens + piece.tokens,
            token_logprobs=whole.token_logprobs + piece.token_logprobs,
            top_logprobs=(whole.top_logprobs or []) + (piece.top_logprobs or []),
            text_offset=whole.text_offset + piece.text_offset,
        )
        return piece

    def feed(self, event: ReplyEvent) -> list[str]:
        match event:
            case TextPiece(text=text) | ReasoningPiece(text=text):
                self.text.append(text)
                choice = CompletionChoice(text=text, finish_reason=None)
                return [sse(self._object([choice]).model_dump())]
            case TokenLogprobs():
                piece = self._add_logprobs(event)
                choice = CompletionChoice(text="", finish_reason=None, logprobs=piece)
                return [sse(self._object([choice]).model_dump())]
            case KeepAlive():
                return [KEEPALIVE_COMMENT]
            case ReplyFinished():
                self.finished = event
                reason = "length" if event.finish_reason == "length" else "stop"
                choice = CompletionChoice(text="", finish_reason=reason)
                with_usage = event if self.include_usage else None
                return [sse(self._object([choice], with_usage).model_dump())]
            case _:
                return []

    def completion(self) -> Completion:
        finished = self.finished
        if finished is None:
            raise APIError(500, "the reply ended without finishing", "server_error")
        reason = "length" if finished.finish_reason == "length" else "stop"
        choice = CompletionChoice(
            text="".join(self.text), finish_reason=reason, logprobs=self.logprobs
        )
        return self._object([choice], finished)


async def text_completion(reply: PreparedReply) -> Completion:
    assembler = TextCompletionAssembler(reply, include_usage=False)
    async for event in reply.events:
        assembler.feed(event)
    return assembler.completion()


async def text_completion_stream(reply: PreparedReply, include_usage: bool) -> AsyncIterator[str]:
    assembler = TextCompletionAssembler(reply, include_usage)
    async with aclosing(_sse_until_done(reply.events, assembler.feed)) as chunks:
        async for text in chunks:
            yield text
