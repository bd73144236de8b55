"""Where a generation request runs: this node's runner, or a relay to the node
that serves the model. Shared by every API's routes."""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NoReturn, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from loguru import logger
from starlette.background import BackgroundTask

from exo.api.errors import APIError, stream_error_event
from exo.api.model_alias import ModelAlias, resolve_model
from exo.api.reply_retry import DEFAULT_RETRY_SECONDS, UNANSWERED_HEADER, ReplyRetry
from exo.api.reply_stream import ReplyEvent
from exo.api.routing import (
    Replica,
    Route,
    RoutingPolicy,
    UnreportedSends,
    choose_replica,
    cluster_models,
    coming_status,
    serving_replicas,
)
from exo.api.routing_tokenizers import RoutingModel
from exo.shared.cluster_view import ClusterView
from exo.shared.types.ids import InstanceId, ModelId
from exo.worker.served_model import ServedModel

# A node that does not accept a connection this fast is down (502).
RELAY_CONNECT_SECONDS = 5.0
# A serving node sends a stream's SSE keep-alive at least this often (its
# --sse-keepalive-seconds, the same across a cluster); silence for this many
# keep-alive periods means it is frozen (504).
RELAY_SILENT_KEEPALIVES = 3
DISCONNECT_POLL_SECONDS = 0.5
# Retry-After of a request for a model whose instance is not serving yet.
NOT_READY_RETRY_SECONDS = 2
# How long a replica whose node failed a relay is left out of the routing.
FAILED_REPLICA_SECONDS = 30.0
# Set on a relayed request: the node that routed it chose the replica there.
ROUTED_HEADER = "x-exo-routed"
# Headers a relay passes on (the API's own, e.g. Anthropic's version and beta flags).
RELAYED_HEADERS = (
    "content-type",
    "anthropic-version",
    "anthropic-beta",
    "authorization",
    "x-api-key",
)
# Errors of a relay before the serving node answered anything: another replica may.
RELAY_FAILURES = ("relay_failed", "relay_timeout", "relay_unanswered")
# Headers of the serving node's answer a relay passes back.
RELAYED_RESPONSE_HEADERS = ("retry-after", "cache-control", "x-accel-buffering")

T = TypeVar("T")


@dataclass(frozen=True)
class Relay:
    """The model runs on the node at `api_address`."""

    api_address: str
    model_id: ModelId
    # Longest silence of the serving node (between stream chunks; of its liveness
    # check while its answer has not begun) before the relay gives up with a 504.
    read_timeout_seconds: float
    instance_id: InstanceId | None = None  # the replica it serves, when known


@dataclass
class ModelRouter:
    models: Mapping[ModelId, ServedModel]
    cluster: ClusterView
    aliases: Sequence[ModelAlias] = ()
    relay_read_timeout_seconds: float = field(kw_only=True)  # see `relay_read_timeout`
    policy: RoutingPolicy = field(default="cache-aware", kw_only=True)
    # Requests running or waiting on this node's replica of a model.
    local_load: Callable[[ModelId], int] = field(default=lambda model_id: 0, kw_only=True)
    # Requests a replica works on at once (--max-concurrent, alike across a cluster).
    slots: int = field(default=8, kw_only=True)
    # How long a request lost before its first token is retried (--retry-seconds).
    retry_seconds: float = field(default=DEFAULT_RETRY_SECONDS, kw_only=True)
    # Images given by http(s) URL are fetched by this node (False: --no-fetch-images,
    # such a request is a 400); `exo.api.images.fetch_images`'s allow_fetch.
    fetch_images: bool = field(default=True, kw_only=True)
    # The tokenizer of a model whose replicas are all elsewhere (`routing_tokenizers`).
    routing_model: Callable[[ModelId], RoutingModel | None] = field(
        default=lambda model_id: None, kw_only=True
    )
    _turn: int = field(default=0, init=False)
    _unreported: UnreportedSends = field(default_factory=UnreportedSends, init=False)
    # Replicas whose node failed a relay, left out until then (monotonic seconds).
    _failed_until: dict[InstanceId, float] = field(default_factory=dict, init=False)

    def served_names(self) -> set[ModelId]:
        return {*self.models, *cluster_models(self.cluster.state)}

    def resolve(self, name: str) -> ModelId:
        return resolve_model(name, self.aliases, self.served_names())

    def replicas(self, model_id: ModelId, exclude: Collection[InstanceId] = ()) -> list[Replica]:
        """The model's replicas that serve, less `exclude`, and less those that
        failed lately while others remain (a relay's failure is a hint: after a
        healed partition the only replica must be tried again, not refused)."""
        now = time.monotonic()
        self._failed_until = {i: t for i, t in self._failed_until.items() if t > now}
        local = self.local_load(model_id) if model_id in self.models else None
        state = self.cluster.state
        serving = serving_replicas(state, model_id, self.cluster.node_id, local, set(exclude))
        serving = self._unreported.added(serving, state, now)
        return [r for r in serving if r.instance_id not in self._failed_until] or serving

    def choose(self, replicas: Sequence[Replica], prompt_digests: Sequence[int] | None) -> Route:
        self._turn += 1
        return choose_replica(replicas, prompt_digests, self.policy, self._turn, self.slots)

    def relay_to(self, replica: Replica, model_id: ModelId) -> Relay:
        """Where to relay a request routed to `replica` (counted in its load here
        until its report shows it: `UnreportedSends`)."""
        assert replica.api_address is not None
        self._unreported.sent(replica.instance_id, self.cluster.state, time.monotonic())
        return Relay(
            replica.api_address, model_id, self.relay_read_timeout_seconds, replica.instance_id
        )

    def reply_retry(
        self,
        routed: bool,
        reads_events: bool = False,
        continue_elsewhere: Callable[[InstanceId, Sequence[int]], AsyncIterator[ReplyEvent]]
        | None = None,
    ) -> ReplyRetry:
        """How a request is retried when lost before its first token (`reply_retry`)."""
        return ReplyRetry(
            self.retry_seconds,
            self.models.get,
            lambda model_id: any(not r.local for r in self.replicas(model_id)),
            routed=routed,
            reads_events=reads_events,
            continue_elsewhere=continue_elsewhere,
        )

    def failed(self, instance_id: InstanceId) -> None:
        """Its node failed a relay: route around it for a while."""
        self._failed_until[instance_id] = time.monotonic() + FAILED_REPLICA_SECONDS

    def find(self, name: str) -> ServedModel | Relay:
        """This node's model, or the least loaded node that serves it; a 503 for
        a model on its way, a 404 naming what is served."""
        model_id = self.resolve(name)
        model = self.models.get(model_id)
        if model is not None:
            return model
        replicas = self.replicas(model_id)
        if not replicas:
            self.not_served(name, model_id)
        return self.relay_to(choose_replica(replicas, None, "least-loaded").replica, model_id)

    def not_served(self, name: str, model_id: ModelId) -> NoReturn:
        """A 503 when an instance of the model is on its way, its lost instance
        waits for a node that can take it, or this node's state is behind the
        master's; else a 404."""
        state = self.cluster.state
        called = repr(name) if name == model_id else f"{name!r} ({model_id})"
        unplaced = state.unplaced.get(model_id)
        if unplaced is not None and unplaced.given_up:
            raise APIError(
                503,
                f"The model {called} lost its instance and the cluster stopped placing it "
                f"again: {unplaced.reason}",
                "server_error",
                "model_not_placed",
                "model",
            )
        coming = coming_status(state, model_id, self.cluster.node_id)
        behind = self.cluster.events_behind()
        if coming is not None or behind or unplaced is not None:
            # Placed and on its way, lost and placed again as soon as a node can
            # take it, or perhaps placed in what this node has not applied yet (a
            # resumed node that set its history aside starts empty): worth
            # retrying, not a 404.
            why = (
                f"its instance is {coming}"
                if coming is not None
                else f"its instance was lost; it is placed again as soon as a node can take it "
                f"({unplaced.reason})"
                if unplaced is not None
                else f"this node is catching up with the cluster's state, {behind} events behind"
            )
            raise APIError(
                503,
                f"The model {called} is not ready yet ({why}); retry shortly",
                "server_error",
                "model_not_ready",
                "model",
                headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)},
            )
        available = ", ".join(sorted(self.served_names())) or "none"
        raise APIError(
            404,
            f"The model {name!r} is not served in this cluster. Available models: {available}",
            "invalid_request_error",
            "model_not_found",
            "model",
        )


def relay_read_timeout(keepalive_seconds: float) -> float:
    return RELAY_SILENT_KEEPALIVES * keepalive_seconds


def relay_failed(target: Relay, error: httpx.HTTPError) -> APIError:
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return relay_silent(target)
    what = (
        "refuses connections (it may have stopped)"
        if isinstance(error, httpx.ConnectError)
        else "did not accept the connection in time"
        if isinstance(error, httpx.ConnectTimeout)
        else f"failed ({type(error).__name__}: {error})"
    )
    return APIError(
        502,
        f"the node at {target.api_address} that serves {target.model_id} {what}; "
        "if it was lost, the cluster places the model again: retry in a few seconds",
        "server_error",
        "relay_failed",
    )


def _relay_refused_key(target: Relay, request: Request) -> APIError:
    """The serving node's 401, told as its own: this node let the request in,
    so their API keys differ (or only the serving node has one)."""
    sent = "authorization" in request.headers or "x-api-key" in request.headers
    problem = (
        "refused the API key that this node accepted: the nodes' API keys differ "
        "(give every node the same --api-key)"
        if sent
        else "needs an API key, which this node does not (give every node the same --api-key)"
    )
    return APIError(
        401,
        f"the node at {target.api_address} that serves {target.model_id} {problem}",
        "invalid_request_error",
        "relayed_invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def relay_silent(target: Relay) -> APIError:
    return APIError(
        504,
        f"the node serving {target.model_id} at {target.api_address} stopped answering "
        f"(silent for {target.read_timeout_seconds:g}s)",
        "server_error",
        "relay_timeout",
    )


async def _watch_liveness(client: httpx.AsyncClient, target: Relay) -> APIError:
    """While the serving node has not begun its answer (it may queue the request,
    or generate a whole non-streaming reply), check that it still answers at all."""
    url = f"http://{target.api_address}/node_id"
    while True:
        await anyio.sleep(target.read_timeout_seconds)
        try:
            response = await client.get(url, timeout=target.read_timeout_seconds)
        except httpx.HTTPError as error:
            return relay_failed(target, error)
        if response.status_code != 200:
            return APIError(
                502,
                f"the node at {target.api_address} answered {response.status_code}",
                "server_error",
                "relay_failed",
            )


async def _answer_head(
    client: httpx.AsyncClient, outgoing: httpx.Request, target: Relay, request: Request
) -> httpx.Response:
    """The serving node's answer, once its status and headers came; a 502/504
    when the node fails or goes silent, a 499 when the client goes away first."""
    outcome: list[httpx.Response | APIError] = []

    async with anyio.create_task_group() as group:

        def settle(result: httpx.Response | APIError) -> None:
            outcome.append(result)
            group.cancel_scope.cancel()

        async def send() -> None:
            try:
                settle(await client.send(outgoing, stream=True))
            except httpx.HTTPError as error:
                settle(relay_failed(target, error))

        async def check() -> None:
            settle(await _watch_liveness(client, target))

        async def watch_client() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
            settle(APIError(499, "the client closed the request", "invalid_request_error"))

        group.start_soon(send)
        group.start_soon(check)
        group.start_soon(watch_client)
    for result in outcome:
        if isinstance(result, httpx.Response):
            return result
    failure = outcome[0]
    assert isinstance(failure, APIError)
    raise failure


# A streamed answer: SSE, or NDJSON (Ollama's).
StreamFormat = Literal["sse", "ndjson"]
NDJSON_MEDIA_TYPE = "application/x-ndjson"
STREAM_MEDIA_TYPES: dict[str, StreamFormat] = {
    "text/event-stream": "sse",
    NDJSON_MEDIA_TYPE: "ndjson",
}


async def _relayed_body(
    upstream: httpx.Response, target: Relay, path: str, stream: StreamFormat | None
) -> AsyncIterator[bytes]:
    """The serving node's body as it comes; a node that goes silent or fails
    mid-stream ends the stream with an error event in the API's format."""
    chunks = upstream.aiter_raw()
    last = b"\n"
    while True:
        try:
            with anyio.fail_after(target.read_timeout_seconds):
                chunk = await anext(chunks, None)
        except (TimeoutError, httpx.HTTPError) as error:
            failure = (
                relay_silent(target)
                if isinstance(error, TimeoutError)
                else relay_failed(target, error)
            )
            logger.warning(f"relay ended: {failure.message}")
            # First end what the node left half sent: an event with a blank
            # line, a line with its end (NDJSON has no blank lines).
            if stream == "sse":
                yield ("\n\n" + stream_error_event(path, failure)).encode()
            elif stream == "ndjson":
                separator = "" if last.endswith(b"\n") else "\n"
                yield (separator + stream_error_event(path, failure)).encode()
            return
        if chunk is None:
            return
        last = chunk or last
        yield chunk


async def open_relay(
    target: Relay, request: Request, extra_headers: Mapping[str, str] | None = None
) -> tuple[httpx.AsyncClient, httpx.Response]:
    """Send the request to the node that serves the model (with the model named
    as resolved here) and wait for its answer's head: a 502 when that node
    cannot be reached, a 504 when it goes silent, its 401 told as a key
    mismatch, its 503 for a request its runner lost unanswered as
    `relay_unanswered`. The caller closes the response and the client."""
    body = json.loads(await request.body())
    body["model"] = target.model_id
    headers = {k: v for k, v in request.headers.items() if k.lower() in RELAYED_HEADERS}
    headers[ROUTED_HEADER] = "1"
    headers.update(extra_headers or {})
    # Reads are bounded by `_answer_head` and the body's reader (an answer may take
    # as long as the serving node queues and generates, as long as it is alive).
    # The client's key goes with every request, the liveness checks' included.
    client = httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(RELAY_CONNECT_SECONDS, read=None, write=target.read_timeout_seconds),
    )
    url = f"http://{target.api_address}{request.url.path}"
    if request.url.query:
        url += f"?{request.url.query}"
    outgoing = client.build_request("POST", url, json=body, headers=headers)
    try:
        upstream = await _answer_head(client, outgoing, target, request)
        if upstream.status_code == 401:
            await upstream.aclose()
            raise _relay_refused_key(target, request)
        if upstream.status_code == 503 and UNANSWERED_HEADER in upstream.headers:
            await upstream.aclose()
            raise APIError(
                503,
                f"the node at {target.api_address} that serves {target.model_id} lost its "
                "runner before the answer began",
                "server_error",
                "relay_unanswered",
            )
    except BaseException:
        await client.aclose()
        raise
    return client, upstream


async def relay(target: Relay, request: Request) -> StreamingResponse:
    """The request answered by the node that serves the model, its answer
    streamed back as it comes (`open_relay`). A client that goes away closes
    the relay, which cancels the generation there."""
    client, upstream = await open_relay(target, request)

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    media_type = upstream.headers.get("content-type")
    return StreamingResponse(
        _relayed_body(
            upstream,
            target,
            request.url.path,
            STREAM_MEDIA_TYPES.get((media_type or "").split(";")[0].strip()),
        ),
        status_code=upstream.status_code,
        headers={
            k: v for k, v in upstream.headers.items() if k.lower() in RELAYED_RESPONSE_HEADERS
        },
        media_type=media_type,
        background=BackgroundTask(close),
    )


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run a non-streaming request's work; a client that goes away cancels it."""
    result: list[T] = []

    async def watch(scope: anyio.CancelScope) -> None:
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_SECONDS)
        scope.cancel()

    failure: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        try:
            result.append(await work())
        except Exception as error:  # raised as it is, not inside an exception group
            failure.append(error)
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise APIError(499, "the client closed the request", "invalid_request_error")
    return result[0]


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A streamed answer: server-sent events, neither cached nor buffered on the way."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def ndjson_response(lines: AsyncIterator[str]) -> StreamingResponse:
    """A streamed answer as Ollama's: one JSON object per line, neither cached
    nor buffered on the way."""
    return StreamingResponse(lines, media_type=NDJSON_MEDIA_TYPE, headers=SSE_HEADERS)
