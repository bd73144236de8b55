"""The cluster secret on a real grpc.aio server: right secret served, others UNAUTHENTICATED and logged."""

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from loguru import logger

from exo.cluster.auth import (
    SECRET_METADATA_KEY,
    ClusterSecretInterceptor,
    client_interceptors,
    cluster_channel,
    cluster_server,
    secret_fingerprint,
    secret_metadata,
    validate_secret,
)
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc

SECRET = "s3cret-of-the-test-cluster"
RPC_TIMEOUT_S = 5.0
TEST_TIMEOUT_S = 20.0


class Servicer(pb_grpc.ClusterServicer):
    """Hello answers; SubscribeEvents streams 3 envelopes from `from_idx`; calls are counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.HelloReply:
        self.calls.append("Hello")
        echoed = dict(context.invocation_metadata() or ()).get("x-test", "")
        return pb.HelloReply(
            node_id="server",
            address="127.0.0.1:0",
            started_at_ms=1,
            last_applied_idx=request.last_applied_idx,
            master_id=str(echoed),
            peers=[pb.Peer(node_id=request.node_id, address=request.address)],
        )

    async def SubscribeEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.IndexedEventEnvelope]:
        self.calls.append("SubscribeEvents")
        for idx in range(request.from_idx, request.from_idx + 3):
            yield pb.IndexedEventEnvelope(idx=idx, payload=f'{{"n":{idx}}}'.encode())


@dataclass
class Cluster:
    address: str
    servicer: Servicer
    warnings: list[str]


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(sink)


async def _start(secret: str, warnings: list[str]) -> AsyncIterator[Cluster]:
    servicer = Servicer()
    # every rejection logged (no rate limit), so the tests can count them
    interceptor = ClusterSecretInterceptor(secret, log_interval_s=0.0)
    server = grpc.aio.server(interceptors=[interceptor])
    pb_grpc.add_ClusterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Cluster(f"127.0.0.1:{port}", servicer, warnings)
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def cluster(warnings: list[str]) -> AsyncIterator[Cluster]:
    async for c in _start(SECRET, warnings):
        yield c


@pytest.fixture
async def open_cluster(warnings: list[str]) -> AsyncIterator[Cluster]:
    """A cluster started without --cluster-secret: the empty secret."""
    async for c in _start("", warnings):
        yield c


async def _hello(channel: grpc.aio.Channel, **kwargs: object) -> pb.HelloReply:
    stub = pb_grpc.ClusterStub(channel)
    request = pb.HelloRequest(node_id="client", address="127.0.0.1:1", last_applied_idx=7)
    return await stub.Hello(request, timeout=RPC_TIMEOUT_S, **kwargs)


async def _subscribe(
    channel: grpc.aio.Channel, from_idx: int = 10
) -> list[pb.IndexedEventEnvelope]:
    stub = pb_grpc.ClusterStub(channel)
    call = stub.SubscribeEvents(pb.SubscribeRequest(from_idx=from_idx), timeout=RPC_TIMEOUT_S)
    return [envelope async for envelope in call]


async def _collect(call: AsyncIterable[object]) -> list[object]:
    return [item async for item in call]


async def _idle_requests() -> AsyncIterator[bytes]:
    await asyncio.sleep(TEST_TIMEOUT_S)
    yield b"too late"


async def _assert_unauthenticated(call: Awaitable[object], details_part: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await call
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert details_part in (raised.value.details() or "")


async def test_right_secret_is_served_unary_and_streaming(cluster: Cluster) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S), cluster_channel(cluster.address, SECRET) as channel:
        reply = await _hello(channel)
        assert reply.node_id == "server"
        assert reply.last_applied_idx == 7
        assert [(p.node_id, p.address) for p in reply.peers] == [("client", "127.0.0.1:1")]

        envelopes = await _subscribe(channel, from_idx=10)
        assert [e.idx for e in envelopes] == [10, 11, 12]
        assert [e.payload for e in envelopes] == [b'{"n":10}', b'{"n":11}', b'{"n":12}']
    assert cluster.servicer.calls == ["Hello", "SubscribeEvents"]
    assert cluster.warnings == []


@pytest.mark.parametrize("client_secret", [None, "not-the-secret", "", SECRET + " ", SECRET[:-1]])
async def test_missing_or_wrong_secret_is_rejected_and_logged(
    cluster: Cluster, client_secret: str | None
) -> None:
    if client_secret is None:
        channel = grpc.aio.insecure_channel(cluster.address)
        reason = "missing"
    else:
        channel = cluster_channel(cluster.address, client_secret)
        reason = "wrong"
    async with channel:
        await _assert_unauthenticated(_hello(channel), f"{reason} cluster secret")
        await _assert_unauthenticated(_subscribe(channel), f"{reason} cluster secret")

    # The handlers never ran, and each rejection was logged with peer and method.
    assert cluster.servicer.calls == []
    assert len(cluster.warnings) == 2, cluster.warnings
    hello_log, subscribe_log = cluster.warnings
    for log, method in ((hello_log, "Hello"), (subscribe_log, "SubscribeEvents")):
        assert f"/exo.cluster.Cluster/{method}" in log
        assert "127.0.0.1" in log
        assert f"{reason} cluster secret" in log
        assert f"ours: {secret_fingerprint(SECRET)}" in log
        if client_secret is not None:
            assert f"theirs: {secret_fingerprint(client_secret)}" in log
        if client_secret:
            assert client_secret not in log  # a presented secret itself is never logged


async def test_unknown_method_is_rejected_as_unauthenticated(cluster: Cluster) -> None:
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        call = channel.unary_unary("/exo.cluster.Cluster/NoSuchMethod")
        await _assert_unauthenticated(call(b"", timeout=RPC_TIMEOUT_S), "missing cluster secret")
        # with the secret, the same call is an ordinary UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(b"", timeout=RPC_TIMEOUT_S, metadata=secret_metadata(SECRET))
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert len(cluster.warnings) == 1
    assert "/exo.cluster.Cluster/NoSuchMethod" in cluster.warnings[0]


async def test_explicit_metadata_and_interceptor_precedence(cluster: Cluster) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S):
        async with grpc.aio.insecure_channel(cluster.address) as plain:
            # explicit call metadata works without interceptors
            reply = await _hello(plain, metadata=(*secret_metadata(SECRET), ("x-test", "kept")))
            assert reply.master_id == "kept"
            # two values for the key, even if one is right, are rejected
            both = ((SECRET_METADATA_KEY, SECRET), (SECRET_METADATA_KEY, "wrong"))
            await _assert_unauthenticated(_hello(plain, metadata=both), "wrong cluster secret")

        async with grpc.aio.insecure_channel(
            cluster.address, interceptors=client_interceptors(SECRET)
        ) as channel:
            # the channel's secret replaces a stale one from the caller; other metadata stays
            metadata = (*secret_metadata("stale"), ("x-test", "kept"))
            reply = await _hello(channel, metadata=metadata)
            assert reply.master_id == "kept"
    assert cluster.servicer.calls == ["Hello", "Hello"]


async def test_empty_secret_is_a_secret_of_its_own(open_cluster: Cluster) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S):
        async with cluster_channel(open_cluster.address, "") as channel:
            assert (await _hello(channel)).node_id == "server"
            assert [e.idx for e in await _subscribe(channel, from_idx=0)] == [0, 1, 2]
        async with grpc.aio.insecure_channel(open_cluster.address) as channel:
            await _assert_unauthenticated(_hello(channel), "missing cluster secret")
            await _assert_unauthenticated(_subscribe(channel), "missing cluster secret")
        async with cluster_channel(open_cluster.address, SECRET) as channel:
            await _assert_unauthenticated(_hello(channel), "wrong cluster secret")
    assert len(open_cluster.warnings) == 3


async def test_cluster_server_helper(warnings: list[str]) -> None:
    server = cluster_server(SECRET)
    servicer = Servicer()
    pb_grpc.add_ClusterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            async with cluster_channel(f"127.0.0.1:{port}", SECRET) as channel:
                assert (await _hello(channel)).node_id == "server"
            async with cluster_channel(f"127.0.0.1:{port}", "other") as channel:
                await _assert_unauthenticated(_hello(channel), "wrong cluster secret")
    finally:
        await server.stop(grace=None)
    assert servicer.calls == ["Hello"]
    assert len(warnings) == 1


async def test_client_streaming_shapes(warnings: list[str]) -> None:
    """Stream-unary and stream-stream calls (none in the proto yet) are guarded the same way."""

    async def sum_lengths(requests: AsyncIterator[bytes], _context: object) -> bytes:
        return str(sum([len(r) async for r in requests])).encode()

    async def upper(requests: AsyncIterator[bytes], _context: object) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r.upper()

    server = cluster_server(SECRET)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Streams",
                {
                    "Total": grpc.stream_unary_rpc_method_handler(sum_lengths),
                    "Echo": grpc.stream_stream_rpc_method_handler(upper),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            for secret, ok in ((SECRET, True), ("other", False)):
                async with cluster_channel(f"127.0.0.1:{port}", secret) as channel:
                    total = channel.stream_unary("/test.Streams/Total")
                    echo = channel.stream_stream("/test.Streams/Echo")
                    requests = [b"a", b"bc"]
                    if ok:
                        assert await total(iter(requests), timeout=RPC_TIMEOUT_S) == b"3"
                        echoed = await _collect(echo(iter(requests), timeout=RPC_TIMEOUT_S))
                        assert echoed == [b"A", b"BC"]
                    else:
                        # Requests that never come: a grpc.aio client still writing requests
                        # when the server ends the call may report INTERNAL instead of the
                        # server's status (a client race, with or without this interceptor).
                        total_call = total(_idle_requests(), timeout=RPC_TIMEOUT_S)
                        await _assert_unauthenticated(total_call, "wrong cluster secret")
                        echo_call = echo(_idle_requests(), timeout=RPC_TIMEOUT_S)
                        await _assert_unauthenticated(_collect(echo_call), "wrong cluster secret")
    finally:
        await server.stop(grace=None)
    assert len(warnings) == 2
    assert "/test.Streams/Total" in warnings[0]
    assert "/test.Streams/Echo" in warnings[1]


async def test_repeated_rejections_are_logged_with_a_count(warnings: list[str]) -> None:
    now = [0.0]
    servicer = Servicer()
    interceptor = ClusterSecretInterceptor(SECRET, log_interval_s=10.0, clock=lambda: now[0])
    server = grpc.aio.server(interceptors=[interceptor])
    pb_grpc.add_ClusterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with cluster_channel(f"127.0.0.1:{port}", "wrong") as channel:
            for _ in range(4):
                await _assert_unauthenticated(_hello(channel), "wrong cluster secret")
            assert len(warnings) == 1
            now[0] = 11.0
            await _assert_unauthenticated(_hello(channel), "wrong cluster secret")
    finally:
        await server.stop(grace=None)
    assert len(warnings) == 2
    assert "3 similar calls rejected without logging" in warnings[1]
    assert servicer.calls == []


def test_secret_helpers() -> None:
    assert secret_fingerprint("") != secret_fingerprint("a")
    assert secret_fingerprint(SECRET) == secret_fingerprint(SECRET)
    assert len(secret_fingerprint(SECRET)) == 12
    assert SECRET not in secret_fingerprint(SECRET)
    assert secret_metadata("") == ((SECRET_METADATA_KEY, ""),)
    assert validate_secret(" spaces ~ ok ") == " spaces ~ ok "
    for bad in ("caf\u00e9", "tab\there", "new\nline"):
        with pytest.raises(ValueError, match="printable ASCII"):
            validate_secret(bad)
        with pytest.raises(ValueError):
            ClusterSecretInterceptor(bad)
        with pytest.raises(ValueError):
            client_interceptors(bad)
