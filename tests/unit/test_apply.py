"""`apply` is pure and total: one table row per situation, every event kind."""

from functools import reduce

import pytest

from exo.shared.apply import apply
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    MasterElected,
    NodeJoined,
    NodeTelemetryReported,
    NodeTimedOut,
    RunnerStatusChanged,
    indexed_event_adapter,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, NodeInfo, NodeTelemetry, RunnerInfo, State

A, B = NodeId("node-a"), NodeId("node-b")
I1, I2 = InstanceId("inst-1"), InstanceId("inst-2")
MODEL = ModelId("SmolLM2-135M-Instruct")
TELEMETRY = NodeTelemetry(
    ram_total=24 << 30, ram_available=20 << 30, disk_free=50 << 30, cpu_count=2,
    platform="linux", mlx_backend="cpu",
)  # fmt: skip


def node(node_id: NodeId, seen: int = 100, telemetry: NodeTelemetry | None = None) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, grpc_address=f"{node_id}:52414", started_at_ms=1, telemetry=telemetry,
        last_seen_ms=seen,
    )  # fmt: skip


def inst(instance_id: InstanceId, node_id: NodeId) -> Instance:
    return Instance(instance_id=instance_id, model_id=MODEL, node_id=node_id)


BASE = State(
    nodes={A: node(A), B: node(B)},
    instances={I1: inst(I1, A), I2: inst(I2, B)},
    runners={
        I1: RunnerInfo(instance_id=I1, node_id=A, status="ready"),
        I2: RunnerInfo(instance_id=I2, node_id=B, status="loading"),
    },
    master_id=A,
    master_term=3,
    last_idx=9,
)


def ev(event: Event, origin: NodeId = A, at_ms: int = 200) -> IndexedEvent:
    return IndexedEvent(idx=10, at_ms=at_ms, origin=origin, event=event)


def with_(state: State, **update: object) -> State:
    return state.model_copy(update={"last_idx": 10, **update})


CASES: list[tuple[str, IndexedEvent, State]] = [
    (
        "a new node joins",
        ev(NodeJoined(node_id=NodeId("node-c"), grpc_address="c:1", started_at_ms=5), NodeId("node-c")),
        with_(BASE, nodes={**BASE.nodes, NodeId("node-c"): NodeInfo(
            node_id=NodeId("node-c"), grpc_address="c:1", started_at_ms=5, last_seen_ms=200)}),
    ),
    (
        "a known node rejoins with a new address",
        ev(NodeJoined(node_id=B, grpc_address="b2:1", started_at_ms=7), A),
        with_(BASE, nodes={A: node(A, seen=200), B: NodeInfo(
            node_id=B, grpc_address="b2:1", started_at_ms=7, last_seen_ms=200)}),
    ),
    (
        "telemetry of a known node",
        ev(NodeTelemetryReported(node_id=B, telemetry=TELEMETRY), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200, telemetry=TELEMETRY)}),
    ),
    (
        "telemetry of an unknown node is ignored",
        ev(NodeTelemetryReported(node_id=NodeId("ghost"), telemetry=TELEMETRY), NodeId("ghost")),
        with_(BASE),
    ),
    (
        "a timed-out node leaves with its instances and runners",
        ev(NodeTimedOut(node_id=B)),
        with_(BASE, nodes={A: node(A, seen=200)}, instances={I1: inst(I1, A)},
              runners={I1: BASE.runners[I1]}),
    ),
    (
        "the master timing out clears the master",
        ev(NodeTimedOut(node_id=A), B),
        with_(BASE, nodes={B: node(B, seen=200)}, instances={I2: inst(I2, B)},
              runners={I2: BASE.runners[I2]}, master_id=None),
    ),
    (
        "timing out an unknown node changes nothing",
        ev(NodeTimedOut(node_id=NodeId("ghost"))),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}),
    ),
    (
        "a newer election",
        ev(MasterElected(master_id=B, term=4)),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}, master_id=B, master_term=4),
    ),
    (
        "a stale election result is ignored",
        ev(MasterElected(master_id=B, term=2)),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}),
    ),
    (
        "an instance is created on a known node",
        ev(InstanceCreated(instance=inst(InstanceId("inst-3"), B))),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)},
              instances={**BASE.instances, InstanceId("inst-3"): inst(InstanceId("inst-3"), B)}),
    ),
    (
        "an instance on an unknown node is ignored",
        ev(InstanceCreated(instance=inst(InstanceId("inst-3"), NodeId("ghost")))),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}),
    ),
    (
        "an instance is deleted with its runner",
        ev(InstanceDeleted(instance_id=I2)),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}, instances={I1: inst(I1, A)},
              runners={I1: BASE.runners[I1]}),
    ),
    (
        "deleting an unknown instance changes nothing",
        ev(InstanceDeleted(instance_id=InstanceId("nope"))),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}),
    ),
    (
        "a runner reports its status",
        ev(RunnerStatusChanged(instance_id=I2, node_id=B, status="failed", error="boom"), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200)}, runners={
            I1: BASE.runners[I1],
            I2: RunnerInfo(instance_id=I2, node_id=B, status="failed", error="boom")}),
    ),
    (
        "a runner status for an instance of another node is ignored",
        ev(RunnerStatusChanged(instance_id=I2, node_id=A, status="ready"), A),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B)}),
    ),
    (
        "an event from an unknown origin only advances the index",
        ev(MasterElected(master_id=A, term=3), NodeId("ghost")),
        with_(BASE),
    ),
    (
        "an older timestamp does not move last_seen back",
        ev(MasterElected(master_id=A, term=3), A, at_ms=50),
        with_(BASE),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "event", "expected"), CASES, ids=[c[0] for c in CASES])
def test_apply(name: str, event: IndexedEvent, expected: State) -> None:
    before = BASE.model_dump()
    assert apply(BASE, event) == expected
    assert BASE.model_dump() == before  # pure: the input state is untouched


def test_every_event_kind_has_a_case() -> None:
    kinds = {case[1].event.kind for case in CASES}
    all_kinds = {
        cls.model_fields["kind"].default
        for cls in (NodeJoined, NodeTelemetryReported, NodeTimedOut, MasterElected,
                    InstanceCreated, InstanceDeleted, RunnerStatusChanged)
    }  # fmt: skip
    assert kinds == all_kinds


def test_fold_of_the_same_events_is_the_same_state_after_serialization() -> None:
    """Nodes rebuild state from events read off the wire: JSON round trips agree."""
    events = [
        IndexedEvent(idx=0, at_ms=1, origin=A, event=NodeJoined(node_id=A, grpc_address="a:1", started_at_ms=1)),
        IndexedEvent(idx=1, at_ms=2, origin=A, event=MasterElected(master_id=A, term=1)),
        IndexedEvent(idx=2, at_ms=3, origin=B, event=NodeJoined(node_id=B, grpc_address="b:1", started_at_ms=2)),
        IndexedEvent(idx=3, at_ms=4, origin=B, event=NodeTelemetryReported(node_id=B, telemetry=TELEMETRY)),
        IndexedEvent(idx=4, at_ms=5, origin=A, event=InstanceCreated(instance=inst(I1, B))),
        IndexedEvent(idx=5, at_ms=6, origin=B, event=RunnerStatusChanged(instance_id=I1, node_id=B, status="ready")),
    ]  # fmt: skip
    direct = reduce(apply, events, State())
    wire = [indexed_event_adapter.validate_json(indexed_event_adapter.dump_json(e)) for e in events]
    assert reduce(apply, wire, State()) == direct
    assert direct.last_idx == 5
    assert direct.runners[I1].status == "ready"
    assert direct.nodes[B].telemetry == TELEMETRY
    assert State.model_validate_json(direct.model_dump_json()) == direct


def test_a_rejoining_node_keeps_its_telemetry() -> None:
    start = BASE.model_copy(update={"nodes": {**BASE.nodes, B: node(B, telemetry=TELEMETRY)}})
    after = apply(start, ev(NodeJoined(node_id=B, grpc_address="b2:1", started_at_ms=7), B))
    assert after.nodes[B].telemetry == TELEMETRY
    assert after.nodes[B].grpc_address == "b2:1"
