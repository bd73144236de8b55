"""The cluster link's authentication on a real grpc.aio TLS server: the
challenge (server first, bound to its certificate), session tokens, and what
is refused (UNAUTHENTICATED, logged with a rate limit)."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from loguru import logger

from exo.cluster.auth import (
    SESSION_METADATA_KEY,
    SESSION_SECONDS,
    LinkError,
    RejectionLog,
    ServerAuth,
    SessionInterceptor,
    connect,
    peer_channel,
    proof,
    validate_secret,
)
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import NodeCertificate, fingerprint, peer_certificate, server_credentials
from exo.shared.types.ids import NodeId

SECRET = "s3cret-of-the-test-cluster"
ME = NodeId("client-node")
RPC_TIMEOUT_S = 5.0
TEST_TIMEOUT_S = 20.0


class Servicer(pb_grpc.ClusterServicer):
    """Challenge and Prove as the link answers them; Hello and SubscribeEvents
    record the caller; every call is counted."""

    def __init__(self, auth: ServerAuth) -> None:
        self.auth = auth
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
        grant = self.auth.prove(request, context.peer())
        if grant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong proof")
            raise AssertionError
        return grant

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.HelloReply:
        self.calls.append("Hello")
        self.callers.append(self.auth.caller_of(context))
        return pb.HelloReply(node_id="server", last_applied_idx=request.last_applied_idx)

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
    auth = ServerAuth(secret, certificate.fingerprint, RejectionLog(log_interval_s=0.0))
    servicer = Servicer(auth)
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
    assert server.servicer.callers == [ME]  # the session speaks for the node that proved
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
        wrong = proof(
            "guess", "exo-client", nonce, challenge.server_nonce, server.certificate.fingerprint, ME
        )
        request = pb.ProofRequest(
            client_nonce=nonce, server_nonce=challenge.server_nonce, client_proof=wrong, node_id=ME
        )
        assert await _code(stub.Prove(request)) == grpc.StatusCode.UNAUTHENTICATED
    assert len(server.warnings) == 1
    assert "wrong cluster secret" in server.warnings[0] and "127.0.0.1" in server.warnings[0]
    assert "guess" not in server.warnings[0]


async def test_a_proof_works_once_for_its_certificate_and_node_only(
    server: Server, tmp_path: Path
) -> None:
    other_certificate = NodeCertificate.load_or_create(tmp_path / "relay")
    async with _pinned_channel(server) as channel:
        stub = pb_grpc.ClusterStub(channel)
        nonce = b"c" * 32

        async def prove(
            certificate_fingerprint: bytes, node_id: str, claimed: str | None = None
        ) -> grpc.StatusCode:
            challenge = await stub.Challenge(pb.ChallengeRequest(client_nonce=nonce))
            client_proof = proof(
                SECRET,
                "exo-client",
                nonce,
                challenge.server_nonce,
                certificate_fingerprint,
                node_id,
            )
            request = pb.ProofRequest(
                client_nonce=nonce,
                server_nonce=challenge.server_nonce,
                client_proof=client_proof,
                node_id=node_id if claimed is None else claimed,
            )
            code = await _code(stub.Prove(request))
            # the same proof again: its challenge is used up
            assert await _code(stub.Prove(request)) == grpc.StatusCode.UNAUTHENTICATED
            return code

        assert await prove(server.certificate.fingerprint, ME) == grpc.StatusCode.OK
        # made for another certificate (a relay in the middle): useless here
        assert await prove(other_certificate.fingerprint, ME) == grpc.StatusCode.UNAUTHENTICATED
        # made for one node, claimed for another
        assert (
            await prove(server.certificate.fingerprint, ME, claimed="other-node")
            == grpc.StatusCode.UNAUTHENTICATED
        )


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
    token = _grant(server.servicer.auth, server.certificate.fingerprint)
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
            assert (await _hello(channel)).node_id == "server"
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


async def test_the_peer_certificate_is_the_one_the_server_presents(server: Server) -> None:
    pem = await asyncio.to_thread(peer_certificate, server.address, RPC_TIMEOUT_S)
    assert fingerprint(pem) == server.certificate.fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _grant(auth: ServerAuth, fp: bytes, node_id: str = ME) -> str:
    challenge = auth.challenge(pb.ChallengeRequest(client_nonce=b"c"))
    grant = auth.prove(
        pb.ProofRequest(
            client_nonce=b"c",
            server_nonce=challenge.server_nonce,
            client_proof=proof(SECRET, "exo-client", b"c", challenge.server_nonce, fp, node_id),
            node_id=node_id,
        ),
        "peer",
    )
    assert grant is not None
    return grant.token


def test_tokens_name_their_node_and_expire() -> None:
    clock = Clock()
    fp = b"f" * 32
    auth = ServerAuth(SECRET, fp, clock=clock)
    token = _grant(auth, fp)
    assert auth.caller(token) == ME
    expires, nonce, node, mac = token.split(".")
    assert bytes.fromhex(node).decode() == ME
    forged = ".".join((expires, nonce, b"other".hex(), mac))
    assert auth.caller(forged) is None  # another node's name: the MAC no longer fits
    assert ServerAuth("other secret", fp, clock=clock).caller(token) is None
    assert ServerAuth(SECRET, b"g" * 32, clock=clock).caller(token) is None
    clock.now += SESSION_SECONDS - 1
    assert auth.caller(token) == ME
    clock.now += 2
    assert auth.caller(token) is None


def test_a_challenge_expires() -> None:
    clock = Clock()
    fp = b"f" * 32
    auth = ServerAuth(SECRET, fp, clock=clock)
    challenge = auth.challenge(pb.ChallengeRequest(client_nonce=b"c"))
    clock.now += 60
    request = pb.ProofRequest(
        client_nonce=b"c",
        server_nonce=challenge.server_nonce,
        client_proof=proof(SECRET, "exo-client", b"c", challenge.server_nonce, fp, ME),
        node_id=ME,
    )
    assert auth.prove(request, "peer") is None


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
            ServerAuth(bad, b"f" * 32)
