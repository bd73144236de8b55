"""The ring a pipeline's ranks talk over: its messages and the link between neighbours.

Rank r receives from rank r-1 and sends to rank r+1 over an `mx.distributed`
ring group; the last rank sends to rank 0. A message is a small int32 `Header`,
then an optional payload whose shape and dtype the header gives: hidden states
(1, tokens, hidden), ids (tokens or cache entries), a task as JSON bytes, or a
sampled token's log-probabilities (int32, the floats' bits: exact).
Which messages go when is the pipeline's protocol (`pipeline.py`).

Waiting: MLX's ring `recv` busy-polls its socket (on 2 cores a waiting rank
slowed the computing one by ~65%), so a rank first waits in `poll()` on the
socket from its left neighbour, which costs nothing and has a timeout, and
calls `recv` only once bytes have arrived. Senders evaluate a payload before
sending its header, so a receiver never spins while the sender computes.

Failure: when a peer's process dies its sockets close; MLX then raises
`RuntimeError("[ring] connection to a peer was lost")` from the blocked
send/recv (after ten failed socket calls, within milliseconds). A rank that
sees this, or hears nothing within a bound, raises `PeerLost`.
"""

import json
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from enum import IntEnum
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import psutil
from loguru import logger
from pydantic import BaseModel

from exo.engine.mlx.sampling import SampledToken
from exo.shared.types.tasks import GenerationParams, TokenAlternative

# Joining waits for every rank's process to start.
JOIN_SECONDS = 120.0
# Between two `poll()` slices a waiting rank checks whether it was asked to stop.
_POLL_SLICE_SECONDS = 0.25


class PipelineFailure(RuntimeError):
    """The group cannot go on; every rank's runner exits."""


class PeerLost(PipelineFailure):
    """A rank left the group: its connection closed, or it went silent too long."""


class PipelineError(PipelineFailure):
    """The ranks disagree (layers, cache decisions or message order): a bug or a
    misconfigured instance, never a request's fault."""


class Op(IntEnum):
    HELLO = 1
    START = 2
    HEARTBEAT = 3
    TASK = 4
    FORWARD = 5
    TOKEN = 6
    STORE = 7
    EVICT = 8
    EVICTED = 9
    END = 10
    SHUTDOWN = 11


_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8)


@dataclass(frozen=True)
class Header:
    op: Op
    count: int = 0  # payload rows: tokens, bytes or entry ids (0: no payload)
    width: int = 0  # payload row width, the hidden size (0: a flat payload)
    dtype: int = 0  # payload dtype, an index into _DTYPES
    flag: int = 0  # FORWARD: the last rank samples; HELLO: a prefix cache is on
    value: int = 0  # TOKEN: the token id; HELLO: the layer the next rank starts at
    total: int = 0  # HELLO: the model's layer count

    @staticmethod
    def for_payload(op: Op, payload: mx.array, flag: int = 0) -> "Header":
        width = payload.shape[-1] if payload.ndim == 3 else 0
        count = payload.shape[1] if payload.ndim == 3 else payload.size
        return Header(op, count=count, width=width, dtype=_DTYPES.index(payload.dtype), flag=flag)

    def payload_shape(self) -> tuple[int, ...]:
        return (1, self.count, self.width) if self.width else (self.count,)


_HEADER_SIZE = len(astuple(Header(Op.HELLO)))

Message = tuple[Header, mx.array | None]


def ids_message(op: Op, ids: list[int]) -> Message:
    if not ids:
        return Header(op), None
    payload = mx.array(ids, dtype=mx.int32)
    return Header.for_payload(op, payload), payload


def ids_of(payload: mx.array | None) -> list[int]:
    return [] if payload is None else [int(i) for i in cast(list[int], payload.tolist())]


def token_message(sampled: SampledToken) -> Message:
    """`TOKEN`: the id in the header; when logprobs were asked for, a payload of
    the logprob, then (id, logprob) per alternative, floats as their bits."""
    if sampled.logprob is None:
        return Header(Op.TOKEN, value=sampled.token), None
    logprobs = [sampled.logprob, *(alt.logprob for alt in sampled.top_logprobs)]
    bits = np.array(logprobs, dtype=np.float32).view(np.int32)
    row = [int(bits[0])]
    for alt, alt_bits in zip(sampled.top_logprobs, bits[1:], strict=True):
        row += [alt.token, int(alt_bits)]
    payload = mx.array(row, dtype=mx.int32)
    return replace(Header.for_payload(Op.TOKEN, payload), value=sampled.token), payload


def sampled_of(header: Header, payload: mx.array | None) -> SampledToken:
    """The token a `TOKEN` message carries (`token_message`'s inverse)."""
    if payload is None:
        return SampledToken(header.value, None, ())
    row = np.array(payload, dtype=np.int32)
    logprobs = row[0::2].copy().view(np.float32).tolist()
    ids = row[1::2].tolist()
    top = tuple(
        TokenAlternative(token=int(t), logprob=float(lp))
        for t, lp in zip(ids, logprobs[1:], strict=True)
    )
    return SampledToken(header.value, float(logprobs[0]), top)


class PipelineTask(BaseModel):
    """A `TASK`'s payload: what every rank needs to know about a task; rank 0's
    cache decision included so the others can check that they reached the same one."""

    tokens: list[int]
    params: GenerationParams
    system_prompt_length: int
    cached_entry: int | None
    cached_tokens: int

    def message(self) -> Message:
        payload = mx.array(np.frombuffer(self.model_dump_json().encode(), dtype=np.uint8))
        return Header.for_payload(Op.TASK, payload), payload

    @staticmethod
    def from_payload(payload: mx.array) -> "PipelineTask":
        return PipelineTask.model_validate_json(np.array(payload).tobytes())


class RingLink:
    """Messages from the left neighbour and to the right one, with bounded waits."""

    def __init__(self, group: mx.distributed.Group, left_fd: int | None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.left = (self.rank - 1) % self.size
        self.right = (self.rank + 1) % self.size
        self._left_fd = left_fd
        self.broken = False
        self.last_activity = time.monotonic()

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def _ring(self, arrays: list[mx.array]) -> None:
        try:
            for array in arrays:  # one at a time: their order on the wire matters
                mx.eval(array)
        except RuntimeError as error:
            self.broken = True
            raise PeerLost(f"a rank left the pipeline group ({error})") from error
        self.last_activity = time.monotonic()

    def send(self, header: Header, payload: mx.array | None = None) -> None:
        if payload is not None:
            mx.eval(payload)  # computed before the header goes: the receiver then never spins
        arrays = [mx.array(astuple(header), dtype=mx.int32)]
        if payload is not None and header.count:
            arrays.append(payload)
        self._ring([mx.distributed.send(a, self.right, group=self.group) for a in arrays])

    def recv(self, timeout: float, interrupt: Callable[[], None] = lambda: None) -> Message:
        self._wait_readable(timeout, interrupt)
        raw = mx.distributed.recv((_HEADER_SIZE,), mx.int32, self.left, group=self.group)
        self._ring([raw])
        fields = [int(v) for v in cast(list[int], raw.tolist())]
        try:
            header = Header(Op(fields[0]), *fields[1:])
        except ValueError as error:
            raise PipelineError(f"unreadable message header {fields}") from error
        if not header.count:
            return header, None
        payload = mx.distributed.recv(
            header.payload_shape(), _DTYPES[header.dtype], self.left, group=self.group
        )
        self._ring([payload])
        return header, payload

    def expect(
        self, op: Op, timeout: float, interrupt: Callable[[], None] = lambda: None
    ) -> Message:
        header, payload = self.recv(timeout, interrupt)
        if header.op != op:
            raise PipelineError(f"expected {op.name} from rank {self.left}, got {header.op.name}")
        return header, payload

    def _wait_readable(self, timeout: float, interrupt: Callable[[], None]) -> None:
        if self._left_fd is None:
            return  # no socket to watch: MLX's recv waits (and sees a peer's death) itself
        poller = select.poll()
        poller.register(self._left_fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = True
                raise PeerLost(
                    f"a rank left the pipeline group (rank {self.left} sent nothing for {timeout:.0f}s)"
                )
            if poller.poll(min(left, _POLL_SLICE_SECONDS) * 1000):
                return
            interrupt()


def _left_socket_fd(own_address: str, right_address: str) -> int | None:
    """The socket MLX's ring accepted from the left neighbour (it receives on it):
    the connection on this rank's own port that is not the one to the right."""
    port = int(own_address.rsplit(":", 1)[1])
    right_host, right_port = right_address.rsplit(":", 1)
    for conn in psutil.Process().net_connections(kind="tcp"):
        if not (conn.laddr and conn.raddr and conn.fd >= 0 and conn.laddr.port == port):
            continue
        if (conn.raddr.ip, conn.raddr.port) != (right_host, int(right_port)):
            return conn.fd
    return None


def join_ring(timeout: float = JOIN_SECONDS) -> RingLink:
    """Join the ring group named by `MLX_HOSTFILE` and `MLX_RANK` (MLX reads them).

    MLX's connecting side gives up after ~30 s and its accepting side waits
    forever, so the join runs in a thread that retries, and gives up at `timeout`."""
    hostfile, rank = Path(os.environ["MLX_HOSTFILE"]), int(os.environ["MLX_RANK"])
    addresses: list[list[str]] = json.loads(hostfile.read_text())
    if len(addresses) < 2 or not 0 <= rank < len(addresses):
        raise PipelineError(f"rank {rank} of a {len(addresses)}-rank hostfile: not a pipeline")
    if len(addresses[rank]) != 1:
        raise PipelineError("each rank must have exactly one address in the hostfile")
    deadline = time.monotonic() + timeout
    joined: list[mx.distributed.Group] = []
    errors: list[Exception] = []

    def attempt() -> None:
        while not joined and time.monotonic() < deadline:
            try:
                joined.append(mx.distributed.init(strict=True, backend="ring"))
            except RuntimeError as error:
                errors[:] = [error]
                logger.debug(f"joining the ring: {error}; retrying")
                time.sleep(1.0)

    thread = threading.Thread(target=attempt, name="ring-join", daemon=True)
    thread.start()
    thread.join(timeout)
    if not joined:
        reason = f": {errors[-1]}" if errors else ""
        raise PeerLost(f"could not join the pipeline group within {timeout:.0f}s{reason}")
    group = joined[0]
    left_fd = _left_socket_fd(addresses[rank][0], addresses[(rank + 1) % len(addresses)][0])
    if left_fd is None:
        logger.warning("ring socket not found: waits rely on MLX alone (busy, unbounded)")
    return RingLink(group, left_fd)
