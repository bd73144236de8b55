"""The API's HTTP server cuts stalled clients: one that takes no bytes of an
answer, one that trickles its headers or body. A real uvicorn server on a
loopback port, real sockets; a slow client that keeps reading is served."""

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from exo.api.http_server import MIN_BODY_BYTES_PER_SECOND, api_server

STALL_SECONDS = 1.0
CHUNK = b"x" * 65536
# Beyond the bound: scheduling on a loaded test machine.
SLACK_SECONDS = 1.5


class Flood:
    """An endless streamed answer; `ended` is set when it stops being read."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.ended_at = 0.0

    async def endpoint(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield CHUNK
                    await asyncio.sleep(0)  # as a generation awaits its tokens
            finally:
                self.ended_at = time.monotonic()
                self.ended.set()

        return StreamingResponse(chunks())


async def echo(request: Request) -> Response:
    return PlainTextResponse(str(len(await request.body())))


@contextmanager
def serving(flood: Flood) -> Iterator[int]:
    """The app on a loopback port, its server in a thread of its own."""
    app = Starlette(
        routes=[Route("/flood", flood.endpoint), Route("/echo", echo, methods=["POST"])]
    )
    with serving_app(app, STALL_SECONDS) as port:
        yield port


@contextmanager
def serving_app(app: ASGIApp, stall_seconds: float) -> Iterator[int]:
    """`app` on a loopback port, served by the API's server in a thread of its own."""
    server = api_server(app, stall_seconds)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    client = socket.socket()
    if receive_buffer is not None:  # before connecting: it sets the TCP window
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.connect(("127.0.0.1", port))
    return client


def closed_by_server(client: socket.socket, within: float) -> bool:
    """Whether the server ends the connection within `within` seconds (what
    was sent before is read and dropped)."""
    client.settimeout(within)
    try:
        while client.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.fixture
def flood() -> Flood:
    return Flood()


def test_a_client_that_takes_no_bytes_is_cut_and_its_answer_ends(flood: Flood) -> None:
    with serving(flood) as port, connect(port, receive_buffer=4096) as client:
        started = time.monotonic()
        client.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        assert flood.ended.wait(STALL_SECONDS + SLACK_SECONDS + 5)
        # The buffers fill at once: the cut comes one stall bound later.
        assert STALL_SECONDS <= flood.ended_at - started < STALL_SECONDS + SLACK_SECONDS
        assert closed_by_server(client, within=5)


def test_a_slow_client_that_keeps_reading_is_served(flood: Flood) -> None:
    with serving(flood) as port, connect(port, receive_buffer=4096) as client:
        client.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        read, until = 0, time.monotonic() + 4 * STALL_SECONDS
        while time.monotonic() < until:  # far slower than the server writes
            read += len(client.recv(16384))
            time.sleep(0.02)
        assert read > 0 and not flood.ended.is_set()


def trickle(client: socket.socket, data: bytes) -> None:
    """Send `data` a byte every 0.1 s, until the server closes the connection."""
    for byte in data:
        try:
            client.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return
        time.sleep(0.1)


def test_headers_sent_a_byte_at_a_time_are_cut(flood: Flood) -> None:
    with serving(flood) as port, connect(port) as client:
        started = time.monotonic()
        trickle(client, b"GET /flood HTTP/1.1\r\nHost: somewhere.example\r\n")
        assert closed_by_server(client, within=STALL_SECONDS + SLACK_SECONDS)
        assert time.monotonic() - started < STALL_SECONDS + SLACK_SECONDS
        assert not flood.ended.is_set()  # no request ever reached the app


def test_a_connection_that_sends_nothing_is_cut(flood: Flood) -> None:
    with serving(flood) as port, connect(port) as client:
        assert closed_by_server(client, within=STALL_SECONDS + SLACK_SECONDS)


def test_a_trickled_body_is_cut_and_one_sent_at_once_is_answered(flood: Flood) -> None:
    body = b"x" * 1000
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with serving(flood) as port:
        with connect(port) as client:
            client.sendall(head)
            started = time.monotonic()
            trickle(client, body[:50])
            assert closed_by_server(client, within=STALL_SECONDS + SLACK_SECONDS)
            allowed = STALL_SECONDS + len(body) / MIN_BODY_BYTES_PER_SECOND
            assert time.monotonic() - started < allowed + SLACK_SECONDS
        with connect(port) as client:
            client.sendall(head + body)
            client.settimeout(5)
            answer = b""
            while not answer.endswith(b"\r\n\r\n1000"):
                answer += client.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
