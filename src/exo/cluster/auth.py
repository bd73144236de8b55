"""Cluster secret on every gRPC call.

The secret travels in the metadata key `x-exo-cluster-secret` of every RPC.
The server side (`ClusterSecretInterceptor`) rejects any call whose secret is
missing or wrong with UNAUTHENTICATED and logs it; the client side attaches the
secret with interceptors (`client_interceptors`, `cluster_channel`) or explicit
call metadata (`secret_metadata`).

The empty string is a valid secret, distinct from every other: clusters started
without `--cluster-secret` share it, so they still send the key (with an empty
value), and a call without the key is rejected even by them.

Secrets are gRPC ASCII metadata values, so they must be printable ASCII
(`validate_secret` says so clearly instead of letting gRPC fail obscurely).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
import grpc.aio
from loguru import logger

SECRET_METADATA_KEY = "x-exo-cluster-secret"

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

# At most one warning per (peer, method, reason) per this many seconds; the
# calls in between are still rejected and counted in the next warning.
DEFAULT_LOG_INTERVAL_S = 10.0


def validate_secret(secret: str) -> str:
    """Return `secret` if it can travel as gRPC metadata; raise ValueError otherwise."""
    bad = sorted({c for c in secret if not " " <= c <= "~"})
    if bad:
        raise ValueError(
            "the cluster secret must contain only printable ASCII characters "
            f"(space to '~'); it contains {', '.join(repr(c) for c in bad)}"
        )
    return secret


def secret_fingerprint(secret: str) -> str:
    """A short, log-safe identifier of a secret: the first 12 hex digits of its sha256."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()[:12]


def secret_metadata(secret: str) -> tuple[tuple[str, str]]:
    """Call metadata carrying `secret` (for `stub.Method(request, metadata=...)`)."""
    return ((SECRET_METADATA_KEY, validate_secret(secret)),)


def _presented_secrets(handler_call_details: grpc.HandlerCallDetails) -> list[str | bytes]:
    return [
        value
        for key, value in handler_call_details.invocation_metadata or ()
        if key == SECRET_METADATA_KEY
    ]


def _as_str(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _digest(secret: str | bytes) -> bytes:
    # Comparing digests keeps the comparison constant-time in the secret's length too.
    return hashlib.sha256(_as_str(secret).encode("utf-8")).digest()


def _method_name(handler_call_details: grpc.HandlerCallDetails) -> str:
    method: str | bytes = handler_call_details.method  # bytes in some grpc versions
    return _as_str(method)


class ClusterSecretInterceptor(grpc.aio.ServerInterceptor):
    """Server interceptor that lets through only calls carrying the cluster secret.

    A call whose `x-exo-cluster-secret` is missing or differs from the secret is
    answered with UNAUTHENTICATED (before the method's handler runs or reads any
    request) and a warning naming the peer and the method is logged.
    """

    def __init__(
        self,
        secret: str,
        *,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._expected = _digest(validate_secret(secret))
        self._fingerprint = secret_fingerprint(secret)
        self._log_interval_s = log_interval_s
        self._clock = clock
        # (peer, method, reason) -> (monotonic time of the last warning, calls not logged since)
        self._last_logged: dict[tuple[str, str, str], tuple[float, int]] = {}

    def _authentic(self, presented: list[str | bytes]) -> bool:
        # Exactly one value: a call carrying several (even if one is right) is rejected.
        return len(presented) == 1 and hmac.compare_digest(_digest(presented[0]), self._expected)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        presented = _presented_secrets(handler_call_details)
        if self._authentic(presented):
            return await continuation(handler_call_details)
        if presented:
            theirs = ", ".join(secret_fingerprint(_as_str(p)) for p in presented)
            reason, facts = "wrong", f"theirs: {theirs}, ours: {self._fingerprint}"
        else:
            reason, facts = "missing", f"ours: {self._fingerprint}"
        # The real handler only tells which shape of handler the rejection needs;
        # an unknown method is rejected the same way (no UNIMPLEMENTED probing).
        handler = await continuation(handler_call_details)
        return self._rejecting_handler(handler, _method_name(handler_call_details), reason, facts)

    def _log_rejection(self, peer: str, method: str, reason: str, facts: str) -> None:
        key = (peer, method, reason)
        now = self._clock()
        last, suppressed = self._last_logged.get(key, (None, 0))
        if last is not None and now - last < self._log_interval_s:
            self._last_logged[key] = (last, suppressed + 1)
            return
        if len(self._last_logged) > 1024:  # a scan from many ports must not grow this forever
            self._last_logged.clear()
        self._last_logged[key] = (now, 0)
        logger.warning(
            "gRPC: rejected {} from {}: {} cluster secret (fingerprints {}){}",
            method,
            peer,
            reason,
            facts,
            f"; {suppressed} similar calls rejected without logging" if suppressed else "",
        )

    def _rejecting_handler(
        self,
        handler: grpc.RpcMethodHandler[_Req, _Resp] | None,
        method: str,
        reason: str,
        facts: str,
    ) -> grpc.RpcMethodHandler[_Req, _Resp]:
        if reason == "missing":
            message = (
                f"missing cluster secret: every call to an exo node must carry its cluster's "
                f"secret in the metadata key {SECRET_METADATA_KEY!r}"
            )
        else:
            message = (
                f"wrong cluster secret (metadata {SECRET_METADATA_KEY!r}): the caller belongs "
                "to another cluster (started with a different --cluster-secret)"
            )

        async def reject(_request: object, context: grpc.aio.ServicerContext[_Req, _Resp]) -> None:
            self._log_rejection(context.peer(), method, reason, facts)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def reject_stream(
            request: object, context: grpc.aio.ServicerContext[_Req, _Resp]
        ) -> AsyncIterator[_Resp]:
            await reject(request, context)
            return
            yield  # an async generator, as grpc.aio expects of streaming responses

        if handler is None:
            return grpc.unary_unary_rpc_method_handler(reject)
        deserializer = handler.request_deserializer
        serializer = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(reject_stream, deserializer, serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(reject, deserializer, serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(reject_stream, deserializer, serializer)
        return grpc.unary_unary_rpc_method_handler(reject, deserializer, serializer)


class _AttachSecret:
    """Base of the client interceptors: puts the secret in a call's metadata."""

    def __init__(self, secret: str) -> None:
        self._secret = validate_secret(secret)

    def _with_secret(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        # Replace any secret the caller passed, keep the rest of its metadata.
        metadata = grpc.aio.Metadata(
            *((k, v) for k, v in (details.metadata or ()) if k != SECRET_METADATA_KEY),
            (SECRET_METADATA_KEY, self._secret),
        )
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each client interceptor under one call shape only, hence four classes.
class SecretUnaryUnaryInterceptor(_AttachSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Req], Awaitable[grpc.aio.UnaryUnaryCall[_Req, _Resp]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Resp | grpc.aio.UnaryUnaryCall[_Req, _Resp]:
        return await continuation(self._with_secret(client_call_details), request)


class SecretUnaryStreamInterceptor(_AttachSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Req], Awaitable[grpc.aio.UnaryStreamCall[_Req, _Resp]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> AsyncIterator[_Resp] | grpc.aio.UnaryStreamCall[_Req, _Resp]:
        return await continuation(self._with_secret(client_call_details), request)


class SecretStreamUnaryInterceptor(_AttachSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Req] | Iterable[_Req]],
            Awaitable[grpc.aio.StreamUnaryCall[_Req, _Resp]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Req] | Iterable[_Req],
    ) -> _Resp | grpc.aio.StreamUnaryCall[_Req, _Resp]:
        return await continuation(self._with_secret(client_call_details), request_iterator)


class SecretStreamStreamInterceptor(_AttachSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Req] | Iterable[_Req]],
            Awaitable[grpc.aio.StreamStreamCall[_Req, _Resp]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Req] | Iterable[_Req],
    ) -> AsyncIterator[_Resp] | grpc.aio.StreamStreamCall[_Req, _Resp]:
        return await continuation(self._with_secret(client_call_details), request_iterator)


def client_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that put `secret` on every call of a channel, of any shape."""
    return [
        SecretUnaryUnaryInterceptor(secret),
        SecretUnaryStreamInterceptor(secret),
        SecretStreamUnaryInterceptor(secret),
        SecretStreamStreamInterceptor(secret),
    ]


def cluster_channel(address: str, secret: str, **kwargs: Any) -> grpc.aio.Channel:
    """A plaintext channel to a peer ("host:port") whose every call carries `secret`."""
    return grpc.aio.insecure_channel(address, interceptors=client_interceptors(secret), **kwargs)


def cluster_server(secret: str, **kwargs: Any) -> grpc.aio.Server:
    """A `grpc.aio` server that rejects calls without `secret` (add servicers and ports to it)."""
    interceptors = [ClusterSecretInterceptor(secret), *kwargs.pop("interceptors", ())]
    return grpc.aio.server(interceptors=interceptors, **kwargs)
