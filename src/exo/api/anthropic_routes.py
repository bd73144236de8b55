"""Anthropic Messages routes: `/v1/messages` and `/v1/messages/count_tokens`."""

import secrets
import string

from fastapi import APIRouter, Request
from starlette.responses import Response

from exo.api import anthropic
from exo.api.anthropic_types import CountTokensRequest, MessagesRequest, TokenCount
from exo.api.continuation import streamed
from exo.api.dispatch import dispatch
from exo.api.generation import count_prompt_tokens, prepare_reply
from exo.api.reply_retry import ReplyRetry
from exo.api.serving import ModelRouter, Relay, relay, sse_response, until_disconnect
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel

_ID_CHARACTERS = string.ascii_letters + string.digits


def anthropic_tool_use_id() -> str:
    """Anthropic's tool_use ids look like `toolu_` + 24 characters."""
    return "toolu_" + "".join(secrets.choice(_ID_CHARACTERS) for _ in range(24))


def anthropic_routes(router: ModelRouter, keepalive_seconds: float) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Response | dict[str, object]:
        def chat_for(model_id: ModelId) -> ChatRequest:
            return anthropic.to_chat_request(body).model_copy(update={"model": model_id})

        async def answer(model: ServedModel, retry: ReplyRetry) -> Response | dict[str, object]:
            chat = chat_for(model.model_id)
            reply = await prepare_reply(
                model,
                chat,
                keepalive_seconds,
                anthropic_tool_use_id,
                retry=retry,
                fetch_images=router.fetch_images,
            )
            show_thinking = anthropic.shows_thinking(body)
            if body.stream:
                return streamed(
                    request,
                    reply,
                    lambda r: sse_response(anthropic.message_stream(r, show_thinking)),
                )
            return await until_disconnect(
                request, lambda: anthropic.message_response(reply, show_thinking)
            )

        return await dispatch(router, body.model, request, chat_for, answer)

    @routes.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(body: CountTokensRequest, request: Request) -> Response | TokenCount:
        model = router.find(body.model)
        if isinstance(model, Relay):
            return await relay(model, request)
        chat = anthropic.count_tokens_to_chat_request(body)
        counted = await count_prompt_tokens(
            model,
            chat.model_copy(update={"model": model.model_id}),
            fetch_images=router.fetch_images,
        )
        return TokenCount(input_tokens=counted)

    return routes
