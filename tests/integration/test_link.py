"""Two cluster links in one process over loopback gRPC: a command sent from a
follower is carried out by the master, and its reply's index is the one to
wait for to see the effect on the follower; a node publishes only its own
events; a peer lists only the model files inside the model's folder."""

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import grpc
import grpc.aio
import pytest

from exo.cluster.link import ClusterLink
from exo.cluster.model_files import PeerSource
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.timing import LinkTiming
from exo.cluster.tls import NodeCertificate
from exo.master.master import Master
from exo.models.file_source import SourceUnavailable
from exo.models.local_store import ModelStore
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore
from exo.shared.types.commands import (
    CommandRejected,
    CreateInstance,
    DeleteInstance,
    PlaceInstance,
)
from exo.shared.types.events import (
    Event,
    MasterElected,
    NodeJoined,
    NodeTelemetryReported,
    NodeTimedOut,
    event_adapter,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import InstanceRank, NodeTelemetry
from tests.unit.sharded_card import GB, sharded_card

TIMING = LinkTiming(heartbeat_seconds=0.1, peer_timeout_seconds=0.5, node_timeout_seconds=30)
M = ModelId("org/m")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@asynccontextmanager
async def two_links(
    tmp_path: Path, models: ModelStore | None = None
) -> AsyncIterator[tuple[ClusterLink, ClusterLink]]:
    """Node a (--force-master, serving the model files of `models`) and node b,
    joined and with telemetry."""
    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    links: list[ClusterLink] = []
    async with anyio.create_task_group() as group:
        for name, port, force in (("a", ports[0], True), ("b", ports[1], False)):
            link = _link(tmp_path, name, port, peers, force, models if force else None)
            await group.start(_run, link)
            group.start_soon(link.master.run)
            links.append(link)
        a, b = links
        for link in links:
            link.publish(
                NodeJoined(node_id=link.node_id, grpc_address=link.address, started_at_ms=0),
                NodeTelemetryReported(
                    node_id=link.node_id,
                    telemetry=NodeTelemetry(
                        ram_total=8 * GB,
                        ram_available=8 * GB,
                        disk_free=100 * GB,
                        cpu_count=8,
                        platform="linux",
                        mlx_backend="cpu",
                    ),
                ),
            )
        with anyio.fail_after(10):
            while not (a.master.in_office and b.master_id == a.node_id and len(b.state.nodes) == 2):
                await b.wait_until(b.state.last_idx + 1, 1)
        yield a, b
        group.cancel_scope.cancel()


def _link(
    tmp_path: Path,
    name: str,
    port: int,
    peers: list[str],
    force: bool,
    models: ModelStore | None,
) -> ClusterLink:
    """A node's link and master, wired as a node wires them."""
    certificate = NodeCertificate.load_or_create(tmp_path / f"{name}-tls")
    store = EventStore(certificate.node_id, EventLog.open(tmp_path / f"{name}.log"))
    links: list[ClusterLink] = []
    master = Master(
        store,
        TIMING.node_timeout_seconds,
        TIMING.heartbeat_seconds,
        heard_ms=lambda: links[0].membership.heard_ms(),
    )
    links.append(
        ClusterLink(
            store,
            master,
            "127.0.0.1",
            port,
            "127.0.0.1",
            "secret",
            peers,
            TIMING,
            certificate,
            force_master=force,
            model_store=models,
        )
    )
    return links[0]


async def _run(link: ClusterLink, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    await link.run(on_ready=task_status.started)


async def test_a_command_from_a_follower_returns_the_index_that_shows_its_effect(
    tmp_path: Path,
) -> None:
    async with two_links(tmp_path) as (a, b):
        assert not b.master.in_office
        card = sharded_card(M)
        place = PlaceInstance(instance_id=InstanceId("p"), model_id=M, max_nodes=1, card=card)
        last_idx = await b.send_command(place)
        assert a.state.instances[InstanceId("p")].model_id == M  # the master applied it
        assert a.state.cards[M] == card  # with the card it brought
        assert await b.wait_until(last_idx, 5)
        assert InstanceId("p") in b.state.instances
        # Sent again (a retry): nothing new, and the index still shows the effect.
        assert await b.send_command(place) >= last_idx
        assert len(a.state.instances) == 1


async def test_a_refused_command_raises_with_the_masters_reason(tmp_path: Path) -> None:
    async with two_links(tmp_path) as (_, b):
        with pytest.raises(CommandRejected, match="no instance 'nope'") as info:
            await b.send_command(DeleteInstance(instance_id=InstanceId("nope")))
        assert info.value.not_found
        rank = InstanceRank(node_id=NodeId("ghost"), start_layer=0, end_layer=4)
        with pytest.raises(CommandRejected, match="no node 'ghost'"):
            await b.send_command(
                CreateInstance(instance_id=InstanceId("c"), model_id=M, ranks=(rank,))
            )


async def test_a_command_with_a_bad_model_id_is_refused_at_the_edge(tmp_path: Path) -> None:
    async with two_links(tmp_path) as (a, b):
        stub = await b._channels.stub(a.address)  # pyright: ignore[reportPrivateUsage]
        for bad in ("../../etc", "/abs", "a/b/c", "."):
            payload = (
                f'{{"kind": "place_instance", "instance_id": "p", "model_id": "{bad}"}}'.encode()
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.SendCommand(pb.CommandEnvelope(id=bad, origin="b", payload=payload))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert a.state.instances == {}


async def test_a_node_publishes_only_its_own_events(tmp_path: Path) -> None:
    async with two_links(tmp_path) as (a, b):
        stub = await b._channels.stub(a.address)  # pyright: ignore[reportPrivateUsage]
        before = a.store.next_idx

        def envelope(origin: str, event: Event) -> pb.LocalEventEnvelope:
            return pb.LocalEventEnvelope(
                id=origin + event.kind, origin=origin, payload=event_adapter.dump_json(event)
            )

        # In another node's name: refused as a whole.
        joined_a = NodeJoined(node_id=a.node_id, grpc_address="x:1", started_at_ms=1)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.PublishEvents(pb.EventBatch(events=[envelope(a.node_id, joined_a)]))
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # In its own name: its own facts are indexed; the master's decisions and
        # another node's facts are not, and the refusal is the answer.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.PublishEvents(
                pb.EventBatch(
                    events=[
                        envelope(b.node_id, NodeTimedOut(node_id=a.node_id)),
                        envelope(b.node_id, MasterElected(master_id=b.node_id, term=99)),
                        envelope(b.node_id, joined_a),
                        envelope(
                            b.node_id,
                            NodeJoined(node_id=b.node_id, grpc_address=b.address, started_at_ms=2),
                        ),
                    ]
                )
            )
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert raised.value.details() == (
            f"refused event(s) that node {b.node_id} may not publish: "
            "master_elected, node_joined, node_timed_out"
        )
        assert a.store.next_idx == before + 1
        assert a.state.nodes[b.node_id].started_at_ms == 2
        assert a.state.master_id == a.node_id and a.node_id in a.state.nodes
        assert a.state.nodes[a.node_id].grpc_address == a.address


async def test_a_peer_lists_only_the_files_inside_the_models_folder(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "org--m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "weights.safetensors").write_bytes(b"w" * 10)
    (tmp_path / "outside.txt").write_text("not the model's")
    (folder / "escape.txt").symlink_to(tmp_path / "outside.txt")
    (folder / "alias.json").symlink_to(folder / "config.json")  # a link inside the folder
    async with two_links(tmp_path, ModelStore(tmp_path / "models")) as (a, b):
        source = PeerSource(a.node_id, a.address, "secret", b.certificate)
        listed = await source.list_files(M)
        assert [f.path for f in listed] == ["alias.json", "config.json", "weights.safetensors"]
        assert listed[2].size == 10
        with pytest.raises(SourceUnavailable, match=r"no file 'escape\.txt'"):
            async for _ in source.read(M, "escape.txt", 0):
                pass
