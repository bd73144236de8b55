"""A member of the cluster tries to speak as the node that serves a model (issue
26): this test process holds the cluster secret and a key of its own, and
calls real `exo` nodes over real gRPC as an attacker would. Every attempt is
refused, the serving node stays a peer, no client request reaches the
attacker, and its address never enters the cluster state."""

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import grpc
import grpc.aio
import openai
import pytest

from exo.cluster.auth import LinkError, connect
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.tls import NodeCertificate
from exo.shared.types.events import Event, NodeJoined, RunnerStatusChanged, event_adapter
from exo.shared.types.ids import InstanceId, NodeId
from tests.integration.cluster_process import SECRET, Cluster, agreed, wait_until
from tests.unit.impostor import Impostor

pytestmark = pytest.mark.slow

REFUSED = {"PERMISSION_DENIED", "UNAUTHENTICATED"}


@contextmanager
def trap() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server standing for the attacker's API: its address, and the
    requests that reached it."""
    reached: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            reached.append(f"{self.command} {self.path}")
            self.send_error(500)

        do_GET = do_POST = _record

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", reached
    finally:
        server.shutdown()
        server.server_close()


async def attack(
    addresses: list[str], master: str, victim: NodeId, instance: InstanceId, forged: str
) -> dict[str, str]:
    """Each way to speak as `victim`, against every node (publishing, against
    the master): the gRPC status each got."""
    me = NodeCertificate.create()
    outcomes: dict[str, str] = {}

    async def outcome(name: str, call: object) -> None:
        try:
            await call  # type: ignore[misc]
        except grpc.aio.AioRpcError as error:
            outcomes[name] = error.code().name
        else:
            outcomes[name] = "OK"

    for address in addresses:
        try:
            session = await connect(address, SECRET, Impostor.of(me, victim))
        except LinkError as error:
            outcomes[f"Prove as the victim at {address}"] = str(error).split()[1]
        else:
            await session.close()
            outcomes[f"Prove as the victim at {address}"] = "OK"
        session = await connect(address, SECRET, me)  # as itself: a member
        try:
            # Senior, --force-master, at an address that refuses connections.
            hello = pb.HelloRequest(
                node_id=victim, address="127.0.0.1:1", started_at_ms=1, force_master=True
            )
            await outcome(f"Hello as the victim at {address}", session.stub.Hello(hello))
            if address != master:
                continue

            def envelope(origin: str, event: Event) -> pb.LocalEventEnvelope:
                return pb.LocalEventEnvelope(
                    id=f"{origin}-{event.kind}",
                    origin=origin,
                    payload=event_adapter.dump_json(event),
                )

            joined = NodeJoined(
                node_id=victim, grpc_address=forged, api_address=forged, started_at_ms=1
            )
            failed = RunnerStatusChanged(
                instance_id=instance, node_id=victim, status="failed", error="forged"
            )
            for origin in (victim, me.node_id):
                for event in (joined, failed):
                    batch = pb.EventBatch(events=[envelope(origin, event)])
                    await outcome(
                        f"{event.kind} for the victim, as {'the victim' if origin == victim else 'itself'}",
                        session.stub.PublishEvents(batch),
                    )
        finally:
            await session.close()
    return outcomes


def test_a_member_cannot_speak_as_another_node_nor_draw_its_clients(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    cluster.models_dir = tiny_model_dir.parent
    serving = cluster.start(0, model=tiny_model_dir.name)
    serving.wait_for_runner("ready")
    relay = cluster.start(1)
    master_id = wait_until(lambda: agreed(cluster.nodes), 30, "agreement")
    serving_id = NodeId(serving.get("/node_id"))
    [instance_id] = relay.get("/state")["instances"]
    wait_until(
        lambda: relay.get("/state")["runners"][instance_id][serving_id]["status"] == "ready",
        20, "the runner's status reaching the other node",
    )  # fmt: skip
    master = next(n for n in cluster.nodes if n.get("/node_id") == master_id)
    addresses = [n.grpc_address for n in cluster.nodes]

    with trap() as (forged, reached):
        outcomes = anyio.run(
            attack, addresses, master.grpc_address, serving_id, InstanceId(instance_id), forged
        )
        print(json.dumps(outcomes, indent=1))
        assert len(outcomes) == 2 * 2 + 4
        assert set(outcomes.values()) <= REFUSED, outcomes
        # A heartbeat or two for anything the attempts changed to show.
        time.sleep(2)
        client = openai.OpenAI(base_url=f"{relay.base_url}/v1", api_key="x", timeout=60)
        reply = client.chat.completions.create(
            model=tiny_model_dir.name, messages=[{"role": "user", "content": "Hi."}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        assert reply.choices[0].message.content
        assert reached == []  # relayed to the serving node, never to the attacker

    for node in cluster.nodes:
        state = node.get("/state")
        assert forged not in json.dumps(state)
        assert state["nodes"][serving_id]["api_address"] == serving.base_url.removeprefix("http://")
        assert state["runners"][instance_id][serving_id]["status"] == "ready"
        assert node.get("/cluster")["master_id"] == master_id
        # The serving node stayed a peer: its instance was never dropped with it.
        assert f"node {serving_id} at" not in node.log()
    assert "refused" in master.log()
