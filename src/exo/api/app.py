"""The HTTP API: OpenAI-compatible chat completions over the node's runners."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.responses import Response

from exo.api.chat_prompt import ChatPrompt, render_chat_prompt
from exo.api.errors import APIError, install_error_handlers
from exo.api.openai_types import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    CompletionUsage,
    Delta,
    ModelList,
    ModelObject,
    PromptTokensDetails,
    error_body,
)
from exo.shared.types.ids import ModelId, new_task_id
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.protocol import Chunk, Finished, Generate, TaskFailed, TaskMessage
from exo.worker.runner.supervisor import RunnerSupervisor, RunnerUnavailable

DEFAULT_MAX_TOKENS = 1024
KEEPALIVE_SECONDS = 10.0
DISCONNECT_POLL_SECONDS = 0.5
# A runner reports prefill progress per chunk and every token, so this much
# silence means it is stuck; the request fails instead of waiting forever.
RUNNER_SILENCE_SECONDS = 300.0


@dataclass
class ServedModel:
    model_id: ModelId
    tokenizer: TokenizerWrapper
    context_length: int
    runner: RunnerSupervisor
    created: int
    default_temperature: float = 1.0
    default_top_p: float = 1.0


def _usage(usage: Usage) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


def create_app(
    models: dict[ModelId, ServedModel], keepalive_seconds: float = KEEPALIVE_SECONDS
) -> FastAPI:
    app = FastAPI(title="exo", version="0.1.0")
    install_error_handlers(app)

    def served_model(name: str) -> ServedModel:
        model = models.get(ModelId(name))
        if model is None:
            available = ", ".join(models) or "none"
            raise APIError(
                404,
                f"The model {name!r} does not exist. Available models: {available}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return model

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelObject(
                    id=m.model_id,
                    created=m.created,
                    status=m.runner.status,
                    context_length=m.context_length,
                )
                for m in models.values()
            ]
        )

    @app.get("/v1/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        return {
            "data": [
                {
                    "model": m.model_id,
                    "runner_status": m.runner.status,
                    **(m.runner.cache_stats.model_dump() if m.runner.cache_stats else {}),
                }
                for m in models.values()
            ]
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "runners": {
                m.model_id: {
                    "status": m.runner.status,
                    "error": m.runner.error,
                    "restarts": m.runner.restarts,
                }
                for m in models.values()
            },
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletion:
        model = served_model(body.model)
        prompt: ChatPrompt = await anyio.to_thread.run_sync(
            render_chat_prompt, model.tokenizer, body.messages
        )
        room = model.context_length - len(prompt.tokens)
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {model.context_length} tokens. "
                f"Your messages resulted in {len(prompt.tokens)} tokens.",
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
            )
        requested = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        params = GenerationParams(
            max_tokens=min(requested, room),
            temperature=model.default_temperature if body.temperature is None else body.temperature,
            top_p=model.default_top_p if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=body.stop_sequences(),
        )
        task = Generate(
            task_id=new_task_id(),
            tokens=prompt.tokens,
            params=params,
            system_prompt_length=prompt.system_prompt_length,
        )
        if model.runner.status == "failed":
            raise APIError(
                503,
                f"the model runner failed: {model.runner.error}; it is restarting",
                "server_error",
                "runner_unavailable",
            )
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(model, task, completion_id, include_usage, keepalive_seconds),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(model, task, completion_id, request)

    return app


async def _complete(
    model: ServedModel, task: Generate, completion_id: str, request: Request
) -> ChatCompletion:
    parts: list[str] = []
    result: Finished | TaskFailed | None = None

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_SECONDS)
        scope.cancel()

    async def collect(messages: MemoryObjectReceiveStream[TaskMessage]) -> None:
        nonlocal result
        try:
            while result is None:
                with anyio.fail_after(RUNNER_SILENCE_SECONDS):
                    message = await messages.receive()
                if isinstance(message, Chunk):
                    parts.append(message.text)
                elif isinstance(message, Finished | TaskFailed):
                    result = message
        except (anyio.EndOfStream, TimeoutError):
            pass  # reported below as a failed generation

    try:
        async with model.runner.generate(task) as messages, anyio.create_task_group() as group:
            group.start_soon(watch_disconnect, group.cancel_scope)
            await collect(messages)
            group.cancel_scope.cancel()
    except RunnerUnavailable as error:
        raise APIError(
            503, f"the model runner is unavailable: {error}", "server_error", "runner_unavailable"
        ) from error
    if isinstance(result, Finished):
        return ChatCompletion(
            id=completion_id,
            model=model.model_id,
            choices=[
                Choice(
                    message=AssistantMessage(content="".join(parts)),
                    finish_reason=result.finish_reason,
                )
            ],
            usage=_usage(result.usage),
        )
    reason = (
        result.error
        if isinstance(result, TaskFailed)
        else "the runner stopped responding or ended the task without a result"
    )
    raise APIError(500, f"generation failed: {reason}", "server_error", "generation_failed")


async def _stream(
    model: ServedModel,
    task: Generate,
    completion_id: str,
    include_usage: bool,
    keepalive_seconds: float,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: Delta, finish_reason: str | None = None) -> str:
        return _sse(
            ChatCompletionChunk(
                id=completion_id,
                created=created,
                model=model.model_id,
                choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)],
            ).model_dump()
        )

    try:
        async with model.runner.generate(task) as messages:
            yield chunk(Delta(role="assistant", content=""))
            last_heard = time.monotonic()
            while True:
                message: TaskMessage | None = None
                with anyio.move_on_after(keepalive_seconds):
                    try:
                        message = await messages.receive()
                    except anyio.EndOfStream:
                        break
                if message is not None:
                    last_heard = time.monotonic()
                elif time.monotonic() - last_heard > RUNNER_SILENCE_SECONDS:
                    yield _sse(
                        error_body(
                            "generation failed: the runner stopped responding",
                            "server_error",
                            "generation_failed",
                        )
                    )
                    break
                if message is None:
                    yield ": keep-alive\n\n"  # SSE comment: keeps clients waiting through prefill
                elif isinstance(message, Chunk):
                    yield chunk(Delta(content=message.text))
                elif isinstance(message, Finished):
                    yield chunk(Delta(), message.finish_reason)
                    if include_usage:
                        yield _sse(
                            ChatCompletionChunk(
                                id=completion_id,
                                created=created,
                                model=model.model_id,
                                choices=[],
                                usage=_usage(message.usage),
                            ).model_dump()
                        )
                    break
                elif isinstance(message, TaskFailed):
                    yield _sse(
                        error_body(
                            f"generation failed: {message.error}",
                            "server_error",
                            "generation_failed",
                        )
                    )
                    break
    except RunnerUnavailable as error:
        yield _sse(
            error_body(
                f"the model runner is unavailable: {error}", "server_error", "runner_unavailable"
            )
        )
    yield _sse("[DONE]")
