"""The ring a split instance's ranks talk over: its messages and the link between
neighbours.

Rank r receives from rank r-1 and sends to rank r+1 over an `mx.distributed`
ring group; the last rank sends to rank 0. A message is a small int32 `Header`,
then an optional payload whose shape and dtype the header gives: hidden states
(rows, tokens, hidden), ids (cache entries), a task or an error as JSON or text
bytes, disk entry keys (16 bytes each), or a sampled token's log-probabilities
(int32, the floats' bits: exact). Which messages go when: `ring_agreements.py`
(start, prefix cache, disk), `lockstep.py` (requests) and `pipeline.py`
(forward passes and tokens). Tensor ranks' `all_sum`s share the ring's group.

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

import hashlib
import json
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from enum import IntEnum
from pathlib import Path
from typing import Protocol, cast

import mlx.core as mx
import numpy as np
import psutil
from loguru import logger
from pydantic import BaseModel

from exo.engine.mlx.sampling import SampledToken
from exo.shared.types.tasks import TokenAlternative

# Joining waits for every rank's process to start.
JOIN_SECONDS = 120.0
# Before MLX's ring forms the ranks meet on their own ring ports (`_meet`): a rank
# tries its right neighbour's port this often until that rank's process is there.
_MEET_RETRY_SECONDS = 0.05
# The last rank calls `mx.distributed.init` this long after the go reached it, so
# that rank 0, which called init as it sent the go, is listening by then.
_LAST_RANK_DELAY_SECONDS = 0.1
_MEET_MAGIC = b"exo-ring"
# A connection to a rank's port must say hello within this long (else it is not
# its left neighbour's).
_HELLO_SECONDS = 5.0
_GO = b"g"
# Between two `poll()` slices a waiting rank checks whether it was asked to stop.
_POLL_SLICE_SECONDS = 0.25


class PipelineFailure(BaseException):
    """The group cannot go on; every rank's runner exits. A `BaseException`, as
    `StopRequested` is: no handler of a failed request (`except Exception`)
    takes it for the request's own failure."""


class PeerLost(PipelineFailure):
    """A rank left the group: its connection closed, or it went silent too long."""


class PipelineError(PipelineFailure):
    """The ranks disagree (layers, cache decisions or message order): a bug or a
    misconfigured instance, never a request's fault."""


class Op(IntEnum):
    HELLO = 1
    START = 2
    HEARTBEAT = 3
    FORWARD = 5
    TOKEN = 6
    EVICT = 8
    EVICTED = 9
    SHUTDOWN = 11
    DISK_KEYS = 12
    DISK_AGREED = 13
    LOAD = 14
    LOADED = 15
    PERSIST = 16
    # Tensor ranks in lockstep (`lockstep.py`): what rank 0's serving loop does.
    ADD = 17
    ADDED = 18
    CANCEL = 19
    STEP = 20
    DECIDE = 21
    # Memory admission on a split instance (`worker/runner/memory_admission.py`).
    ADMIT = 22
    SPILL = 23


_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8)


@dataclass(frozen=True)
class Header:
    op: Op
    count: int = 0  # payload rows: tokens, bytes or entry ids (0: no payload)
    width: int = 0  # payload row width, the hidden size (0: a flat payload)
    dtype: int = 0  # payload dtype, an index into _DTYPES
    # HELLO: a prefix cache is on (1), with a disk tier on every rank so far (2),
    # checkpoints needed (4); START: a disk tier on every rank (1), entries restore
    # only at their ends (2); LOAD/LOADED: every rank so far can read the entry /
    # all of them can; TOKEN: the draw failed (the payload says why); ADDED, DECIDE:
    # rank 0's answer
    flag: int = 0
    # TOKEN: the token id; HELLO: the layer the next rank starts at; SPILL: how
    # many least recently used prefix-cache entries every rank moves out of memory
    value: int = 0
    total: int = 0  # HELLO: the model's layer count
    rows: int = 0  # hidden states: the batch's rows (requests)

    @staticmethod
    def for_payload(op: Op, payload: mx.array, flag: int = 0) -> "Header":
        hidden = payload.ndim == 3  # (rows, tokens, hidden size)
        return Header(
            op,
            count=payload.shape[1] if hidden else payload.size,
            width=payload.shape[-1] if hidden else 0,
            dtype=_DTYPES.index(payload.dtype),
            flag=flag,
            rows=payload.shape[0] if hidden else 0,
        )

    def payload_shape(self) -> tuple[int, ...]:
        return (self.rows, self.count, self.width) if self.width else (self.count,)


_HEADER_SIZE = len(astuple(Header(Op.HELLO)))

Message = tuple[Header, mx.array | None]


def ids_message(op: Op, ids: list[int]) -> Message:
    if not ids:
        return Header(op), None
    payload = mx.array(ids, dtype=mx.int32)
    return Header.for_payload(op, payload), payload


def ids_of(payload: mx.array | None) -> list[int]:
    return [] if payload is None else [int(i) for i in cast(list[int], payload.tolist())]


_KEY_BYTES = 16


def keys_message(op: Op, keys: set[str]) -> Message:
    """Disk entry keys (`prefix_cache_disk.entry_key`: 32 hex digits) as bytes."""
    if not keys:
        return Header(op), None
    raw = b"".join(bytes.fromhex(key) for key in sorted(keys))
    payload = mx.array(np.frombuffer(raw, dtype=np.uint8))
    return Header.for_payload(op, payload), payload


def keys_of(payload: mx.array | None) -> set[str]:
    if payload is None:
        return set()
    raw = np.array(payload, dtype=np.uint8).tobytes()
    if len(raw) % _KEY_BYTES:
        raise PipelineError(f"a key list of {len(raw)} bytes")
    return {raw[i : i + _KEY_BYTES].hex() for i in range(0, len(raw), _KEY_BYTES)}


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


def json_message(op: Op, content: BaseModel) -> Message:
    return raw_message(op, content.model_dump_json().encode())


def raw_message(op: Op, content: bytes) -> Message:
    payload = mx.array(np.frombuffer(content, dtype=np.uint8))
    return Header.for_payload(op, payload), payload


def expected(op: Op, message: Message, left: int) -> Message:
    """`message` from rank `left`, which must be an `op` (else `PipelineError`)."""
    header, _ = message
    if header.op != op:
        raise PipelineError(f"expected {op.name} from rank {left}, got {header.op.name}")
    return message


class Link(Protocol):
    """What the pipeline's protocol needs of the link to its neighbours."""

    rank: int
    size: int
    left: int
    broken: bool  # a peer is lost: nothing more goes through
    last_activity: float  # monotonic time of the last message in or out

    @property
    def is_last(self) -> bool: ...

    def send(self, header: Header, payload: mx.array | None = None) -> None:
        """To the right neighbour; a payload is computed before anything goes."""
        ...

    def recv(self, timeout: float, interrupt: Callable[[], None] = lambda: None) -> Message:
        """The next message from the left neighbour; `PeerLost` after `timeout`
        seconds of silence. `interrupt` is called while waiting and may raise."""
        ...

    def expect(
        self, op: Op, timeout: float, interrupt: Callable[[], None] = lambda: None
    ) -> Message:
        """`recv`, which must bring `op` (else `PipelineError`)."""
        ...


class RingLink:
    """`Link` over an `mx.distributed` ring group: messages from the left neighbour
    and to the right one, with bounded waits."""

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
        return expected(op, self.recv(timeout, interrupt), self.left)

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


def _socket_address(address: str) -> tuple[socket.AddressFamily, tuple[str, int]]:
    host, port = address.rsplit(":", 1)
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_STREAM
    )[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


def _wait_for(sock: socket.socket, deadline: float, interrupt: Callable[[], None]) -> None:
    """Until `sock` is readable (or acceptable); `TimeoutError` at `deadline`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("nobody came")
        if select.select([sock], [], [], min(left, _POLL_SLICE_SECONDS))[0]:
            return
        interrupt()


def _recv_exactly(
    sock: socket.socket, size: int, deadline: float, interrupt: Callable[[], None]
) -> bytes:
    data = b""
    while len(data) < size:
        _wait_for(sock, deadline, interrupt)
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return data


def _connect(address: str, deadline: float, interrupt: Callable[[], None]) -> socket.socket:
    """A connection to `address`, tried again every `_MEET_RETRY_SECONDS` until its
    rank listens there."""
    family, target = _socket_address(address)
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            sock.connect(target)
            sock.settimeout(None)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() + _MEET_RETRY_SECONDS >= deadline:
                raise
        interrupt()
        time.sleep(_MEET_RETRY_SECONDS)


def _meet(addresses: list[str], rank: int, deadline: float, interrupt: Callable[[], None]) -> None:
    """Return when this rank may call `mx.distributed.init`, once every rank is there.

    MLX's ring forms by rank 0 accepting from the last rank and then connecting to
    rank 1, and so on around; the last rank connects first. Where its peer does not
    listen yet, MLX's connecting side backs off 1, 2, 4, 8 and 16 s (seconds lost
    whenever ranks start a little apart), and its accepting side waits forever
    holding the GIL. So first each rank listens on its own ring port, connects to
    its right neighbour's (retrying quickly) and accepts its left neighbour: every
    rank is there. Then a go travels around from rank 0; each rank passes it on and
    calls init at once (listening for its left neighbour); the last rank waits
    `_LAST_RANK_DELAY_SECONDS` more and connects to rank 0, which listens by then."""
    size = len(addresses)
    token = _MEET_MAGIC + hashlib.sha256(json.dumps(addresses).encode()).digest()[:8]
    family, own = _socket_address(addresses[rank])
    sockets: list[socket.socket] = []
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
        sockets.append(listener)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        while True:
            try:
                listener.bind(own)
                break
            except OSError:  # a stopped runner's socket may hold the port a moment longer
                if time.monotonic() + _MEET_RETRY_SECONDS >= deadline:
                    raise
                interrupt()
                time.sleep(_MEET_RETRY_SECONDS)
        listener.listen(size)
        right = _connect(addresses[(rank + 1) % size], deadline, interrupt)
        sockets.append(right)
        right.sendall(token + bytes([rank]))
        while True:  # anything but the left neighbour's hello is ignored
            _wait_for(listener, deadline, interrupt)
            left, _ = listener.accept()
            sockets.append(left)
            try:
                soon = min(deadline, time.monotonic() + _HELLO_SECONDS)
                hello = _recv_exactly(left, len(token) + 1, soon, interrupt)
            except (OSError, TimeoutError):
                hello = b""
            if hello == token + bytes([(rank - 1) % size]):
                break
            left.close()
        listener.close()  # MLX listens on this port next
        if rank > 0 and _recv_exactly(left, len(_GO), deadline, interrupt) != _GO:
            raise ConnectionError("an unexpected message")
        if rank < size - 1:
            right.sendall(_GO)
        else:
            time.sleep(_LAST_RANK_DELAY_SECONDS)
    except (OSError, TimeoutError) as error:
        raise PeerLost(f"the pipeline's ranks did not all come ({error})") from error
    finally:
        for sock in sockets:
            sock.close()


def join_ring(
    timeout: float = JOIN_SECONDS, interrupt: Callable[[], None] = lambda: None
) -> RingLink:
    """Join the ring group named by `MLX_HOSTFILE` and `MLX_RANK` (MLX reads them),
    once every rank is there (`_meet`), giving up at `timeout`; `interrupt` is
    called while waiting."""
    hostfile, rank = Path(os.environ["MLX_HOSTFILE"]), int(os.environ["MLX_RANK"])
    addresses: list[list[str]] = json.loads(hostfile.read_text())
    if len(addresses) < 2 or not 0 <= rank < len(addresses):
        raise PipelineError(f"rank {rank} of a {len(addresses)}-rank hostfile: not a pipeline")
    if any(len(address) != 1 for address in addresses):
        raise PipelineError("each rank must have exactly one address in the hostfile")
    ring = [address[0] for address in addresses]
    _meet(ring, rank, time.monotonic() + timeout, interrupt)
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as error:
        raise PeerLost(f"could not join the pipeline group: {error}") from error
    left_fd = _left_socket_fd(ring[rank], ring[(rank + 1) % len(ring)])
    if left_fd is None:
        logger.warning("ring socket not found: waits rely on MLX alone (busy, unbounded)")
    return RingLink(group, left_fd)
