"""The relay to the node that serves a model, against a raw TCP server playing
that node: refusing, frozen, going silent mid-stream, or answering a 429."""

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import anyio
import httpx
import pytest
from anyio.abc import SocketStream
from fastapi import FastAPI, Request
from starlette.responses import Response

from exo.api.errors import install_error_handlers
from exo.api.serving import Relay, relay
from exo.shared.types.ids import ModelId
from tests.e2e.node_process import free_port

READ_TIMEOUT = 0.3
Behaviour = Literal["refuses", "frozen", "silent_mid_stream", "silent_mid_line", "busy"]
FIRST_EVENT = b'data: {"choices": []}\n\n'
# An Ollama stream's first line, and half of its second.
FIRST_LINE, HALF_LINE = b'{"done": false}\n', b'{"message": {"cont'
BUSY_BODY = json.dumps({"error": {"message": "busy", "type": "server_error"}}).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _play(behaviour: Behaviour, client: SocketStream) -> None:
    async with client:
        await client.receive()  # the request (or the liveness check)
        if behaviour == "busy":
            await client.send(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                + f"retry-after: 7\r\ncontent-length: {len(BUSY_BODY)}\r\n\r\n".encode()
                + BUSY_BODY
            )
            return
        if behaviour == "silent_mid_stream":
            await client.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + _chunk(FIRST_EVENT)
            )
        if behaviour == "silent_mid_line":
            await client.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + _chunk(FIRST_LINE + HALF_LINE)
            )
        await anyio.sleep_forever()


@asynccontextmanager
async def serving_node(behaviour: Behaviour) -> AsyncIterator[str]:
    """The address of a node that behaves as `behaviour` says."""
    if behaviour == "refuses":
        yield f"127.0.0.1:{free_port()}"  # nothing listens there
        return
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, lambda client: _play(behaviour, client))
        yield f"127.0.0.1:{port}"
        group.cancel_scope.cancel()


def relaying_app(address: str) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    target = Relay(address, ModelId("m"), READ_TIMEOUT)

    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    @app.post("/api/chat")
    async def forward(request: Request) -> Response:
        return await relay(target, request)

    return app


@pytest.mark.parametrize(
    ("behaviour", "path", "status", "body_has", "within"),
    [
        ("refuses", "/v1/chat/completions", 502, '"code": "relay_failed"', 1.0),
        ("frozen", "/v1/chat/completions", 504, '"code": "relay_timeout"', 2 * READ_TIMEOUT + 1),
        ("frozen", "/v1/messages", 504, '"type": "timeout_error"', 2 * READ_TIMEOUT + 1),
        # The status went out with the first event: the error ends the stream.
        ("silent_mid_stream", "/v1/chat/completions", 200, '"code": "relay_timeout"', 2.0),
        ("silent_mid_stream", "/v1/messages", 200, "event: error", 2.0),
        ("busy", "/v1/chat/completions", 429, '"message": "busy"', 1.0),
        ("frozen", "/api/chat", 504, '{"error": "the node serving m', 2 * READ_TIMEOUT + 1),
        ("silent_mid_line", "/api/chat", 200, '{"error": "the node serving m', 2.0),
    ],
)
async def test_relay_outcomes(
    behaviour: Behaviour, path: str, status: int, body_has: str, within: float
) -> None:
    async with serving_node(behaviour) as address:
        transport = httpx.ASGITransport(app=relaying_app(address))
        async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
            started = anyio.current_time()
            response = await client.post(path, json={"model": "alias", "stream": True})
            elapsed = anyio.current_time() - started
    assert response.status_code == status
    assert body_has in response.text.replace('":"', '": "')
    assert elapsed < within
    if behaviour == "silent_mid_stream":
        assert response.content.startswith(FIRST_EVENT)
    if behaviour == "silent_mid_line":
        # The half line is ended, and the error is a line of its own (no blank line).
        first, half, error = response.content.split(b"\n")[:3]
        assert (first + b"\n", half) == (FIRST_LINE, HALF_LINE)
        assert "stopped answering" in json.loads(error)["error"]
        assert response.content.endswith(b"}\n")
    if behaviour == "busy":
        assert response.headers["retry-after"] == "7"
