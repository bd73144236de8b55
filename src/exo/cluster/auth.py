"""Who may use a node's cluster link: the holders of the cluster secret, each
as the node its certificate names.

The link runs over TLS (`exo.cluster.tls`: a self-signed certificate per node,
which the caller reads and then trusts exactly; a node's id is a digest of its
certificate's key). A caller proves it knows the secret without sending it,
and that it holds the key of the node id it states, in two calls that need no
session:

1. `Challenge(client_nonce)` -> `server_nonce`, `server_proof`
2. `Prove(client_nonce, server_nonce, client_proof, node_id, certificate,
   signature)` -> a session token

with `proof(role) = HMAC-SHA256(secret, role || client_nonce || server_nonce ||
sha256(server certificate) [|| the caller's node id])` and `signature` the
caller's key's signature of the same transcript (`identity_message`). The
server proves first and the caller checks it, so a server that does not know
the secret gets no proof from the caller. Both proofs and the signature are
bound to the server's certificate, which the TLS channel has verified: a party
in the middle (another certificate) can pass on none of them. A server nonce is
good for one `Prove` within `CHALLENGE_SECONDS`, so nothing can be replayed.
The server grants a session for `node_id` only if it is the id of `certificate`
and the signature is that certificate's key's; and not while a live session
holds the id with another certificate (a key whose id collides, found by brute
force, or a second certificate of the same key cannot take a live node's place).

The token rides in the metadata key `x-exo-session` of every other call; it is
`expires_ms.nonce.node.HMAC(token key, "exo-session" || nonce || node ||
expires_ms)`, the token key derived from this server's private key and the
secret, so that neither another member (it knows the secret) nor another
server can make one. It is checked without state, valid on this server only,
for `SESSION_SECONDS`, and it names the node that proved (`caller`). A call
without a valid token is refused with UNAUTHENTICATED before its handler runs,
and logged (rate-limited).

The empty secret is a secret like any other, known to everybody: a cluster
started without `--cluster-secret` lets in anyone who can reach it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

import anyio
import anyio.to_thread
import grpc
import grpc.aio
from loguru import logger

from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import (
    CERTIFICATE_HOST,
    NodeCertificate,
    fingerprint,
    node_id_of,
    peer_certificate,
    signed_by,
)
from exo.shared.types.ids import NodeId

SESSION_METADATA_KEY = "x-exo-session"
NONCE_BYTES = 32
# How long a session token is valid; callers renew it before then.
SESSION_SECONDS = 600.0
# How long a server nonce waits for its Prove.
CHALLENGE_SECONDS = 10.0
# Server nonces waiting for their Prove, at most (a flood of Challenges must
# not grow memory; the oldest are dropped).
PENDING_CHALLENGES = 4096
# How long reading a peer's certificate and authenticating may take.
HANDSHAKE_TIMEOUT_SECONDS = 2.0
# At most one warning per (peer, what, reason) per this many seconds; the
# calls in between are still refused and counted in the next warning.
DEFAULT_LOG_INTERVAL_S = 10.0

_OPEN_METHODS = frozenset({"/exo.cluster.Cluster/Challenge", "/exo.cluster.Cluster/Prove"})

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

Role = Literal["exo-server", "exo-client"]


def validate_secret(secret: str) -> str:
    """Return `secret` if it is printable ASCII (a value a shell passes
    unchanged); raise ValueError otherwise."""
    bad = sorted({c for c in secret if not " " <= c <= "~"})
    if bad:
        raise ValueError(
            "the cluster secret must contain only printable ASCII characters "
            f"(space to '~'); it contains {', '.join(repr(c) for c in bad)}"
        )
    return secret


def proof(
    secret: str,
    role: Role,
    client_nonce: bytes,
    server_nonce: bytes,
    server_fingerprint: bytes,
    caller: str = "",
) -> bytes:
    """What a side sends to prove it knows `secret`, bound to both nonces, the
    server's certificate and (the caller's proof) the caller's node id."""
    message = role.encode() + client_nonce + server_nonce + server_fingerprint + caller.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def identity_message(
    client_nonce: bytes, server_nonce: bytes, server_fingerprint: bytes, node_id: str
) -> bytes:
    """What a caller signs with its certificate's key in `Prove`."""
    return b"exo-identity" + client_nonce + server_nonce + server_fingerprint + node_id.encode()


class ProofRefused(Exception):
    """A `Prove` that gets no session; the message says why (it was logged)."""


class RejectionLog:
    """Warnings about refused callers, at most one per (peer, what, reason)
    per interval; the next one counts the calls not logged."""

    def __init__(
        self,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._last_logged: dict[tuple[str, str, str], tuple[float, int]] = {}

    def warn(self, peer: str, what: str, reason: str) -> None:
        key = (peer, what, reason)
        now = self._clock()
        last, suppressed = self._last_logged.get(key, (None, 0))
        if last is not None and now - last < self._log_interval_s:
            self._last_logged[key] = (last, suppressed + 1)
            return
        if len(self._last_logged) > 1024:  # a scan from many ports must not grow this forever
            self._last_logged.clear()
        self._last_logged[key] = (now, 0)
        logger.warning(
            "cluster link: refused {} from {}: {}{}",
            what,
            peer,
            reason,
            f"; {suppressed} similar calls refused without logging" if suppressed else "",
        )


class ServerAuth:
    """The server's side: answers challenges, checks proofs, issues and checks tokens."""

    def __init__(
        self,
        secret: str,
        certificate: NodeCertificate,
        rejections: RejectionLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = validate_secret(secret)
        self._fingerprint = certificate.fingerprint
        self._token_key = hmac.new(
            certificate.key_pem, b"exo-session-key" + secret.encode(), hashlib.sha256
        ).digest()
        self.rejections = rejections or RejectionLog()
        self._clock = clock
        self._pending: OrderedDict[bytes, float] = OrderedDict()  # server nonce -> deadline
        # node id -> (fingerprint of the certificate it proved with, end of its last session)
        self._holders: dict[NodeId, tuple[bytes, float]] = {}

    def challenge(self, request: pb.ChallengeRequest) -> pb.ChallengeReply:
        now = self._clock()
        while self._pending and (
            len(self._pending) >= PENDING_CHALLENGES or next(iter(self._pending.values())) < now
        ):
            self._pending.popitem(last=False)
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        self._pending[server_nonce] = now + CHALLENGE_SECONDS
        server_proof = proof(
            self._secret, "exo-server", request.client_nonce, server_nonce, self._fingerprint
        )
        return pb.ChallengeReply(server_nonce=server_nonce, server_proof=server_proof)

    def prove(self, request: pb.ProofRequest, peer: str) -> pb.SessionGrant:
        """A session for node `request.node_id`, for a right proof of a pending
        challenge by the holder of that node's key. Raises `ProofRefused` (logged)."""
        now = self._clock()
        deadline = self._pending.pop(request.server_nonce, None)
        if deadline is None or deadline < now:
            raise self._refuse(peer, "no such challenge pending (expired or replayed)")
        expected = proof(
            self._secret,
            "exo-client",
            request.client_nonce,
            request.server_nonce,
            self._fingerprint,
            request.node_id,
        )
        if not hmac.compare_digest(expected, request.client_proof):
            raise self._refuse(peer, "wrong cluster secret (another cluster?)")
        node_id = NodeId(request.node_id)
        try:
            certified = node_id_of(request.certificate)
        except ValueError:
            raise self._refuse(peer, f"node {node_id} sent no readable certificate") from None
        if certified != node_id:
            raise self._refuse(
                peer, f"it states node id {node_id}, but its certificate is node {certified}"
            )
        message = identity_message(
            request.client_nonce, request.server_nonce, self._fingerprint, node_id
        )
        if not signed_by(request.certificate, request.signature, message):
            raise self._refuse(peer, f"node {node_id}: its signature is not its certificate's")
        self._holders = {n: h for n, h in self._holders.items() if h[1] > now}
        certificate = fingerprint(request.certificate)
        held = self._holders.get(node_id)
        if held is not None and held[0] != certificate:
            raise self._refuse(
                peer, f"node id {node_id} is held by a live session with another certificate"
            )
        self._holders[node_id] = (certificate, now + SESSION_SECONDS)
        expires_ms = int((now + SESSION_SECONDS) * 1000)
        return pb.SessionGrant(
            token=self._token(secrets.token_bytes(16), node_id.encode(), expires_ms),
            valid_for_ms=int(SESSION_SECONDS * 1000),
        )

    def _refuse(self, peer: str, reason: str) -> ProofRefused:
        self.rejections.warn(peer, "a proof", reason)
        return ProofRefused(reason)

    def _token(self, nonce: bytes, node: bytes, expires_ms: int) -> str:
        message = b"exo-session" + nonce + node + str(expires_ms).encode()
        mac = hmac.new(self._token_key, message, hashlib.sha256).hexdigest()
        return f"{expires_ms}.{nonce.hex()}.{node.hex()}.{mac}"

    def caller(self, token: str) -> NodeId | None:
        """The node a valid, unexpired `token` speaks for; None for any other token."""
        parts = token.split(".")
        if len(parts) != 4 or not parts[0].isdigit():
            return None
        expires_ms = int(parts[0])
        now_ms = self._clock() * 1000
        if not now_ms < expires_ms <= now_ms + SESSION_SECONDS * 1000:
            return None
        try:
            nonce, node = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
        except ValueError:
            return None
        if not hmac.compare_digest(self._token(nonce, node, expires_ms), token):
            return None
        return NodeId(node.decode("utf-8", "replace"))

    def caller_of(self, context: grpc.aio.ServicerContext[_Req, _Resp]) -> NodeId | None:
        """The node whose session a call carries (None: none valid; the
        interceptor already refused such calls)."""
        tokens = session_tokens(context.invocation_metadata() or ())
        return self.caller(tokens[0]) if len(tokens) == 1 else None


def _as_str(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def session_tokens(metadata: Iterable[tuple[str, str | bytes]]) -> list[str]:
    return [_as_str(value) for key, value in metadata if key == SESSION_METADATA_KEY]


class SessionInterceptor(grpc.aio.ServerInterceptor):
    """Lets through `Challenge`, `Prove` and calls with a valid session token;
    answers every other call with UNAUTHENTICATED (its handler never runs) and a
    warning naming the peer and the method."""

    def __init__(self, auth: ServerAuth) -> None:
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        method = _as_str(handler_call_details.method)  # bytes in some grpc versions
        tokens = session_tokens(handler_call_details.invocation_metadata or ())
        # Exactly one token: a call carrying several (even if one is right) is refused.
        if method in _OPEN_METHODS or (
            len(tokens) == 1 and self._auth.caller(tokens[0]) is not None
        ):
            return await continuation(handler_call_details)
        reason = "an invalid or expired session token" if tokens else "no session token"
        # The real handler only tells which shape of handler the refusal needs;
        # an unknown method is refused the same way (no UNIMPLEMENTED probing).
        handler = await continuation(handler_call_details)
        return self._refusing_handler(handler, method, reason)

    def _refusing_handler(
        self, handler: grpc.RpcMethodHandler[_Req, _Resp] | None, method: str, reason: str
    ) -> grpc.RpcMethodHandler[_Req, _Resp]:
        message = (
            f"{reason}: authenticate first (Challenge, Prove) with this cluster's secret, "
            f"then send the token in the metadata key {SESSION_METADATA_KEY!r}"
        )
        rejections = self._auth.rejections

        async def refuse(_request: object, context: grpc.aio.ServicerContext[_Req, _Resp]) -> None:
            rejections.warn(context.peer(), method, reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(
            request: object, context: grpc.aio.ServicerContext[_Req, _Resp]
        ) -> AsyncIterator[_Resp]:
            await refuse(request, context)
            return
            yield  # an async generator, as grpc.aio expects of streaming responses

        if handler is None:
            return grpc.unary_unary_rpc_method_handler(refuse)
        deserializer = handler.request_deserializer
        serializer = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse, deserializer, serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, deserializer, serializer)


# -- the caller's side -------------------------------------------------------------


class LinkError(Exception):
    """No session with a peer: it cannot be reached (`refused`: nothing listens
    at its address, e.g. its process died), or it is not of this cluster
    (`untrusted`: it did not prove the secret, or refused ours)."""

    def __init__(self, message: str, *, untrusted: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.untrusted = untrusted
        self.refused = refused


@dataclass
class _Token:
    value: str = ""


class _AttachToken:
    """Base of the client interceptors: puts the session token in a call's metadata."""

    def __init__(self, token: _Token) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(
            *((k, v) for k, v in (details.metadata or ()) if k != SESSION_METADATA_KEY),
            (SESSION_METADATA_KEY, self._token.value),
        )
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each client interceptor under one call shape only, hence four classes.
class _UnaryUnary(_AttachToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Req], Awaitable[grpc.aio.UnaryUnaryCall[_Req, _Resp]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> _Resp | grpc.aio.UnaryUnaryCall[_Req, _Resp]:
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_AttachToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Req], Awaitable[grpc.aio.UnaryStreamCall[_Req, _Resp]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> AsyncIterator[_Resp] | grpc.aio.UnaryStreamCall[_Req, _Resp]:
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_AttachToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Req] | Iterable[_Req]],
            Awaitable[grpc.aio.StreamUnaryCall[_Req, _Resp]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Req] | Iterable[_Req],
    ) -> _Resp | grpc.aio.StreamUnaryCall[_Req, _Resp]:
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_AttachToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Req] | Iterable[_Req]],
            Awaitable[grpc.aio.StreamStreamCall[_Req, _Resp]],
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Req] | Iterable[_Req],
    ) -> AsyncIterator[_Resp] | grpc.aio.StreamStreamCall[_Req, _Resp]:
        return await continuation(self._with_token(client_call_details), request_iterator)


class PeerSession:
    """A TLS channel to one peer that trusts exactly the peer's certificate
    (so the peer is node `peer_id`), with a session token for `identity`'s node
    on every call (renewed with `authenticate`)."""

    def __init__(
        self, address: str, secret: str, identity: NodeCertificate, certificate_pem: bytes
    ) -> None:
        self.address = address
        self.peer_id = node_id_of(certificate_pem)
        self._secret = validate_secret(secret)
        self._identity = identity
        self._fingerprint = fingerprint(certificate_pem)
        self._token = _Token()
        self._expires_at = 0.0  # monotonic
        self.channel = grpc.aio.secure_channel(
            address,
            grpc.ssl_channel_credentials(root_certificates=certificate_pem),
            options=[("grpc.ssl_target_name_override", CERTIFICATE_HOST)],
            interceptors=[
                _UnaryUnary(self._token),
                _UnaryStream(self._token),
                _StreamUnary(self._token),
                _StreamStream(self._token),
            ],
        )

    @property
    def stub(self) -> pb_grpc.ClusterStub:
        return pb_grpc.ClusterStub(self.channel)

    def expiring(self) -> bool:
        """The token has less than a tenth of its life left."""
        return time.monotonic() > self._expires_at - SESSION_SECONDS / 10

    async def authenticate(self, timeout: float = HANDSHAKE_TIMEOUT_SECONDS) -> None:
        """Challenge the peer, check its proof, prove ours, keep the token.
        Raises `LinkError`."""
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            reply: pb.ChallengeReply = await self.stub.Challenge(
                pb.ChallengeRequest(client_nonce=client_nonce), timeout=timeout
            )
            expected = proof(
                self._secret, "exo-server", client_nonce, reply.server_nonce, self._fingerprint
            )
            if not hmac.compare_digest(expected, reply.server_proof):
                raise LinkError(
                    f"{self.address} did not prove our cluster secret (another cluster?)",
                    untrusted=True,
                )
            node_id = self._identity.node_id
            client_proof = proof(
                self._secret,
                "exo-client",
                client_nonce,
                reply.server_nonce,
                self._fingerprint,
                node_id,
            )
            signature = self._identity.sign(
                identity_message(client_nonce, reply.server_nonce, self._fingerprint, node_id)
            )
            grant: pb.SessionGrant = await self.stub.Prove(
                pb.ProofRequest(
                    client_nonce=client_nonce,
                    server_nonce=reply.server_nonce,
                    client_proof=client_proof,
                    node_id=node_id,
                    certificate=self._identity.certificate_pem,
                    signature=signature,
                ),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as error:
            untrusted = error.code() == grpc.StatusCode.UNAUTHENTICATED
            raise LinkError(
                f"{self.address}: {error.code().name} {error.details()}", untrusted=untrusted
            ) from error
        self._token.value = grant.token
        self._expires_at = time.monotonic() + grant.valid_for_ms / 1000

    async def close(self) -> None:
        await self.channel.close()


async def connect(
    address: str,
    secret: str,
    identity: NodeCertificate,
    timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
) -> PeerSession:
    """A session with the node at "host:port", as `identity`'s node; raises `LinkError`."""
    try:
        certificate_pem = await anyio.to_thread.run_sync(peer_certificate, address, timeout)
    except (OSError, ValueError) as error:
        raise LinkError(
            f"{address}: no TLS certificate ({error})",
            refused=isinstance(error, ConnectionRefusedError),
        ) from error
    session = PeerSession(address, secret, identity, certificate_pem)
    try:
        await session.authenticate(timeout)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await session.close()
        raise
    return session


@asynccontextmanager
async def peer_channel(
    address: str,
    secret: str,
    identity: NodeCertificate,
    timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
) -> AsyncIterator[grpc.aio.Channel]:
    """An authenticated channel to one peer, for `identity`'s node, closed on
    exit (raises `LinkError`)."""
    session = await connect(address, secret, identity, timeout)
    try:
        yield session.channel
    finally:
        with anyio.CancelScope(shield=True):
            await session.close()
