"""A follower's ingest of the master's stream: batches, overlap check, divergence."""

from pathlib import Path

from exo.cluster.link import ClusterLink
from exo.master.event_log import EventLog
from exo.master.event_store import EventStore
from exo.shared.types.events import IndexedEvent, MasterElected, NodeJoined
from exo.shared.types.ids import NodeId

A, B = NodeId("a"), NodeId("b")


def link_over(path: Path, node_id: NodeId) -> ClusterLink:
    store = EventStore(node_id, EventLog.open(path))
    return ClusterLink(store, "127.0.0.1", 0, "127.0.0.1", "secret", [])


def history(store: EventStore, *names: str) -> list[IndexedEvent]:
    return store.publish(
        A, [(n, NodeJoined(node_id=NodeId(n), grpc_address=None, started_at_ms=1)) for n in names]
    )


def test_a_batch_with_the_overlap_event_is_appended_once(tmp_path: Path) -> None:
    master = EventStore(A, EventLog.open(tmp_path / "master.log"))
    events = history(master, "x", "y", "z")
    follower = link_over(tmp_path / "follower.log", B)
    assert follower._ingest(events[:2])
    assert follower._ingest(events[1:])  # starts one back, at the event it holds
    assert follower.store.state == master.state
    assert follower.store.next_idx == 3


def test_a_diverged_history_is_set_aside(tmp_path: Path) -> None:
    master = EventStore(A, EventLog.open(tmp_path / "master.log"))
    events = history(master, "x", "y")
    follower = link_over(tmp_path / "follower.log", B)
    follower.store.publish(B, [("own", MasterElected(master_id=B, term=1))])  # its own idx 0
    assert not follower._ingest(events)
    assert follower.store.next_idx == 0  # starts over from the master's history
    assert any(p.name.startswith("follower.log.diverged-") for p in tmp_path.iterdir())
    assert follower._ingest(events)
    assert follower.store.state == master.state
