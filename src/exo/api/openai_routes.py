"""OpenAI-compatible routes: chat completions, legacy completions, models."""

from fastapi import APIRouter, Request
from starlette.responses import Response

from exo.api.continuation import streamed
from exo.api.dispatch import dispatch
from exo.api.generation import prepare_reply
from exo.api.openai_chat import (
    chat_completion,
    chat_completion_stream,
    text_completion,
    text_completion_stream,
)
from exo.api.openai_translate import completion_to_chat_request, to_chat_request
from exo.api.openai_types import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    ModelObject,
)
from exo.api.reply_retry import ReplyRetry
from exo.api.routing import cluster_models
from exo.api.serving import ModelRouter, sse_response, until_disconnect
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel


def openai_routes(router: ModelRouter, keepalive_seconds: float) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def list_models() -> ModelList:
        local = [
            ModelObject(
                id=m.model_id,
                created=m.created,
                status=m.runner.status,
                context_length=m.context_length,
                images=not isinstance(m.images, str),
                draft_model=m.draft_model,
                draft_model_refused=m.draft_refused,
            )
            for m in router.models.values()
        ]
        remote = [
            ModelObject(id=model_id, created=0, status=status, context_length=None)
            for model_id, status in sorted(cluster_models(router.cluster.state).items())
            if model_id not in router.models
        ]
        return ModelList(data=local + remote)

    @routes.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletion:
        def chat_for(model_id: ModelId) -> ChatRequest:
            return to_chat_request(body).model_copy(update={"model": model_id})

        async def answer(model: ServedModel, retry: ReplyRetry) -> Response | ChatCompletion:
            chat = chat_for(model.model_id)
            reply = await prepare_reply(
                model, chat, keepalive_seconds, retry=retry, fetch_images=router.fetch_images
            )
            if chat.stream:
                return streamed(
                    request,
                    reply,
                    lambda r: sse_response(chat_completion_stream(r, chat.include_usage)),
                )
            return await until_disconnect(request, lambda: chat_completion(reply))

        return await dispatch(router, body.model, request, chat_for, answer)

    @routes.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | Completion:
        def chat_for(model_id: ModelId) -> ChatRequest:
            return completion_to_chat_request(body).model_copy(update={"model": model_id})

        async def answer(model: ServedModel, retry: ReplyRetry) -> Response | Completion:
            chat = chat_for(model.model_id)
            reply = await prepare_reply(
                model, chat, keepalive_seconds, retry=retry, fetch_images=router.fetch_images
            )
            if chat.stream:
                return streamed(
                    request,
                    reply,
                    lambda r: sse_response(text_completion_stream(r, chat.include_usage)),
                )
            return await until_disconnect(request, lambda: text_completion(reply))

        return await dispatch(router, body.model, request, chat_for, answer)

    return routes
