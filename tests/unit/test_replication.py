"""A follower's ingest of the master's stream: batches, overlap check, divergence."""

from pathlib import Path

from exo.cluster.replication import ingest
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore
from exo.shared.types.events import IndexedEvent, MasterElected, NodeJoined
from exo.shared.types.ids import NodeId

A, B = NodeId("a"), NodeId("b")


def store_at(path: Path, node_id: NodeId) -> EventStore:
    return EventStore(node_id, EventLog.open(path))


def history(store: EventStore, *names: str) -> list[IndexedEvent]:
    return store.index(
        A, [(n, NodeJoined(node_id=NodeId(n), grpc_address=None, started_at_ms=1)) for n in names]
    )


def test_a_batch_with_the_overlap_event_is_appended_once(tmp_path: Path) -> None:
    master = store_at(tmp_path / "master.log", A)
    events = history(master, "x", "y", "z")
    follower = store_at(tmp_path / "follower.log", B)
    assert ingest(follower, events[:2])
    assert ingest(follower, events[1:])  # starts one back, at the event it holds
    assert follower.state == master.state
    assert follower.next_idx == 3


def test_a_diverged_history_is_set_aside(tmp_path: Path) -> None:
    master = store_at(tmp_path / "master.log", A)
    events = history(master, "x", "y")
    follower = store_at(tmp_path / "follower.log", B)
    follower.index(B, [("own", MasterElected(master_id=B, term=1))])  # its own idx 0
    assert not ingest(follower, events)
    assert follower.next_idx == 0  # starts over from the master's history
    assert any(p.name.startswith("follower.log.diverged-") for p in tmp_path.iterdir())
    assert ingest(follower, events)
    assert follower.state == master.state
