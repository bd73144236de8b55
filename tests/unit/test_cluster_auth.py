"""The cluster link's authentication on a real grpc.aio TLS server: the
challenge (server first, bound to its certificate), the caller's identity
(its node id is its certificate's, proved with its key), session tokens, and
what is refused (UNAUTHENTICATED, logged with a rate limit)."""

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import grpc.aio
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from loguru import logger

from exo.cluster.auth import (
    SESSION_METADATA_KEY,
    SESSION_SECONDS,
    LinkError,
    ProofRefused,
    RejectionLog,
    ServerAuth,
    SessionInterceptor,
    connect,
    identity_message,
    peer_channel,
    proof,
    validate_secret,
)
from exo.cluster.channels import Channels
from exo.cluster.membership import Membership
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.timing import LinkTiming
from exo.cluster.tls import (
    NodeCertificate,
    fingerprint,
    node_id_of,
    peer_certificate,
    server_credentials,
)
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore
from exo.shared.types.ids import NodeId
from tests.unit.impostor import Impostor

SECRET = "s3cret-of-the-test-cluster"
ME = NodeCertificate.create()  # the calling node's identity
RPC_TIMEOUT_S = 5.0
TEST_TIMEOUT_S = 20.0


class Servicer(pb_grpc.ClusterServicer):
    """Challenge and Prove as the link answers them; Hello and SubscribeEvents
    record the caller; every call is counted."""

    def __init__(self, auth: ServerAuth, node_id: NodeId) -> None:
        self.auth = auth
        self.hello_as = node_id  # the id its Hello replies state
        self.calls: list[str] = []
        self.callers: list[NodeId | None] = []

    async def Challenge(
        self, request: pb.ChallengeRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ChallengeReply:
        self.calls.append("Challenge")
        return self.auth.challenge(request)

    async def Prove(
        self, request: pb.ProofRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.SessionGrant:
        self.calls.append("Prove")
        try:
            return self.auth.prove(request, context.peer())
        except ProofRefused as refusal:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(refusal))
            raise

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.HelloReply:
        self.calls.append("Hello")
        self.callers.append(self.auth.caller_of(context))
        return pb.HelloReply(node_id=self.hello_as, last_applied_idx=request.last_applied_idx)

    async def SubscribeEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.IndexedEventEnvelope]:
        self.calls.append("SubscribeEvents")
        for idx in range(request.from_idx, request.from_idx + 3):
            yield pb.IndexedEventEnvelope(idx=idx, payload=f'{{"n":{idx}}}'.encode())


@dataclass
class Server:
    address: str
    servicer: Servicer
    certificate: NodeCertificate
    warnings: list[str]


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(sink)


async def _serve(secret: str, directory: Path, warnings: list[str]) -> AsyncIterator[Server]:
    certificate = NodeCertificate.load_or_create(directory)
    # every refusal logged (no rate limit), so the tests can count them
    auth = ServerAuth(secret, certificate, RejectionLog(log_interval_s=0.0))
    servicer = Servicer(auth, certificate.node_id)
    server = grpc.aio.server(interceptors=[SessionInterceptor(auth)])
    pb_grpc.add_ClusterServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(certificate))
    await server.start()
    try:
        yield Server(f"127.0.0.1:{port}", servicer, certificate, warnings)
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def server(tmp_path: Path, warnings: list[str]) -> AsyncIterator[Server]:
    async for s in _serve(SECRET, tmp_path / "server", warnings):
        yield s


@pytest.fixture
async def open_server(tmp_path: Path, warnings: list[str]) -> AsyncIterator[Server]:
    """A node started without --cluster-secret: the empty secret."""
    async for s in _serve("", tmp_path / "open", warnings):
        yield s


async def _hello(channel: grpc.aio.Channel, **kwargs: object) -> pb.HelloReply:
    request = pb.HelloRequest(node_id="client", last_applied_idx=7)
    return await pb_grpc.ClusterStub(channel).Hello(request, timeout=RPC_TIMEOUT_S, **kwargs)


async def _subscribe(channel: grpc.aio.Channel, **kwargs: object) -> list[int]:
    call = pb_grpc.ClusterStub(channel).SubscribeEvents(
        pb.SubscribeRequest(from_idx=10), timeout=RPC_TIMEOUT_S, **kwargs
    )
    return [envelope.idx async for envelope in call]


async def _code(call: object) -> grpc.StatusCode:
    try:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _pinned_channel(server: Server) -> grpc.aio.Channel:
    """A TLS channel to the server without a session (what a stranger can open)."""
    return grpc.aio.secure_channel(
        server.address,
        grpc.ssl_channel_credentials(root_certificates=server.certificate.certificate_pem),
        options=[("grpc.ssl_target_name_override", "exo-node")],
    )


async def test_the_right_secret_gets_a_session_for_unary_and_streaming_calls(
    server: Server,
) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S), peer_channel(server.address, SECRET, ME) as channel:
        assert (await _hello(channel)).last_applied_idx == 7
        assert await _subscribe(channel) == [10, 11, 12]
    assert server.servicer.calls == ["Challenge", "Prove", "Hello", "SubscribeEvents"]
    assert server.servicer.callers == [ME.node_id]  # the session speaks for the node that proved
    assert server.warnings == []


@pytest.mark.parametrize("client_secret", ["not-the-secret", "", SECRET + " ", SECRET[:-1]])
async def test_a_server_that_cannot_prove_the_secret_gets_no_proof(
    server: Server, client_secret: str
) -> None:
    with pytest.raises(LinkError) as raised:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await connect(server.address, client_secret, ME)
    assert raised.value.untrusted
    assert "did not prove our cluster secret" in str(raised.value)
    # The client checked the server's proof first and sent none of its own.
    assert server.servicer.calls == ["Challenge"]


async def test_a_wrong_proof_is_refused_and_logged(server: Server) -> None:
    async with _pinned_channel(server) as channel:
        stub = pb_grpc.ClusterStub(channel)
        nonce = b"n" * 32
        challenge = await stub.Challenge(pb.ChallengeRequest(client_nonce=nonce))
        request = _proof_request(
            challenge, nonce, server.certificate.fingerprint, ME, secret="guess"
        )
        assert await _code(stub.Prove(request)) == grpc.StatusCode.UNAUTHENTICATED
    assert len(server.warnings) == 1
    assert "wrong cluster secret" in server.warnings[0] and "127.0.0.1" in server.warnings[0]
    assert "guess" not in server.warnings[0]


def _proof_request(
    challenge: pb.ChallengeReply,
    nonce: bytes,
    server_fingerprint: bytes,
    identity: NodeCertificate,
    *,
    secret: str = SECRET,
    node_id: str | None = None,
    signer: NodeCertificate | None = None,
) -> pb.ProofRequest:
    """The `Prove` a caller sends: right by default; `node_id` states another
    id (proved with the secret), `signer` signs with another key."""
    stated = identity.node_id if node_id is None else node_id
    signature = (signer or identity).sign(
        identity_message(nonce, challenge.server_nonce, server_fingerprint, stated)
    )
    return pb.ProofRequest(
        client_nonce=nonce,
        server_nonce=challenge.server_nonce,
        client_proof=proof(
            secret, "exo-client", nonce, challenge.server_nonce, server_fingerprint, stated
        ),
        node_id=stated,
        certificate=identity.certificate_pem,
        signature=signature,
    )


async def test_a_proof_works_once_for_its_certificate_and_node_only(server: Server) -> None:
    other = NodeCertificate.create()
    async with _pinned_channel(server) as channel:
        stub = pb_grpc.ClusterStub(channel)
        nonce = b"c" * 32

        async def prove(
            certificate_fingerprint: bytes,
            node_id: str | None = None,
            signer: NodeCertificate | None = None,
        ) -> grpc.StatusCode:
            challenge = await stub.Challenge(pb.ChallengeRequest(client_nonce=nonce))
            request = _proof_request(
                challenge, nonce, certificate_fingerprint, ME, node_id=node_id, signer=signer
            )
            code = await _code(stub.Prove(request))
            # the same proof again: its challenge is used up
            assert await _code(stub.Prove(request)) == grpc.StatusCode.UNAUTHENTICATED
            return code

        assert await prove(server.certificate.fingerprint) == grpc.StatusCode.OK
        # made for another certificate (a relay in the middle): useless here
        assert await prove(other.fingerprint) == grpc.StatusCode.UNAUTHENTICATED
        # another node's id, with the right secret: not this certificate's node
        refused = [
            await prove(server.certificate.fingerprint, node_id=other.node_id),
            await prove(server.certificate.fingerprint, node_id=""),
            # this certificate's id, signed by another key
            await prove(server.certificate.fingerprint, signer=other),
        ]
        assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert any(
        f"it states node id {other.node_id}, but its certificate is node {ME.node_id}" in w
        for w in server.warnings
    )
    assert any("its signature is not its certificate's" in w for w in server.warnings)


async def test_a_member_that_states_another_nodes_id_gets_no_session(server: Server) -> None:
    """The whole client (`connect`) of a holder of the secret, as another node."""
    victim = NodeCertificate.create().node_id
    with pytest.raises(LinkError) as raised:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await connect(server.address, SECRET, Impostor.of(ME, victim))
    assert raised.value.untrusted
    assert "UNAUTHENTICATED" in str(raised.value) and victim in str(raised.value)
    assert server.servicer.calls == ["Challenge", "Prove"]


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        ((SESSION_METADATA_KEY, "garbage"),),
        ((SESSION_METADATA_KEY, "1.00.00.00"),),  # expired long ago
        ((SESSION_METADATA_KEY, "99999999999999.00.00.00"),),  # far future, not signed
    ],
)
async def test_calls_without_a_valid_session_are_refused_and_logged(
    server: Server, metadata: tuple[tuple[str, str], ...]
) -> None:
    async with _pinned_channel(server) as channel:
        assert await _code(_hello(channel, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await _code(_subscribe(channel, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
        )
        unknown = channel.unary_unary("/exo.cluster.Cluster/NoSuchMethod")
        assert (
            await _code(unknown(b"", timeout=RPC_TIMEOUT_S, metadata=metadata))
            == grpc.StatusCode.UNAUTHENTICATED  # no UNIMPLEMENTED probing
        )
    assert server.servicer.calls == []  # the handlers never ran
    assert len(server.warnings) == 3, server.warnings
    for log, method in zip(
        server.warnings, ("Hello", "SubscribeEvents", "NoSuchMethod"), strict=True
    ):
        assert f"/exo.cluster.Cluster/{method}" in log
        assert "127.0.0.1" in log
        assert "session token" in log


async def test_a_token_is_valid_on_the_server_that_issued_it_only(
    server: Server, tmp_path: Path, warnings: list[str]
) -> None:
    token = _grant(server.servicer.auth, server.certificate)
    metadata = ((SESSION_METADATA_KEY, token),)
    async with _pinned_channel(server) as channel:
        assert await _code(_hello(channel, metadata=metadata)) == grpc.StatusCode.OK
    # Another node of the same cluster (its own certificate) refuses it.
    async for second in _serve(SECRET, tmp_path / "second", warnings):
        async with _pinned_channel(second) as channel:
            assert (
                await _code(_hello(channel, metadata=metadata)) == grpc.StatusCode.UNAUTHENTICATED
            )


async def test_plaintext_calls_do_not_reach_the_server(server: Server) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        assert await _code(_hello(channel)) == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.calls == []


async def test_the_empty_secret_is_a_secret_of_its_own(open_server: Server) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S):
        async with peer_channel(open_server.address, "", ME) as channel:
            assert (await _hello(channel)).node_id == open_server.certificate.node_id
        with pytest.raises(LinkError):
            await connect(open_server.address, SECRET, ME)


async def test_nothing_listening_is_a_refused_link_error(tmp_path: Path) -> None:
    with pytest.raises(LinkError) as raised:
        await connect("127.0.0.1:1", SECRET, ME)
    assert raised.value.refused and not raised.value.untrusted


def test_the_certificate_is_kept_and_read_back(tmp_path: Path) -> None:
    first = NodeCertificate.load_or_create(tmp_path)
    assert NodeCertificate.load_or_create(tmp_path) == first
    assert (tmp_path / "key.pem").stat().st_mode & 0o077 == 0  # the key is private
    other = NodeCertificate.load_or_create(tmp_path / "other")
    assert other.fingerprint != first.fingerprint
    assert len(first.fingerprint) == 32


def _same_key(certificate: NodeCertificate) -> NodeCertificate:
    """Another certificate of `certificate`'s key."""
    key = serialization.load_pem_private_key(certificate.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return NodeCertificate.create(key)


def test_the_node_id_is_a_digest_of_the_certificates_key(tmp_path: Path) -> None:
    kept = NodeCertificate.load_or_create(tmp_path)
    assert re.fullmatch(r"node-[0-9a-f]{16}", kept.node_id)
    # a restart with the data dir is the same node
    assert NodeCertificate.load_or_create(tmp_path).node_id == kept.node_id
    assert node_id_of(kept.certificate_pem) == kept.node_id
    again = _same_key(kept)
    assert again.fingerprint != kept.fingerprint and again.node_id == kept.node_id
    assert NodeCertificate.create().node_id != kept.node_id
    with pytest.raises(ValueError):
        node_id_of(b"not a certificate")


async def test_the_peer_certificate_is_the_one_the_server_presents(server: Server) -> None:
    pem = await asyncio.to_thread(peer_certificate, server.address, RPC_TIMEOUT_S)
    assert fingerprint(pem) == server.certificate.fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


SERVER = NodeCertificate.create()


def _grant(
    auth: ServerAuth, server: NodeCertificate = SERVER, identity: NodeCertificate = ME
) -> str:
    challenge = auth.challenge(pb.ChallengeRequest(client_nonce=b"c"))
    request = _proof_request(challenge, b"c", server.fingerprint, identity)
    return auth.prove(request, "peer").token


def test_tokens_name_their_node_and_expire() -> None:
    clock = Clock()
    auth = ServerAuth(SECRET, SERVER, clock=clock)
    token = _grant(auth)
    assert auth.caller(token) == ME.node_id
    expires, nonce, node, mac = token.split(".")
    assert bytes.fromhex(node).decode() == ME.node_id
    forged = ".".join((expires, nonce, b"other".hex(), mac))
    assert auth.caller(forged) is None  # another node's name: the MAC no longer fits
    assert ServerAuth("other secret", SERVER, clock=clock).caller(token) is None
    assert ServerAuth(SECRET, NodeCertificate.create(), clock=clock).caller(token) is None
    clock.now += SESSION_SECONDS - 1
    assert auth.caller(token) == ME.node_id
    clock.now += 2
    assert auth.caller(token) is None


def test_a_member_cannot_make_a_token_with_the_secret() -> None:
    """A token MAC'd with the cluster secret (which every member knows), as
    tokens once were, names any node it likes: refused."""
    auth = ServerAuth(SECRET, SERVER)
    expires_ms = str(int((time.time() + 60) * 1000))
    nonce, node = b"n" * 16, b"node-0123456789abcdef"
    for message in (
        b"exo-session" + nonce + node + expires_ms.encode(),
        b"exo-session" + SERVER.fingerprint + nonce + node + expires_ms.encode(),
    ):
        mac = hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()
        assert auth.caller(f"{expires_ms}.{nonce.hex()}.{node.hex()}.{mac}") is None


def test_a_challenge_expires() -> None:
    clock = Clock()
    auth = ServerAuth(SECRET, SERVER, clock=clock)
    challenge = auth.challenge(pb.ChallengeRequest(client_nonce=b"c"))
    clock.now += 60
    with pytest.raises(ProofRefused, match="no such challenge"):
        auth.prove(_proof_request(challenge, b"c", SERVER.fingerprint, ME), "peer")


def test_a_node_id_held_by_a_live_session_with_another_certificate_is_refused_and_logged(
    warnings: list[str],
) -> None:
    clock = Clock()
    auth = ServerAuth(SECRET, SERVER, RejectionLog(log_interval_s=0.0), clock=clock)
    _grant(auth, identity=ME)
    other_certificate = _same_key(ME)  # the same id, another certificate
    with pytest.raises(ProofRefused, match="held by a live session with another certificate"):
        _grant(auth, identity=other_certificate)
    assert f"node id {ME.node_id} is held by a live session" in warnings[-1]
    clock.now += SESSION_SECONDS / 2
    _grant(auth, identity=ME)  # the holder renews: its session lives on
    clock.now += SESSION_SECONDS - 1
    with pytest.raises(ProofRefused):
        _grant(auth, identity=other_certificate)
    clock.now += 2  # the holder's last session ended
    assert auth.caller(_grant(auth, identity=other_certificate)) == ME.node_id


def test_repeated_refusals_are_logged_with_a_count(warnings: list[str]) -> None:
    clock = Clock()
    log = RejectionLog(log_interval_s=10.0, clock=clock)
    for _ in range(4):
        log.warn("ipv4:1.2.3.4:5", "/exo.cluster.Cluster/Hello", "no session token")
    assert len(warnings) == 1
    clock.now += 11
    log.warn("ipv4:1.2.3.4:5", "/exo.cluster.Cluster/Hello", "no session token")
    assert len(warnings) == 2
    assert "3 similar calls refused without logging" in warnings[1]


def test_validate_secret() -> None:
    assert validate_secret(" spaces ~ ok ") == " spaces ~ ok "
    for bad in ("caf\u00e9", "tab\there", "new\nline"):
        with pytest.raises(ValueError, match="printable ASCII"):
            validate_secret(bad)
        with pytest.raises(ValueError):
            ServerAuth(bad, SERVER)


async def test_a_peer_whose_hello_states_another_id_is_not_taken_as_that_node(
    server: Server, tmp_path: Path, warnings: list[str]
) -> None:
    """Membership takes a peer's id from its certificate: a Hello reply in
    another node's name is ignored (and logged), a right one is heard."""
    store = EventStore(ME.node_id, EventLog.open(tmp_path / "events.log"))
    timing = LinkTiming(heartbeat_seconds=0.05, peer_timeout_seconds=5, node_timeout_seconds=30)
    channels = Channels(SECRET, ME)
    membership = Membership(
        store, "127.0.0.1:1", channels, [server.address], lambda _: anyio.sleep(0), timing
    )

    async def hello_rounds() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(membership.run)
            await anyio.sleep(0.5)
            group.cancel_scope.cancel()

    victim = NodeCertificate.create().node_id
    server.servicer.hello_as = victim
    try:
        await hello_rounds()
        assert membership.peers() == []
        assert any(
            f"is node {server.certificate.node_id} (its certificate) but says it is node "
            f"'{victim}'" in w
            for w in warnings
        )
        server.servicer.hello_as = server.certificate.node_id
        await hello_rounds()
        assert [p.node_id for p in membership.peers()] == [server.certificate.node_id]
    finally:
        await channels.close()
