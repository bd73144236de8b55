"""A stream continued on another replica reads that node's reply events
(`continuation`): a real server sends them as `streamed` does (one JSON event
per line, a failure as its last line), and `relayed_events` on another app
reads them back as they were, or raises what the serving node's failure
was, telling a loss before the first token from any other."""

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from exo.api.continuation import relayed_events, streamed
from exo.api.errors import APIError, install_error_handlers
from exo.api.reply_retry import is_unanswered, lost_unanswered
from exo.api.reply_stream import (
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    TextPiece,
    TokenLogprob,
    TokenLogprobs,
)
from exo.api.serving import Relay
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import ToolCallArgumentsPiece, ToolCallEnd, ToolCallStart
from exo.shared.types.chat import ToolCall
from exo.shared.types.ids import ModelId
from exo.shared.types.tasks import Usage
from tests.unit.test_http_server import serving_app

READ_TIMEOUT = 2.0
CALL = ToolCall(id="call_1", name="edit", arguments='{"path": "a.py"}')
WHOLE: list[ReplyEvent] = [
    KeepAlive(),
    ReasoningPiece(text="Edit a.py."),
    TextPiece(text="Héllo"),
    TokenLogprobs(tokens=(TokenLogprob(token="H", logprob=-0.5, bytes=(72,)),)),
    ToolCallStart(index=0, id="call_1", name="edit"),
    ToolCallArgumentsPiece(index=0, text='{"path": "a.py"}'),
    ToolCallEnd(index=0, call=CALL),
    ReplyFinished(
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=9, completion_tokens=4, cached_tokens=3),
        tool_calls=(CALL,),
    ),
]


async def _script(name: str) -> AsyncIterator[ReplyEvent]:
    if name == "whole":
        for event in WHOLE:
            yield event
    elif name == "unanswered":  # its runner lost before the first token
        yield KeepAlive()
        raise lost_unanswered("the runner died")
    elif name == "failed_later":  # lost after a token reached the client
        yield TextPiece(text="Hel")
        raise APIError(503, "the runner died mid-reply", "server_error", "runner_unavailable")
    elif name == "cut":  # ends without finishing (a node shut down under it)
        yield TextPiece(text="Hel")


def serving_app_of_a_node() -> FastAPI:
    """A node's route as every API's is: its reply streamed by `streamed`."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def answer(request: Request) -> Response:
        script = (await request.json())["script"]
        if script == "busy":
            raise APIError(429, "the queue is full", "rate_limit_error", "queue_full")
        reply = PreparedReply(
            reply_id="r", model="m", prompt_tokens=9, created=0, events=_script(script)
        )
        return streamed(request, reply, lambda r: PlainTextResponse("the API's own answer"))

    return app


def relaying_app(address: str) -> FastAPI:
    """Reads the serving node's events for the request it took; answers what
    it read, and the error that ended them."""
    app = FastAPI()
    target = Relay(address, ModelId("m"), READ_TIMEOUT)

    @app.post("/v1/chat/completions")
    async def read(request: Request) -> dict[str, Any]:
        events: list[dict[str, Any]] = []
        try:
            async for event in relayed_events(target, request):
                events.append(event.model_dump(mode="json"))
        except APIError as error:
            failed = {"status": error.status, "code": error.code, "message": error.message}
            return {"events": events, "error": failed | {"unanswered": is_unanswered(error)}}
        return {"events": events, "error": None}

    return app


async def read_from(address: str, script: str) -> dict[str, Any]:
    transport = httpx.ASGITransport(app=relaying_app(address))
    async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
        response = await client.post(
            "/v1/chat/completions", json={"model": "alias", "stream": True, "script": script}
        )
    assert response.status_code == 200
    return response.json()


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with serving_app(serving_app_of_a_node(), 10.0) as port:
        yield f"127.0.0.1:{port}"


async def test_every_kind_of_event_comes_back_as_it_was_sent(address: str) -> None:
    read = await read_from(address, "whole")
    assert read["error"] is None
    assert read["events"] == [event.model_dump(mode="json") for event in WHOLE]


@pytest.mark.parametrize(
    ("script", "status", "code", "unanswered", "events"),
    [
        # Another replica may take it: nothing of it was sent.
        ("unanswered", 503, "runner_unavailable", True, 1),
        ("busy", 502, "relay_failed", False, 0),
        # A token was sent: the reply cannot run again anywhere.
        ("failed_later", 503, "runner_unavailable", False, 1),
        ("cut", 502, "relay_failed", False, 1),
    ],
)
async def test_a_failure_of_the_serving_node_is_raised_as_what_it_was(
    address: str, script: str, status: int, code: str, unanswered: bool, events: int
) -> None:
    read = await read_from(address, script)
    assert read["error"]["status"] == status
    assert read["error"]["code"] == code
    assert read["error"]["unanswered"] is unanswered
    assert len(read["events"]) == events
    if script == "busy":
        assert "answered 429" in read["error"]["message"]
        assert "the queue is full" in read["error"]["message"]


def test_without_the_header_a_stream_is_the_apis_own_answer(address: str) -> None:
    response = httpx.post(
        f"http://{address}/v1/chat/completions", json={"script": "whole"}, timeout=10
    )
    assert response.text == "the API's own answer"
