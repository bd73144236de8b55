"""Ollama API routes under `/api/…` (no exo route lives there), and the
`--ollama-port` app: the node's whole API, where `/` answers as Ollama's
server does (on the main port `/` is the dashboard)."""

import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from starlette.datastructures import MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api import ollama, ollama_models
from exo.api.continuation import streamed
from exo.api.dispatch import dispatch
from exo.api.errors import APIError
from exo.api.generation import prepare_reply
from exo.api.instances import PlaceRequest, model_id_param, place_instance
from exo.api.ollama_types import OllamaChatRequest, OllamaGenerateRequest, PullRequest, ShowRequest
from exo.api.reply_retry import ReplyRetry
from exo.api.routing import cluster_models
from exo.api.serving import ModelRouter, Relay, ndjson_response, relay, until_disconnect
from exo.models.file_source import FileSource
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel

# How Ollama's server answers `/`: clients check with it that a server is up.
OLLAMA_ROOT_TEXT = "Ollama is running"


class JsonBodyRoute(APIRoute):
    """A route that reads its body as JSON whatever its content type says, as
    Ollama's server does: the curl commands of Ollama's documentation send
    JSON without saying so (curl then says form data)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            MutableHeaders(scope=request.scope)["content-type"] = "application/json"
            return await handler(request)

        return as_json


def ollama_routes(
    router: ModelRouter, hub: FileSource | None, keepalive_seconds: float
) -> APIRouter:
    """`hub`: where a pulled model no node has comes from (None: nowhere)."""
    routes = APIRouter(route_class=JsonBodyRoute)
    cluster = router.cluster

    async def answer(
        request: Request,
        name: str,
        shape: ollama.Shape,
        empty: bool,
        translate: Callable[[], ChatRequest],
    ) -> Response:
        """A chat or generate: `empty` (no messages or prompt) only loads the
        model, as Ollama answers it; a model served elsewhere is relayed."""
        started = time.monotonic_ns()
        if empty:
            model = router.find(ollama.model_name(name))
            return JSONResponse(ollama.loaded(model.model_id, shape))

        def chat_for(model_id: ModelId) -> ChatRequest:
            return translate().model_copy(update={"model": model_id})

        async def reply_with(model: ServedModel, retry: ReplyRetry) -> Response:
            chat = chat_for(model.model_id)
            reply = await prepare_reply(
                model, chat, keepalive_seconds, retry=retry, fetch_images=router.fetch_images
            )
            if chat.stream:
                return streamed(
                    request,
                    reply,
                    lambda r: ndjson_response(
                        ollama.reply_lines(ollama.ReplyAssembler(r, shape, started))
                    ),
                )
            assembler = ollama.ReplyAssembler(reply, shape, started)
            return JSONResponse(
                await until_disconnect(request, lambda: ollama.reply_object(assembler))
            )

        return await dispatch(router, ollama.model_name(name), request, chat_for, reply_with)

    @routes.post("/api/chat", response_model=None)
    async def chat(body: OllamaChatRequest, request: Request) -> Response:
        empty = not body.messages
        return await answer(request, body.model, "chat", empty, lambda: ollama.chat_request(body))

    @routes.post("/api/generate", response_model=None)
    async def generate(body: OllamaGenerateRequest, request: Request) -> Response:
        empty = not body.prompt and not body.images
        return await answer(
            request, body.model, "generate", empty, lambda: ollama.generate_request(body)
        )

    @routes.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags() -> dict[str, Any]:
        """The models the cluster serves (as `/v1/models`): the ones chat answers."""
        cards = cluster.state.cards
        return {
            "models": [
                ollama_models.tag(
                    model_id,
                    cards.get(model_id),
                    router.models[model_id].created if model_id in router.models else 0,
                )
                for model_id in sorted(router.served_names())
            ]
        }

    @routes.get("/api/ps")
    async def ps() -> dict[str, Any]:
        context_lengths = {m.model_id: m.context_length for m in router.models.values()}
        return {"models": ollama_models.running(cluster.state, context_lengths)}

    @routes.post("/api/show", response_model=None)
    async def show(body: ShowRequest, request: Request) -> Response | dict[str, Any]:
        model = router.find(ollama.model_name(body.model_name()))
        if isinstance(model, Relay):
            return await relay(model, request)
        return ollama_models.show(model, cluster.state.cards.get(model.model_id))

    @routes.api_route("/api/version", methods=["GET", "HEAD"])
    async def version() -> dict[str, str]:
        return {"version": ollama_models.OLLAMA_VERSION}

    @routes.post("/api/pull", response_model=None)
    async def pull(body: PullRequest, request: Request) -> Response | dict[str, Any]:
        """Place the model unless an instance of it is placed (and not failed);
        then its progress until it serves."""
        model_id = model_id_param(ollama.model_name(body.model_name()), "model")
        if cluster_models(cluster.state).get(model_id, "failed") == "failed":
            await place_instance(cluster, hub, PlaceRequest(model_id=model_id))
        lines = ollama_models.pull_progress(cluster, model_id)
        if body.stream is not False:
            return ndjson_response(ollama.ndjson(line) async for line in lines)

        async def last_line() -> dict[str, Any]:
            return [line async for line in lines][-1]

        last = await until_disconnect(request, last_line)
        if "error" in last:
            raise APIError(502, last["error"], "server_error", "pull_failed")
        return last

    return routes


def with_ollama_root(app: ASGIApp, port: int) -> ASGIApp:
    """`app`, but `GET`/`HEAD /` of a request that came in on `port` (the
    `--ollama-port`) answers as Ollama's server does."""
    root = PlainTextResponse(OLLAMA_ROOT_TEXT)

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") if scope["type"] == "http" else None
        if (
            server is not None
            and server[1] == port
            and scope["path"] == "/"
            and scope["method"] in ("GET", "HEAD")
        ):
            await root(scope, receive, send)
            return
        await app(scope, receive, send)

    return serve
