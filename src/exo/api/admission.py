"""Admission control: how many requests a served model takes at once, how many
wait, for how long, and how large a request body may be.

Per model this node serves, at most `max_concurrent` generations are in flight on
its runner (the runner's batch; rank 0 of a pipeline takes them in turn) and at
most `max_queued` more wait here, first come first served. A request beyond
both is refused at once with a 429 and `Retry-After`; one that waits longer
than `queue_timeout_seconds` gets a 503. A slot is held for the
whole generation, streaming included, and released when it finishes, fails or
its client goes away; whatever a request still holds when its HTTP exchange
ends is released then (`AdmissionMiddleware`), so no path can leak a slot.

Bodies are limited before anything parses them (`BodyLimitMiddleware`): by
`Content-Length` when given, and by counting the bytes as they arrive.
"""

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

import anyio
from loguru import logger
from pydantic import Field
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.errors import APIError, error_response
from exo.api.serving import until_disconnect
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId

DEFAULT_MAX_CONCURRENT = 8
DEFAULT_MAX_QUEUED = 32
DEFAULT_QUEUE_TIMEOUT_SECONDS = 120.0
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Retry-After bounds: at least a second (the header counts whole seconds), at
# most a minute (a client should look again rather than give up).
RETRY_AFTER_MIN_SECONDS = 1
RETRY_AFTER_MAX_SECONDS = 60
# Weight of the newest generation in the mean time a slot is held (and in the
# mean rate a request's prompt is prefilled at).
HOLD_TIME_SMOOTHING = 0.2


class AdmissionLimits(FrozenModel):
    max_concurrent: int = Field(default=DEFAULT_MAX_CONCURRENT, ge=1)
    max_queued: int = Field(default=DEFAULT_MAX_QUEUED, ge=0)
    queue_timeout_seconds: float = Field(default=DEFAULT_QUEUE_TIMEOUT_SECONDS, gt=0)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1)


AdmissionDecision = Literal["run", "queue", "reject"]


def admission_decision(running: int, queued: int, limits: AdmissionLimits) -> AdmissionDecision:
    """What a new request does, given what the model is doing. Nobody overtakes
    the queue: a free slot goes to the first waiter."""
    if running < limits.max_concurrent and queued == 0:
        return "run"
    if queued < limits.max_queued:
        return "queue"
    return "reject"


def retry_after_seconds(mean_hold_seconds: float | None, max_concurrent: int) -> int:
    """When a refused request should try again: a slot (and so a place in the
    queue) frees about every mean-hold-time / max_concurrent seconds."""
    if mean_hold_seconds is None:
        return RETRY_AFTER_MIN_SECONDS
    estimate = math.ceil(mean_hold_seconds / max_concurrent)
    return max(RETRY_AFTER_MIN_SECONDS, min(RETRY_AFTER_MAX_SECONDS, estimate))


class Slot:
    """A place in a model's batch; `release` is idempotent."""

    def __init__(self, gate: "ModelGate | None") -> None:
        self._gate = gate
        self._since = time.monotonic()
        self._first_token: float | None = None

    def first_token(self) -> None:
        """The reply's first token came (its prompt is prefilled): the first call counts."""
        if self._first_token is None:
            self._first_token = time.monotonic()

    def prefilled(self, tokens: int) -> None:
        """The reply ended having prefilled `tokens` of its prompt (those not cached)."""
        if self._gate is not None and self._first_token is not None and tokens > 0:
            self._gate.prefilled(tokens, self._first_token - self._since)

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release(time.monotonic() - self._since)


UNLIMITED = Slot(None)  # outside an app with admission control (a tool, a test)


@dataclass
class ModelGate:
    """The slots and the queue of one served model."""

    model_id: ModelId
    limits: AdmissionLimits
    running: int = 0
    mean_hold_seconds: float | None = None
    # Prompt tokens a request in a slot is prefilled at, a second (its uncached
    # tokens over the time from its slot to its first token).
    prefill_tokens_per_second: float | None = None
    # Told the load (running + queued) whenever it changes, with the waiting
    # cost (`wait_tokens`) as it is then.
    on_load: Callable[[ModelId, int, int | None], None] = lambda model_id, load, wait: None
    _waiters: deque[anyio.Event] = field(default_factory=deque[anyio.Event])

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def load(self) -> int:
        return self.running + self.queued

    @property
    def wait_tokens(self) -> int | None:
        """What a request waiting for a slot here costs a new one, in prompt
        tokens it could have prefilled meanwhile: a slot frees every mean hold
        time / slots seconds, at the measured prefill rate. None until both
        are measured."""
        if self.mean_hold_seconds is None or self.prefill_tokens_per_second is None:
            return None
        slot_frees = self.mean_hold_seconds / self.limits.max_concurrent
        return round(slot_frees * self.prefill_tokens_per_second)

    def prefilled(self, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-3)
        previous = self.prefill_tokens_per_second
        self.prefill_tokens_per_second = (
            rate if previous is None else previous + HOLD_TIME_SMOOTHING * (rate - previous)
        )

    def _changed(self) -> None:
        self.on_load(self.model_id, self.load, self.wait_tokens)

    async def acquire(self) -> Slot:
        """A slot, now or after waiting in the queue; a 429 when the queue is
        full, a 503 when the wait exceeds the queue timeout."""
        decision = admission_decision(self.running, self.queued, self.limits)
        if decision == "reject":
            raise self._refusal(
                429,
                f"{self.model_id} is busy: {self.running} requests are running and "
                f"{self.queued} waiting; retry later",
                "rate_limit_exceeded",
            )
        if decision == "run":
            self.running += 1
            self._changed()
            return Slot(self)
        handed = anyio.Event()  # set by `release`, which hands its slot over
        self._waiters.append(handed)
        self._changed()
        try:
            with anyio.fail_after(self.limits.queue_timeout_seconds):
                await handed.wait()
        except BaseException as error:
            if handed.is_set():  # handed over just as this request gave up: pass it on
                self.release(None)
            else:
                self._waiters.remove(handed)
                self._changed()
            if isinstance(error, TimeoutError):
                raise self._refusal(
                    503,
                    f"waited {self.limits.queue_timeout_seconds:g}s in the queue for "
                    f"{self.model_id} without a free slot; retry later",
                    "queue_timeout",
                ) from error
            raise
        return Slot(self)

    def release(self, held_seconds: float | None) -> None:
        if held_seconds is not None:
            previous = self.mean_hold_seconds
            self.mean_hold_seconds = (
                held_seconds
                if previous is None
                else previous + HOLD_TIME_SMOOTHING * (held_seconds - previous)
            )
        if self._waiters:
            self._waiters.popleft().set()  # the slot goes to the first waiter
        else:
            self.running -= 1
        self._changed()

    def _refusal(self, status: int, message: str, code: str) -> APIError:
        retry = retry_after_seconds(self.mean_hold_seconds, self.limits.max_concurrent)
        logger.info(f"refused a request ({status}): {message}")
        error_type = "rate_limit_error" if status == 429 else "server_error"
        return APIError(status, message, error_type, code, headers={"Retry-After": str(retry)})


class Admission:
    """The gates of every model this node serves (made as models come)."""

    def __init__(
        self,
        limits: AdmissionLimits,
        on_load: Callable[[ModelId, int, int | None], None] = lambda model_id, load, wait: None,
    ) -> None:
        """`on_load`: a model's load (requests running or waiting) as it
        changes, and its waiting cost (`ModelGate.wait_tokens`)."""
        self.limits = limits
        self.on_load = on_load
        self.gates: dict[ModelId, ModelGate] = {}

    def gate(self, model_id: ModelId) -> ModelGate:
        if model_id not in self.gates:
            self.gates[model_id] = ModelGate(model_id, self.limits, on_load=self.on_load)
        return self.gates[model_id]

    def load(self, model_id: ModelId) -> int:
        gate = self.gates.get(model_id)
        return gate.load if gate is not None else 0


@dataclass
class _RequestAdmission:
    admission: Admission
    http: Request
    held: list[Slot] = field(default_factory=list[Slot])


_current: ContextVar[_RequestAdmission | None] = ContextVar("exo_admission", default=None)


async def admit(model_id: ModelId) -> Slot:
    """A slot for the current request on `model_id` (see `ModelGate.acquire`);
    it is released by the caller or, at the latest, when the request ends."""
    request = _current.get()
    if request is None:
        return UNLIMITED
    gate = request.admission.gate(model_id)

    async def acquire() -> Slot:
        slot = await gate.acquire()
        # Held at once: a cancellation from here on cannot lose the slot.
        request.held.append(slot)
        return slot

    # A client that leaves while its request waits gives its place up (499).
    return await until_disconnect(request.http, acquire)


class AdmissionMiddleware:
    """Makes the app's admission control reach the generation service and
    releases, when a request's HTTP exchange ends, any slot it still holds
    (e.g. a streaming reply whose client left before it started)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = _RequestAdmission(self.admission, Request(scope, receive))
        token = _current.set(request)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
            for slot in request.held:
                slot.release()


def body_too_large(limit: int) -> str:
    return f"the request body is larger than this node accepts ({limit} bytes, --max-body-bytes)"


class BodyLimitMiddleware:
    """413 for a body over `max_body_bytes`, before anything reads it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            error = APIError(
                413, body_too_large(self.limit), "invalid_request_error", "request_too_large"
            )
            await error_response(Request(scope), error)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Callable[[], Awaitable[Message]]:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Raised inside body parsing: FastAPI passes HTTP errors on as they are.
                    raise HTTPException(413, body_too_large(self.limit))
            return message

        return counted
