from pathlib import Path

import anyio
import pytest

from exo.master.event_log import EventLog
from exo.master.event_store import EventGap, EventStore, timed_out_nodes
from exo.shared.types.events import IndexedEvent, MasterElected, NodeJoined
from exo.shared.types.ids import NodeId
from exo.shared.types.state import NodeInfo, State

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")


def joined(node_id: NodeId) -> NodeJoined:
    return NodeJoined(node_id=node_id, grpc_address=None, started_at_ms=1)


def open_master(path: Path) -> EventStore:
    return EventStore(A, EventLog.open(path / "events.log"))


def test_publish_indexes_persists_and_applies(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    first = master.publish(A, [("e1", joined(A)), ("e2", MasterElected(master_id=A, term=1))])
    second = master.publish(B, [("e3", joined(B))])
    assert [e.idx for e in first + second] == [0, 1, 2]
    assert [e.origin for e in first + second] == [A, A, B]
    assert master.state.last_idx == 2
    assert set(master.state.nodes) == {A, B}
    assert master.state.master_id == A
    # A restarted master folds its log back into the same state and goes on from there.
    again = open_master(tmp_path)
    assert again.state == master.state
    assert again.publish(C, [("e4", joined(C))])[0].idx == 3


def test_retried_events_are_indexed_once(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    master.publish(A, [("e1", joined(A))])
    assert master.publish(A, [("e1", joined(A)), ("e2", joined(B))])[0].idx == 1
    assert master.publish(A, [("e1", joined(A)), ("e2", joined(B))]) == []
    assert master.state.last_idx == 1


@pytest.mark.parametrize(
    ("seen", "now", "expected"),
    [
        ({A: 0, B: 1000, C: 5000}, 6000, [B]),
        ({A: 0, B: 1000, C: 5000}, 20_000, [B, C]),
        ({A: 0, B: 1000}, 3000, []),
        ({A: 0}, 1_000_000, []),  # the master never times itself out
    ],
)
def test_timed_out_nodes(seen: dict[NodeId, int], now: int, expected: list[NodeId]) -> None:
    state = State(
        nodes={
            n: NodeInfo(node_id=n, grpc_address=None, started_at_ms=0, last_seen_ms=t)
            for n, t in seen.items()
        }
    )
    assert timed_out_nodes(state, now, timeout_ms=4000, keep=A) == expected


def test_time_out_silent_nodes_publishes_the_fact(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    master.publish(A, [("a", joined(A))])
    master.publish(B, [("b", joined(B))])
    assert master.time_out_silent_nodes(timeout_ms=-1) == [B]
    assert set(master.state.nodes) == {A}
    assert set(open_master(tmp_path).state.nodes) == {A}  # the fact is in the log


async def test_subscribe_replays_then_follows(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    master.publish(A, [(f"e{i}", joined(NodeId(f"n{i}"))) for i in range(3)])
    received: list[IndexedEvent] = []

    async def follow() -> None:
        async for event in master.subscribe(1):
            received.append(event)
            if len(received) == 4:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(follow)
            await anyio.sleep(0.05)
            master.publish(B, [("late1", joined(B))])
            await anyio.sleep(0.05)
            master.publish(C, [("late2", joined(C))])
    assert [e.idx for e in received] == [1, 2, 3, 4]
    assert [e.origin for e in received[-2:]] == [B, C]


def test_a_follower_ingests_the_masters_events_and_can_take_over(tmp_path: Path) -> None:
    master = EventStore(A, EventLog.open(tmp_path / "a.log"))
    follower = EventStore(B, EventLog.open(tmp_path / "b.log"))
    indexed = master.publish(A, [("e1", joined(A)), ("e2", MasterElected(master_id=A, term=1))])
    assert follower.ingest(indexed[:1]) == 1
    assert follower.ingest(indexed) == 1  # the first one again is skipped
    assert follower.state == master.state
    with pytest.raises(EventGap):
        follower.ingest([indexed[0].model_copy(update={"idx": 5})])
    # The follower becomes master: it continues the same sequence.
    assert follower.publish(B, [("e3", joined(B))])[0].idx == 2
