"""The HTTP API: OpenAI-compatible chat completions over the node's runners."""

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from jinja2 import TemplateError
from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.background import BackgroundTask
from starlette.responses import Response

from exo.api.chat_prompt import ChatPrompt, render_chat_prompt
from exo.api.errors import APIError, install_error_handlers
from exo.api.instances import instance_routes
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
)
from exo.api.routing import cluster_models, remote_api_for
from exo.cluster.link import ClusterUnavailable
from exo.master.commands import CommandRejected
from exo.shared.cluster_view import ClusterView
from exo.shared.types.commands import Command
from exo.shared.types.ids import ModelId, new_task_id
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.protocol import Chunk, Finished, Generate, TaskFailed, TaskMessage
from exo.worker.runner.supervisor import RunnerSupervisor, RunnerUnavailable

DEFAULT_MAX_TOKENS = 1024
KEEPALIVE_SECONDS = 10.0
DISCONNECT_POLL_SECONDS = 0.5
FORWARD_CONNECT_SECONDS = 5.0
DASHBOARD_HTML = (resources.files("exo") / "dashboard" / "index.html").read_text()


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


def _runner_unavailable(reason: str) -> APIError:
    return APIError(
        503, f"the model runner is unavailable: {reason}", "server_error", "runner_unavailable"
    )


def _generation_failed(reason: str) -> APIError:
    return APIError(500, f"generation failed: {reason}", "server_error", "generation_failed")


def create_app(
    models: dict[ModelId, ServedModel],
    cluster: ClusterView,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
    delete_model_files: Callable[[ModelId], Awaitable[bool]] | None = None,
) -> FastAPI:
    app = FastAPI(title="exo", version="0.1.0")
    install_error_handlers(app)

    def served_model(name: str) -> ServedModel | str:
        """The local model, or the API address of a node that serves it."""
        model = models.get(ModelId(name))
        if model is not None:
            return model
        remote = remote_api_for(cluster.state, ModelId(name), cluster.node_id)
        if remote is not None:
            return remote
        available = ", ".join(sorted({*models, *cluster_models(cluster.state)})) or "none"
        raise APIError(
            404,
            f"The model {name!r} is not served in this cluster. Available models: {available}",
            "invalid_request_error",
            "model_not_found",
            "model",
        )

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        local = [
            ModelObject(
                id=m.model_id,
                created=m.created,
                status=m.runner.status,
                context_length=m.context_length,
            )
            for m in models.values()
        ]
        remote = [
            ModelObject(id=model_id, created=0, status=status, context_length=None)
            for model_id, status in sorted(cluster_models(cluster.state).items())
            if model_id not in models
        ]
        return ModelList(data=local + remote)

    async def command(command: Command) -> None:
        try:
            await cluster.send_command(command)
        except CommandRejected as error:
            code = "not_found" if error.not_found else "invalid_request"
            raise APIError(
                404 if error.not_found else 400, str(error), "invalid_request_error", code
            ) from error
        except ClusterUnavailable as error:
            raise APIError(503, str(error), "server_error", "cluster_unavailable") from error

    app.include_router(instance_routes(cluster, command, delete_model_files))

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> str:
        """The web dashboard: nodes, instances, downloads; place and delete models."""
        return DASHBOARD_HTML

    @app.get("/cluster")
    async def cluster_info() -> dict[str, Any]:
        """This node's view of the cluster link: who is master, where the log resumed."""
        return {
            "node_id": cluster.node_id,
            "address": cluster.address,
            "master_id": cluster.master_id,
            "resumed_from_idx": cluster.resumed_from_idx,
            "last_applied_idx": cluster.state.last_idx,
        }

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

    @app.get("/node_id")
    async def node_id() -> str:
        return cluster.node_id

    @app.get("/state")
    async def state() -> dict[str, Any]:
        return cluster.state.model_dump(mode="json")

    @app.get("/events")
    async def events(from_idx: int = 0) -> StreamingResponse:
        """SSE of indexed events from `from_idx`: the history, then live events."""
        if from_idx < 0:
            raise APIError(
                400, "from_idx must be >= 0", "invalid_request_error", "invalid_request", "from_idx"
            )

        async def stream() -> AsyncIterator[str]:
            async for indexed in cluster.subscribe(from_idx):
                yield f"id: {indexed.idx}\n" + _sse(indexed.model_dump(mode="json"))

        return StreamingResponse(stream(), media_type="text/event-stream")

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
        if isinstance(model, str):
            return await _forward(model, await request.body())
        try:
            prompt: ChatPrompt = await anyio.to_thread.run_sync(
                render_chat_prompt, model.tokenizer, body.messages
            )
        except TemplateError as error:
            raise APIError(
                400,
                f"the model's chat template rejected the messages: {error}",
                "invalid_request_error",
                "invalid_messages",
                "messages",
            ) from error
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
            raise _runner_unavailable(f"{model.runner.error}; it is restarting")
        completion = _Completion(model, task, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                completion.stream(include_usage, keepalive_seconds),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await completion.complete(request)

    return app


async def _forward(api_address: str, body: bytes) -> StreamingResponse:
    """Relay a chat request to the node that serves the model, streaming its answer
    back as it comes; a client that goes away closes the relay, which cancels there."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(FORWARD_CONNECT_SECONDS, read=None))
    try:
        upstream = await client.send(
            client.build_request(
                "POST",
                f"http://{api_address}/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            ),
            stream=True,
        )
    except httpx.HTTPError as error:
        await client.aclose()
        raise _runner_unavailable(f"the node at {api_address} did not answer: {error}") from error

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
        background=BackgroundTask(close),
    )


@dataclass
class _Completion:
    """One chat completion: the task on the runner, answered whole or streamed.

    Waits end when the task does (`Finished`/`TaskFailed`), when the runner
    dies (the supervisor fails its tasks) or when the client goes away.
    """

    model: ServedModel
    task: Generate
    completion_id: str
    created: int

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        return _sse(
            ChatCompletionChunk(
                id=self.completion_id,
                created=self.created,
                model=self.model.model_id,
                choices=choices,
                usage=_usage(usage) if usage else None,
            ).model_dump()
        )

    async def complete(self, request: Request) -> ChatCompletion:
        parts: list[str] = []
        result: Finished | TaskFailed | None = None

        async def watch_disconnect(scope: anyio.CancelScope) -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
            scope.cancel()

        try:
            async with (
                self.model.runner.generate(self.task) as messages,
                anyio.create_task_group() as group,
            ):
                group.start_soon(watch_disconnect, group.cancel_scope)
                async for message in messages:
                    if isinstance(message, Chunk):
                        parts.append(message.text)
                    elif isinstance(message, Finished | TaskFailed):
                        result = message
                group.cancel_scope.cancel()
        except RunnerUnavailable as error:
            raise _runner_unavailable(str(error)) from error
        if isinstance(result, TaskFailed):
            raise _generation_failed(result.error)
        if result is None:
            raise _generation_failed("the runner ended the task without a result")
        return ChatCompletion(
            id=self.completion_id,
            created=self.created,
            model=self.model.model_id,
            choices=[
                Choice(
                    message=AssistantMessage(content="".join(parts)),
                    finish_reason=result.finish_reason,
                )
            ],
            usage=_usage(result.usage),
        )

    async def stream(self, include_usage: bool, keepalive_seconds: float) -> AsyncIterator[str]:
        try:
            async with self.model.runner.generate(self.task) as messages:
                yield self._chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
                last_write = time.monotonic()
                while True:
                    message: TaskMessage | None = None
                    wait = max(0.0, last_write + keepalive_seconds - time.monotonic())
                    with anyio.move_on_after(wait):
                        try:
                            message = await messages.receive()
                        except anyio.EndOfStream:
                            break
                    if isinstance(message, Chunk):
                        yield self._chunk([ChunkChoice(delta=Delta(content=message.text))])
                    elif isinstance(message, Finished):
                        yield self._chunk(
                            [ChunkChoice(delta=Delta(), finish_reason=message.finish_reason)]
                        )
                        if include_usage:
                            yield self._chunk([], message.usage)
                        break
                    elif isinstance(message, TaskFailed):
                        yield _sse(_generation_failed(message.error).body())
                        break
                    elif time.monotonic() - last_write >= keepalive_seconds:
                        # An SSE comment keeps clients waiting through a long prefill.
                        yield ": keep-alive\n\n"
                    else:
                        continue
                    last_write = time.monotonic()
        except RunnerUnavailable as error:
            yield _sse(_runner_unavailable(str(error)).body())
        yield _sse("[DONE]")
