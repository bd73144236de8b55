"""The OpenAI Responses route, `/v1/responses` (stateless)."""

from fastapi import APIRouter, Request
from starlette.responses import Response

from exo.api import responses
from exo.api.continuation import streamed
from exo.api.dispatch import dispatch
from exo.api.generation import prepare_reply
from exo.api.reply_retry import ReplyRetry
from exo.api.responses_types import ResponsesRequest
from exo.api.serving import ModelRouter, sse_response, until_disconnect
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel


def responses_routes(router: ModelRouter, keepalive_seconds: float) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses", response_model=None)
    async def create_response(
        body: ResponsesRequest, request: Request
    ) -> Response | dict[str, object]:
        def chat_for(model_id: ModelId) -> ChatRequest:
            return responses.to_chat_request(body).model_copy(update={"model": model_id})

        async def answer(model: ServedModel, retry: ReplyRetry) -> Response | dict[str, object]:
            reply = await prepare_reply(
                model,
                chat_for(model.model_id),
                keepalive_seconds,
                retry=retry,
                fetch_images=router.fetch_images,
            )
            if body.stream:
                return streamed(
                    request, reply, lambda r: sse_response(responses.response_stream(r, body))
                )
            return await until_disconnect(request, lambda: responses.response_object(reply, body))

        return await dispatch(router, body.model, request, chat_for, answer)

    return routes
