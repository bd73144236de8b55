"""Pipeline-parallel generation over an `mx.distributed` ring.

Rank r holds layers [start_r, end_r) (see `shard.py`). Every message travels
one way around the ring, from a rank to the next, and the last rank's "next"
is rank 0:

    rank 0 ──► rank 1 ──► … ──► rank N-1 ──┐
      ▲                                     │ (replies: token, acks)
      └─────────────────────────────────────┘

A message is a small int32 header, then an optional payload whose shape and
dtype the header gives. Rank 0 drives: it sends a task (token ids, sampling
parameters, its prefix-cache decision), prefills the prompt in chunks (rank r
works on chunk k while rank r-1 is already on chunk k+1), and for every token
sends one `FORWARD`; the last rank samples and replies with the token. A task
ends with `END` around the ring, which is also how a cancellation reaches every
rank. While idle rank 0 sends a heartbeat around every second.

Prefix cache: every rank caches its own layers' KV of the same entries. Lookups
depend only on the token ids and the order of tasks, so all ranks decide alike
(each checks its decision against rank 0's, sent with the task). After the
first token `STORE` makes every rank store the prompt; evictions are agreed in
rounds of `EVICT` (the union of every rank's victims, gathered around the ring)
and `EVICTED` (handed around again), so no rank keeps an entry another dropped.

Waiting: MLX's ring `recv` busy-polls its socket (on 2 cores a waiting rank
slowed the computing one by ~65%), so a rank first waits in `poll()` on the
socket from its left neighbour, which costs nothing and has a timeout, and
calls `recv` only once bytes have arrived. Senders evaluate a payload before
sending its header, so a receiver never spins while the sender computes.

Failure: when a peer's process dies its sockets close; MLX then raises
`RuntimeError("[ring] connection to a peer was lost")` from the blocked
send/recv (after ten failed socket calls, within milliseconds). A rank that
sees this, or hears nothing within a bound, raises `PeerLost` and its runner
exits, which closes its own sockets, so a failure spreads around the ring.
"""

import json
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass
from enum import IntEnum
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import psutil
from loguru import logger
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from pydantic import BaseModel

from exo.engine.mlx.generate import (
    PREFILL_STEP_TOKENS,
    GenerationCancelled,
    GenerationOutput,
    stream_text,
)
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache, PrefixMatch
from exo.engine.mlx.shard import LayerRange, ShardModel
from exo.shared.types.tasks import GenerationParams

HEARTBEAT_SECONDS = 1.0
# A follower that hears nothing this long while idle (heartbeats come every
# second) concludes rank 0 is gone.
IDLE_SILENCE_SECONDS = 10.0
# Within a task a rank waits for its neighbour's work: a prefill chunk on each
# rank before it, or a whole round of the ring.
STEP_SECONDS = 120.0
# Joining waits for every rank's process to start; the handshake for every rank
# to load its weights.
JOIN_SECONDS = 120.0
LOAD_SECONDS = 600.0
# Between two `poll()` slices a follower checks whether it was asked to stop.
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

    def recv(
        self, timeout: float, interrupt: Callable[[], None] = lambda: None
    ) -> tuple[Header, mx.array | None]:
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
    ) -> tuple[Header, mx.array | None]:
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


def handshake(
    link: RingLink,
    layers: LayerRange,
    cache_on: bool,
    timeout: float = LOAD_SECONDS,
    interrupt: Callable[[], None] = lambda: None,
) -> None:
    """Check that the ranks' layers cover the model in order and that all of them
    cache prefixes or none does; returns once every rank has loaded its shard."""
    mine = Header(Op.HELLO, flag=int(cache_on), value=layers.end, total=layers.total)
    if link.rank == 0:
        if not layers.is_first:
            raise PipelineError(f"rank 0 must start at layer 0, not {layers.start}")
        link.send(mine)
        hello, _ = link.expect(Op.HELLO, timeout, interrupt)
        if hello.value != layers.total:
            raise PipelineError(f"the last rank ends at layer {hello.value} of {layers.total}")
        link.send(Header(Op.START))
        return
    hello, _ = link.recv(timeout, interrupt)
    expected = (Op.HELLO, layers.start, layers.total, int(cache_on))
    if (hello.op, hello.value, hello.total, hello.flag) != expected:
        raise PipelineError(
            f"rank {link.rank} holds layers [{layers.start}, {layers.end}) of {layers.total} "
            f"(prefix cache {'on' if cache_on else 'off'}), but rank {link.left} sent "
            f"{hello.op.name} for layer {hello.value} of {hello.total} "
            f"(prefix cache {'on' if hello.flag else 'off'})"
        )
    if link.is_last and not layers.is_last:
        raise PipelineError(f"the last rank ends at layer {layers.end} of {layers.total}")
    link.send(mine)
    link.expect(Op.START, timeout, interrupt)
    if not link.is_last:
        link.send(Header(Op.START))


class RingEvictionAgreement:
    """The union of every rank's eviction victims, gathered around the ring and then
    handed around again, so each rank drops the same entries (an `EvictionAgreement`)."""

    def __init__(self, link: RingLink) -> None:
        self.link = link

    def __call__(self, victims: list[int]) -> list[int]:
        link = self.link
        if link.rank == 0:
            link.send(*_ids_message(Op.EVICT, victims))
            _, payload = link.expect(Op.EVICT, STEP_SECONDS)
            agreed = _ids(payload)
            link.send(*_ids_message(Op.EVICTED, agreed))
            return agreed
        _, payload = link.expect(Op.EVICT, STEP_SECONDS)
        link.send(*_ids_message(Op.EVICT, sorted(set(_ids(payload)) | set(victims))))
        _, payload = link.expect(Op.EVICTED, STEP_SECONDS)
        agreed = _ids(payload)
        if not link.is_last:
            link.send(*_ids_message(Op.EVICTED, agreed))
        return agreed


def ring_prefix_cache(
    link: RingLink, byte_budget: int, memory_pressure: Callable[[], bool]
) -> KVPrefixCache | None:
    """This rank's prefix cache (None when off), deciding evictions with the others."""
    if byte_budget <= 0:
        return None
    return KVPrefixCache(byte_budget, memory_pressure, agree=RingEvictionAgreement(link))


def _ids_message(op: Op, ids: list[int]) -> tuple[Header, mx.array | None]:
    if not ids:
        return Header(op), None
    payload = mx.array(ids, dtype=mx.int32)
    return Header.for_payload(op, payload), payload


def _ids(payload: mx.array | None) -> list[int]:
    return [] if payload is None else [int(i) for i in cast(list[int], payload.tolist())]


class PipelineTask(BaseModel):
    """What every rank needs to know about a task; rank 0's cache decision included
    so the others can check that they reached the same one."""

    tokens: list[int]
    params: GenerationParams
    system_prompt_length: int
    cached_entry: int | None
    cached_tokens: int

    def to_payload(self) -> mx.array:
        return mx.array(np.frombuffer(self.model_dump_json().encode(), dtype=np.uint8))

    @staticmethod
    def from_payload(payload: mx.array) -> "PipelineTask":
        return PipelineTask.model_validate_json(np.array(payload).tobytes())


def _restore(
    shard: ShardModel, cache: KVPrefixCache | None, match: PrefixMatch
) -> tuple[list[LayerCache], int]:
    """Cache objects holding the matched prefix (fresh ones on a miss), and its length."""
    restored = cache.restore(match) if cache else None
    if restored is None:
        return shard.make_cache(), 0
    return restored, match.usable


class PipelineDriver:
    """Rank 0: runs tasks through the pipeline and turns the tokens into text.

    `generate` has `TextGenerator.generate`'s contract, so the runner uses either."""

    def __init__(
        self,
        link: RingLink,
        shard: ShardModel,
        tokenizer: TokenizerWrapper,
        prefix_cache: KVPrefixCache | None,
        prefill_step_tokens: int = PREFILL_STEP_TOKENS,
    ) -> None:
        if link.rank != 0 or not shard.layer_range.is_first:
            raise PipelineError("the driver runs on rank 0, which holds the first layers")
        self.link = link
        self.shard = shard
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_tokens = prefill_step_tokens

    def _forward(self, tokens: Sequence[int], layers: list[LayerCache], sample: bool) -> int:
        """Send hidden states for `tokens` down the pipeline; with `sample`, wait for
        the token the last rank draws (else -1)."""
        h = self.shard.forward(self.shard.embed(mx.array(list(tokens))[None]), layers)
        self.link.send(Header.for_payload(Op.FORWARD, h, flag=int(sample)), h)
        if not sample:
            return -1
        reply, _ = self.link.expect(Op.TOKEN, STEP_SECONDS)
        return reply.value

    def generate(
        self,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        is_cancelled: Callable[[], bool] = lambda: False,
        on_progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> Iterator[GenerationOutput]:
        if not tokens:
            raise ValueError("the prompt has no tokens")
        cache = self.prefix_cache
        match = cache.lookup(tokens) if cache else PrefixMatch(None, 0, len(tokens))
        task = PipelineTask(
            tokens=list(tokens),
            params=params,
            system_prompt_length=system_prompt_length,
            cached_entry=match.entry_id,
            cached_tokens=match.usable,
        )
        payload = task.to_payload()
        self.link.send(Header.for_payload(Op.TASK, payload), payload)
        try:
            layers, done = _restore(self.shard, cache, match)
            total = len(tokens) - 1
            on_progress(done, total)
            while done < total:
                if is_cancelled():
                    raise GenerationCancelled
                chunk = tokens[done : min(done + self.prefill_step_tokens, total)]
                self._forward(chunk, layers, sample=False)
                done += len(chunk)
                on_progress(done, total)
            first = self._forward(tokens[-1:], layers, sample=True)
            steps = self._decode(first, task, layers, match)
            yield from stream_text(self.tokenizer, steps, params, len(tokens), match, is_cancelled)
        finally:
            if not self.link.broken:
                self.link.send(Header(Op.END))
                self.link.expect(Op.END, STEP_SECONDS)

    def _decode(
        self, first: int, task: PipelineTask, layers: list[LayerCache], match: PrefixMatch
    ) -> Iterator[int]:
        """The first token, then the rest; the prompt's KV is stored on every rank
        once the first token is out (off the TTFT path), as `TextGenerator` does."""
        yield first
        if self.prefix_cache is not None:
            self.link.send(Header(Op.STORE))
            self.prefix_cache.store(task.tokens, layers, match, task.system_prompt_length)
        token = first
        for _ in range(task.params.max_tokens - 1):
            token = self._forward([token], layers, sample=True)
            yield token

    def keep_alive(self) -> None:
        """Heartbeat around the ring unless it carried something within the last second."""
        if time.monotonic() - self.link.last_activity >= HEARTBEAT_SECONDS:
            self.link.send(Header(Op.HEARTBEAT))
            self.link.expect(Op.HEARTBEAT, IDLE_SILENCE_SECONDS)

    def shutdown(self) -> None:
        """Stop every rank; returns once the last one has it (bounded)."""
        if self.link.broken:
            return
        self.link.send(Header(Op.SHUTDOWN))
        self.link.expect(Op.SHUTDOWN, IDLE_SILENCE_SECONDS)


@dataclass
class _FollowerTask:
    task: PipelineTask
    match: PrefixMatch
    layers: list[LayerCache]
    sampler: Callable[[mx.array], mx.array]


class PipelineFollower:
    """Ranks 1..N-1: run their layers on whatever rank 0 sends until it shuts down."""

    def __init__(
        self, link: RingLink, shard: ShardModel, prefix_cache: KVPrefixCache | None
    ) -> None:
        if link.rank == 0:
            raise PipelineError("rank 0 drives the pipeline; followers are ranks 1..N-1")
        self.link = link
        self.shard = shard
        self.prefix_cache = prefix_cache
        self._task: _FollowerTask | None = None

    def serve(
        self,
        interrupt: Callable[[], None] = lambda: None,
        on_task_start: Callable[[], None] = lambda: None,
        on_task_end: Callable[[], None] = lambda: None,
    ) -> None:
        """Process messages until `SHUTDOWN`. `interrupt` is called while waiting
        and may raise to stop (the runner's stdin asked it to)."""
        while True:
            timeout = STEP_SECONDS if self._task else IDLE_SILENCE_SECONDS
            header, payload = self.link.recv(timeout, interrupt)
            if header.op in (Op.HEARTBEAT, Op.SHUTDOWN, Op.END):
                self.link.send(header)  # onwards; from the last rank, the ack to rank 0
                if header.op == Op.SHUTDOWN:
                    return
                if header.op == Op.END:
                    self._task = None
                    on_task_end()
            elif header.op == Op.TASK and payload is not None and self._task is None:
                if not self.link.is_last:
                    self.link.send(header, payload)
                self._start(PipelineTask.from_payload(payload))
                on_task_start()
            elif header.op == Op.FORWARD and payload is not None and self._task:
                self._forward(header, payload, self._task)
            elif header.op == Op.STORE and self._task and self.prefix_cache is not None:
                if not self.link.is_last:
                    self.link.send(header)
                task = self._task
                self.prefix_cache.store(
                    task.task.tokens, task.layers, task.match, task.task.system_prompt_length
                )
            else:
                raise PipelineError(f"unexpected {header.op.name} from rank {self.link.left}")

    def _start(self, task: PipelineTask) -> None:
        cache = self.prefix_cache
        match = cache.lookup(task.tokens) if cache else PrefixMatch(None, 0, len(task.tokens))
        if (match.entry_id, match.usable) != (task.cached_entry, task.cached_tokens):
            raise PipelineError(
                f"prefix caches diverged: rank 0 reuses {task.cached_tokens} tokens of entry "
                f"{task.cached_entry}, rank {self.link.rank} {match.usable} of {match.entry_id}"
            )
        layers, _ = _restore(self.shard, cache, match)
        if task.params.seed is not None:
            mx.random.seed(task.params.seed)
        sampler = make_sampler(temp=task.params.temperature, top_p=task.params.top_p)
        self._task = _FollowerTask(task, match, layers, sampler)

    def _forward(self, header: Header, h: mx.array, task: _FollowerTask) -> None:
        h = self.shard.forward(h, task.layers)
        if not self.link.is_last:
            self.link.send(header, h)
        elif header.flag:
            logits = self.shard.logits(h)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = cast(int, task.sampler(logprobs).item())
            self.link.send(Header(Op.TOKEN, value=token))
        else:
            mx.eval([layer.state for layer in task.layers])
