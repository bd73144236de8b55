"""The API's HTTP server: uvicorn, with the timeouts its HTTP/1.1 protocol lacks.

uvicorn waits as long as a client likes: for headers or a body sent a byte a
second, and for a client that stops reading an answer (the answer then waits
on a full socket buffer, and a streamed generation holds its slot for as long
as the connection stays open). Each connection here is cut (closed at once,
what was still to be sent dropped) when
- a request's headers are not complete `client_stall_seconds` after the
  connection opened, or after the request's first byte;
- its body comes slower than `MIN_BODY_BYTES_PER_SECOND`, beyond a first
  `client_stall_seconds`;
- the client has taken no bytes of the answer for `client_stall_seconds`
  while the answer waits for it: the buffers between them, kept small
  (`SEND_BUFFER_BYTES`, `WRITE_BUFFER_BYTES`), are full.
A cut connection is a client that left: its generation is cancelled and its
slot freed, as for any client that goes away.
"""

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar

import h11
import uvicorn
from loguru import logger
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_CLIENT_STALL_SECONDS = 30.0
# Slower than this a body is trickled: a 32 MiB body may take 8 minutes.
MIN_BODY_BYTES_PER_SECOND = 64 * 1024
# What may wait for one client, in the kernel's send buffer (autotuned, it
# grows to megabytes) and in the server's own: it bounds what a stalled client
# holds and how long its stall takes to show (a stream of tokens fills a few
# KB a second). A LAN's round trip needs far less to keep a client busy.
SEND_BUFFER_BYTES = 32 * 1024
WRITE_BUFFER_BYTES = 16 * 1024
# How long a shut-down server waits for its connections' requests to end.
GRACEFUL_SHUTDOWN_SECONDS = 5


class _TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the read and write timeouts above."""

    stall_seconds: ClassVar[float]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._body_since: float | None = None  # when the current request's body began
        self._body_bytes = 0
        self._unsent = 0  # bytes waiting for the client when the write timer was armed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # pyright: ignore[reportArgumentType]
        sock: socket.socket | None = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        assert isinstance(transport, asyncio.WriteTransport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self._expect_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._read_timer is None:
            self._expect_headers()  # the next request of a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            if self._body_since is None:
                self._body_since, self._body_bytes = time.monotonic(), 0
                self._arm_read(self.stall_seconds, self._body_late)
            self._body_bytes += len(data)
        elif self.conn.their_state is not h11.IDLE:  # the request is in
            self._stop_read_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unsent = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.stall_seconds, self._write_stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _expect_headers(self) -> None:
        self._arm_read(self.stall_seconds, self._headers_late)

    def _arm_read(self, delay: float, on_timeout: Callable[[], None]) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(delay, on_timeout)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._body_since = None

    def _headers_late(self) -> None:
        self._cut(f"sent no complete request headers in {self.stall_seconds:g}s")

    def _body_late(self) -> None:
        assert self._body_since is not None
        allowed = self.stall_seconds + self._body_bytes / MIN_BODY_BYTES_PER_SECOND
        left = self._body_since + allowed - time.monotonic()
        if left > 0:  # the bytes that came meanwhile bought time
            self._arm_read(left, self._body_late)
        else:
            self._cut(
                f"sent {self._body_bytes} bytes of its request body in {allowed:.0f}s "
                f"(slower than {MIN_BODY_BYTES_PER_SECOND} bytes/s)"
            )

    def _write_stalled(self) -> None:
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # slow, but reading
            self._unsent = unsent
            self._write_timer = self.loop.call_later(self.stall_seconds, self._write_stalled)
            return
        self._write_timer = None
        self._cut(f"took no bytes of the answer for {self.stall_seconds:g}s")

    def _cut(self, why: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.warning(f"cut the connection of {client}: it {why}")
        self.transport.abort()


def api_server(app: ASGIApp, client_stall_seconds: float) -> uvicorn.Server:
    """A server of `app` that cuts clients stalled for `client_stall_seconds`."""
    protocol = type(
        "TimedH11Protocol", (_TimedH11Protocol,), {"stall_seconds": client_stall_seconds}
    )
    config = uvicorn.Config(
        app,
        http=protocol,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    return uvicorn.Server(config)
