"""A stream answered here, continued on another replica.

A stream's HTTP head goes out once this node's runner took the request (so a
long prefill can send keep-alives). If that runner is lost before the reply's
first token and cannot come back here (the model was placed elsewhere, or its
instance deleted), the reply continues on another replica of the model: that
node is asked for the reply's events (`EVENTS_HEADER`: one JSON event per line,
not its API's answer), and this node's adapter writes them into the answer it
began, so the client sees one slow answer. The serving node begins that answer
once its runner took the request too, and a loss there before the first token
ends it with an `unanswered` error line: this node tries the next replica.
"""

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Literal

import anyio
import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from loguru import logger
from pydantic import TypeAdapter
from starlette.responses import Response

from exo.api.errors import APIError
from exo.api.reply_retry import MAX_ATTEMPTS, UNANSWERED_HEADER, is_unanswered, lost_unanswered
from exo.api.reply_stream import KeepAlive, PreparedReply, ReplyEvent, ReplyFinished
from exo.api.serving import (
    NDJSON_MEDIA_TYPE,
    RELAY_FAILURES,
    SSE_HEADERS,
    ModelRouter,
    Relay,
    open_relay,
    relay_failed,
    relay_silent,
)
from exo.shared.prefix_digests import prefix_digests
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId

# Set on a relayed stream whose answer the routing node wants as reply events.
EVENTS_HEADER = "x-exo-reply-events"
# Statuses of a serving node's answer after which another replica may answer.
_RETRIED_STATUSES = (429, 500, 502, 503, 504)


class RelayedError(FrozenModel):
    """The last line of a reply's events that failed: the `APIError` it raised."""

    kind: Literal["error"] = "error"
    status: int
    message: str
    error_type: str
    code: str | None = None
    # Lost before its first token: the node that routed it may send it elsewhere.
    unanswered: bool = False

    def error(self) -> APIError:
        headers = {UNANSWERED_HEADER: "1"} if self.unanswered else None
        return APIError(self.status, self.message, self.error_type, self.code, headers=headers)


_EVENT_LINE: TypeAdapter[ReplyEvent | RelayedError] = TypeAdapter(ReplyEvent | RelayedError)


def streamed(
    request: Request, reply: PreparedReply, respond: Callable[[PreparedReply], Response]
) -> Response:
    """A streamed reply as the API's answer (`respond`), or as its events when
    the node that routed it here asked for them."""
    if EVENTS_HEADER not in request.headers:
        return respond(reply)

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in reply.events:
                yield event.model_dump_json() + "\n"
        except APIError as error:
            failed = RelayedError(
                status=error.status,
                message=error.message,
                error_type=error.error_type,
                code=error.code,
                unanswered=is_unanswered(error),
            )
            yield failed.model_dump_json() + "\n"

    return StreamingResponse(lines(), media_type=NDJSON_MEDIA_TYPE, headers=SSE_HEADERS)


async def relayed_events(target: Relay, request: Request) -> AsyncGenerator[ReplyEvent]:
    """The reply's events from the node at `target`, as they come; `APIError`
    when it refuses, fails, goes silent or ends without finishing the reply."""
    client, upstream = await open_relay(target, request, {EVENTS_HEADER: "1"})
    try:
        if upstream.status_code != 200:
            body = b""
            with anyio.move_on_after(target.read_timeout_seconds):
                body = await upstream.aread()
            text = body.decode(errors="replace")
            retried = upstream.status_code in _RETRIED_STATUSES
            raise APIError(
                upstream.status_code if not retried else 502,
                f"the node at {target.api_address} that serves {target.model_id} answered "
                f"{upstream.status_code}: {text[:500]}",
                "server_error" if retried else "invalid_request_error",
                "relay_failed" if retried else "relay_refused",
            )
        lines = upstream.aiter_lines()
        while True:
            try:
                with anyio.fail_after(target.read_timeout_seconds):
                    line = await anext(lines, None)
            except TimeoutError:
                raise relay_silent(target) from None
            except httpx.HTTPError as error:
                raise relay_failed(target, error) from error
            if line is None:
                raise APIError(
                    502,
                    f"the node at {target.api_address} that serves {target.model_id} ended "
                    "the reply before it finished",
                    "server_error",
                    "relay_failed",
                )
            if not line.strip():
                continue
            event = _EVENT_LINE.validate_json(line)
            if isinstance(event, RelayedError):
                raise event.error()
            yield event
            if isinstance(event, ReplyFinished):
                return
    finally:
        await upstream.aclose()
        await client.aclose()


async def continue_elsewhere(
    router: ModelRouter,
    request: Request,
    model_id: ModelId,
    lost: InstanceId,
    prompt: Sequence[int],
) -> AsyncGenerator[ReplyEvent]:
    """The reply's events from another replica of `model_id` than `lost` (the
    one with the longest cached prefix of `prompt`, as routing chooses), the
    next one when one fails before its first token; `lost_unanswered` when
    none is left."""
    tried = {lost}
    failure: APIError | None = None
    for _ in range(MAX_ATTEMPTS):
        replicas = [r for r in router.replicas(model_id, exclude=tried) if not r.local]
        if not replicas:
            break
        replica = router.choose(replicas, prefix_digests(prompt)).replica
        logger.warning(
            f"continuing a {model_id} stream whose runner here was lost before its first "
            f"token on node {replica.node_id} (instance {replica.instance_id})"
        )
        delivered = False
        try:
            async for event in relayed_events(router.relay_to(replica, model_id), request):
                delivered = delivered or not isinstance(event, KeepAlive)
                yield event
            return
        except APIError as error:
            if delivered or not (error.code in RELAY_FAILURES or is_unanswered(error)):
                raise
            logger.warning(f"node {replica.node_id} did not answer it ({error.message})")
            router.failed(replica.instance_id)
            tried.add(replica.instance_id)
            failure = error
    if failure is not None:
        raise lost_unanswered(f"no replica answered it: {failure.message}") from failure
    raise lost_unanswered(f"no other replica of {model_id} serves it")


def continuation_for(
    router: ModelRouter, request: Request, model_id: ModelId
) -> Callable[[InstanceId, Sequence[int]], AsyncIterator[ReplyEvent]]:
    """`ReplyRetry.continue_elsewhere` of a request this node took."""

    def elsewhere(lost: InstanceId, prompt: Sequence[int]) -> AsyncIterator[ReplyEvent]:
        return continue_elsewhere(router, request, model_id, lost, prompt)

    return elsewhere
