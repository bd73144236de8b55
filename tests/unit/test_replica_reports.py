"""What nodes report about their replicas for routing: the events a node
publishes (`CacheReports`, `report_load`), who may publish them, and the state
they fold into."""

from dataclasses import dataclass, field

from exo.master.master import may_originate
from exo.shared.apply import apply
from exo.shared.replica_reports import CacheReports, local_replica, report_load
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    InstanceDeleted,
    NodeTimedOut,
    ReplicaReported,
)
from exo.shared.types.ids import NodeId
from exo.shared.types.state import ReplicaReport, State
from tests.unit.test_apply import I1, I2, MODEL, A, B, inst
from tests.unit.test_apply import node as node_info

# I1 is served by A alone; I2 is a pipeline whose first rank is B's.
STATE = State(instances={I1: inst(I1, A), I2: inst(I2, B, A)})


def ev(event: Event, origin: NodeId) -> IndexedEvent:
    return IndexedEvent(idx=1, at_ms=1, origin=origin, event=event)


@dataclass
class Node:
    """A node as the reporters see it: its id, its copy of the state, what it published."""

    node_id: NodeId
    state: State
    published: list[Event] = field(default_factory=list[Event])

    def publish(self, *events: Event) -> None:
        self.published.extend(events)


def test_a_cache_report_sends_only_what_changed() -> None:
    node = Node(
        A, STATE.model_copy(update={"replicas": {I1: ReplicaReport(cached=frozenset({1, 2}))}})
    )
    reports = CacheReports(node)  # type: ignore[arg-type]  # the parts of a ClusterView it uses
    reports.changed(I1, [2, 3, 4])  # against what the state had
    reports.changed(I1, [2, 3, 4])  # nothing new
    reports.changed(I1, [4])
    assert node.published == [
        ReplicaReported(node_id=A, instance_id=I1, cached_added=(3, 4), cached_removed=(1,)),
        ReplicaReported(node_id=A, instance_id=I1, cached_removed=(2, 3)),
    ]
    state = node.state
    for event in node.published:
        state = apply(state, ev(event, A))
    assert state.replicas[I1] == ReplicaReport(cached=frozenset({4}), load=0)


def test_load_is_reported_for_the_replica_whose_first_rank_is_this_node_s() -> None:
    node = Node(A, STATE)
    assert local_replica(node, MODEL) == I1  # type: ignore[arg-type]
    report_load(node, MODEL, 3, 250)  # type: ignore[arg-type]
    assert node.published == [ReplicaReported(node_id=A, instance_id=I1, load=3, wait_tokens=250)]
    state = apply(STATE, ev(node.published[0], A))
    assert state.replicas[I1] == ReplicaReport(load=3, wait_tokens=250)
    # The load and waiting cost stay as they were when a report only changes the cache.
    state = apply(state, ev(ReplicaReported(node_id=A, instance_id=I1, cached_added=(9,)), A))
    assert state.replicas[I1] == ReplicaReport(cached=frozenset({9}), load=3, wait_tokens=250)
    # A deleted instance takes its report with it, and so does one whose node timed out.
    assert I1 not in apply(state, ev(InstanceDeleted(instance_id=I1), A)).replicas
    with_node = state.model_copy(update={"nodes": {A: node_info(A)}})
    assert I1 not in apply(with_node, ev(NodeTimedOut(node_id=A), B)).replicas


def test_only_an_instance_s_first_rank_reports_for_it() -> None:
    mine = ReplicaReported(node_id=A, instance_id=I1, load=1)
    assert may_originate(STATE, A, mine)
    assert not may_originate(STATE, B, mine)  # B speaking as A
    as_b = ReplicaReported(node_id=B, instance_id=I1, load=1)
    assert not may_originate(STATE, B, as_b)  # B holds no rank of I1
    # A holds I2's second rank: its first rank (B) reports for it.
    assert not may_originate(STATE, A, ReplicaReported(node_id=A, instance_id=I2, load=1))
    assert may_originate(STATE, B, ReplicaReported(node_id=B, instance_id=I2, load=1))
    # Folded anyway (an older log), a report from another rank changes nothing.
    assert apply(STATE, ev(as_b, B)).replicas == {}


def test_a_lone_instance_reports_nothing() -> None:
    """Nothing to choose between: no events to grow the log with."""
    alone = Node(A, State(instances={I1: inst(I1, A)}))
    report_load(alone, MODEL, 2)  # type: ignore[arg-type]
    CacheReports(alone).changed(I1, [1, 2])  # type: ignore[arg-type]
    assert alone.published == []
