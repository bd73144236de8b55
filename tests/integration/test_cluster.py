"""Cluster behaviour with several real `exo` processes on loopback."""

import signal
import time
from pathlib import Path

import anyio
import grpc
import grpc.aio
import openai
import pytest

from exo.cluster.auth import LinkError, peer_channel
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import NodeCertificate
from tests.e2e.node_process import start_node
from tests.integration.cluster_process import (
    NODE_TIMEOUT,
    SECRET,
    Cluster,
    agreed,
    events,
    wait_until,
)

pytestmark = pytest.mark.slow

# A new master after the old one's death: the bound asserted and the wait (longer, so
# that a slow machine fails on the assertion, with the time it took). Seen: 0.4-0.8 s,
# the link noticing the death at once; below the peer timeout (5 s), which a frozen
# master would be waited for.
ELECTED_WITHIN_S = 4.0
ELECTION_WAIT_S = 30.0


def test_three_nodes_agree_and_survive_the_masters_death(cluster: Cluster) -> None:
    for i in range(3):
        cluster.start(i)
    master = wait_until(lambda: agreed(cluster.nodes), 30, "three nodes agreeing")
    assert len(cluster.nodes[0].get("/state")["nodes"]) == 3

    by_id = {n.get("/node_id"): n for n in cluster.nodes}
    old_master = by_id.pop(master)
    survivors = list(by_id.values())
    history = events(survivors[0])
    old_master.process.send_signal(signal.SIGKILL)
    old_master.process.wait(10)
    killed_at = time.monotonic()

    def new_master() -> str | None:
        views = {n.get("/cluster")["master_id"] for n in survivors}
        return views.pop() if len(views) == 1 and master not in views else None

    elected = wait_until(new_master, ELECTION_WAIT_S, "a new master")
    elected_after = time.monotonic() - killed_at
    print(f"a new master {elected_after:.1f}s after the old one's death")
    assert elected_after < ELECTED_WITHIN_S, f"a new master after {elected_after:.1f}s"
    assert elected in by_id
    # The survivors keep the same history, continued with no gap and no fork.
    wait_until(lambda: all(n.get("/state")["master_id"] == elected for n in survivors), 10, "state")
    after = [events(n) for n in survivors]
    assert after[0][: len(history)] == history
    for log in after:
        assert [e["idx"] for e in log] == list(range(len(log)))
    shortest = min(len(a) for a in after)
    assert after[0][:shortest] == after[1][:shortest]
    # The dead master is timed out of the state.
    wait_until(lambda: master not in survivors[0].get("/state")["nodes"], 20, "timeout")


def test_a_restarted_node_resumes_from_its_last_index(cluster: Cluster) -> None:
    for i in range(3):
        cluster.start(i)
    wait_until(lambda: agreed(cluster.nodes), 30, "agreement")
    follower = next(n for n in cluster.nodes if n.get("/cluster")["master_id"] != n.get("/node_id"))
    index = cluster.nodes.index(follower)
    applied = follower.get("/state")["last_idx"]
    follower_id = follower.get("/node_id")
    follower.process.send_signal(signal.SIGKILL)
    follower.process.wait(10)
    restarted = cluster.start(index)
    resumed = restarted.get("/cluster")["resumed_from_idx"]
    assert resumed == applied + 1  # it did not replay from 0
    assert restarted.get("/node_id") == follower_id  # its data dir keeps its id
    wait_until(lambda: agreed(cluster.nodes), 30, "agreement after the restart")


def test_a_node_with_the_wrong_secret_never_joins(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(0)
    cluster.start(1)
    wait_until(lambda: agreed(cluster.nodes), 30, "agreement")
    intruder = start_node(
        tmp_path, cluster.models_dir, "--no-worker", "--peers", cluster.peers,
        "--cluster-secret", "wrong", data_dir=tmp_path / "intruder",
    )  # fmt: skip
    try:
        intruder.wait_for_api()
        intruder_id = intruder.get("/node_id")
        # It waits a peer timeout for the peers it was told of, then is alone.
        wait_until(lambda: intruder.get("/cluster")["master_id"] == intruder_id, 15, "alone")
        for node in cluster.nodes:
            assert intruder_id not in node.get("/state")["nodes"]
        # The intruder found that the nodes cannot prove its secret, and sent
        # them nothing: they never heard of it.
        assert "is not of this cluster" in intruder.log()
        assert intruder.grpc_address not in cluster.nodes[0].log()
    finally:
        intruder.stop()

    probe = NodeCertificate.create()

    async def call(secret: str) -> str:
        try:
            async with peer_channel(cluster.nodes[0].grpc_address, secret, probe) as ch:
                hello = pb.HelloRequest(node_id=probe.node_id)
                await pb_grpc.ClusterStub(ch).Hello(hello, timeout=5)
        except LinkError as error:
            return "untrusted" if error.untrusted else "unreachable"
        return "ok"

    async def plaintext() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(cluster.nodes[0].grpc_address) as channel:
            try:
                await pb_grpc.ClusterStub(channel).Hello(pb.HelloRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    assert anyio.run(call, "wrong") == "untrusted"
    assert anyio.run(call, SECRET) == "ok"
    assert anyio.run(plaintext) == grpc.StatusCode.UNAVAILABLE  # TLS only


def test_chat_through_another_node_and_timeout_of_a_silent_node(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    cluster.models_dir = tiny_model_dir.parent
    serving = cluster.start(0, model=tiny_model_dir.name)
    serving.wait_for_runner("ready")
    relay = cluster.start(1)
    wait_until(lambda: agreed(cluster.nodes), 30, "agreement")
    wait_until(
        lambda: any(
            r["status"] == "ready"
            for ranks in relay.get("/state")["runners"].values()
            for r in ranks.values()
        ),
        20, "the runner's status reaching the other node",
    )  # fmt: skip
    question = [{"role": "user", "content": "Say something."}]
    replies = []
    for node in (serving, relay):
        client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=60)
        stream = client.chat.completions.create(
            model=tiny_model_dir.name, messages=question, temperature=0, max_tokens=12,  # type: ignore[arg-type]
            stream=True,
        )  # fmt: skip
        replies.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert replies[0] and replies[0] == replies[1]
    assert [
        m.id for m in openai.OpenAI(base_url=f"{relay.base_url}/v1", api_key="x").models.list().data
    ] == [tiny_model_dir.name]

    # The serving node stops answering (frozen, not dead): its instance goes when
    # the link loses it (no other node runs a worker to take the model), and
    # the node is timed out.
    serving_id = serving.get("/node_id")
    serving.process.send_signal(signal.SIGSTOP)
    try:

        def gone() -> bool:
            state = relay.get("/state")
            return serving_id not in state["nodes"] and not state["instances"]

        wait_until(gone, 30, "the silent node timing out")
    finally:
        serving.process.send_signal(signal.SIGCONT)


def test_instances_placed_and_deleted_through_any_node_start_and_stop_runners(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    import httpx

    cluster.models_dir = tiny_model_dir.parent
    worker = cluster.start(0, model=tiny_model_dir.name)
    worker.wait_for_runner("ready")
    relay = cluster.start(1)
    wait_until(lambda: agreed(cluster.nodes), 30, "agreement")
    worker_id = worker.get("/node_id")
    [instance_id] = relay.get("/state")["instances"]

    response = httpx.delete(f"{relay.base_url}/instance/{instance_id}", timeout=15)
    assert response.status_code == 200
    wait_until(lambda: not worker.health()["runners"], 20, "the runner shutting down")
    assert not worker.get("/state")["runners"]
    missing = httpx.delete(f"{relay.base_url}/instance/{instance_id}", timeout=15)
    assert missing.status_code == 404
    assert "no instance" in missing.json()["error"]["message"]

    created = httpx.post(
        f"{relay.base_url}/instance",
        json={"model_id": tiny_model_dir.name, "node_id": worker_id},
        timeout=15,
    )
    assert created.status_code == 201
    new_id = created.json()["instance_id"]
    wait_until(
        lambda: relay.get("/state")["runners"].get(new_id, {}).get(worker_id, {}).get("status")
        == "ready",
        60, "the new runner ready",
    )  # fmt: skip
    bad = httpx.post(
        f"{relay.base_url}/instance", json={"model_id": "x", "node_id": "ghost"}, timeout=15
    )
    assert bad.status_code == 404
    # A model no node has: refused, with what the cluster does know.
    absent = httpx.post(
        f"{relay.base_url}/instance",
        json={"model_id": "absent-model", "node_id": worker_id},
        timeout=15,
    )
    assert absent.status_code == 404
    assert "no node has model 'absent-model'" in absent.json()["error"]["message"]
    assert tiny_model_dir.name in absent.json()["error"]["message"]


def test_two_clusters_that_meet_merge_into_one(cluster: Cluster, tmp_path: Path) -> None:
    """A and B start alone (each its own master); C knows both, and through its
    greetings they meet: one master wins, the other side takes its history."""
    alone = [
        start_node(
            tmp_path,
            cluster.models_dir,
            "--no-worker",
            "--cluster-secret",
            SECRET,
            "--node-timeout-seconds",
            NODE_TIMEOUT,
            data_dir=tmp_path / f"alone{i}",
            grpc_port=cluster.ports[i],
        )
        for i in range(2)
    ]
    cluster.nodes.extend(alone)
    for node in alone:
        node.wait_for_api()
        wait_until(lambda n=node: n.get("/cluster")["master_id"] == n.get("/node_id"), 15, "alone")
    cluster.start(2)
    master = wait_until(lambda: agreed(cluster.nodes), 45, "one cluster")
    assert master in {n.get("/node_id") for n in alone}
    for node in cluster.nodes:
        log = events(node)
        assert [e["idx"] for e in log] == list(range(len(log)))
