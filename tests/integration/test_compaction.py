"""A compacted event log: a node that joins a cluster with a long history (or
restarts) starts from a snapshot of the state, not from event 0."""

import time
from pathlib import Path

import pytest

from exo.cluster.tls import NodeCertificate
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore, now_ms, with_ids
from exo.shared.types.events import Event, NodeJoined, NodeTelemetryReported
from exo.shared.types.ids import NodeId
from exo.shared.types.state import NodeTelemetry
from tests.integration.cluster_process import Cluster, agreed, wait_until

pytestmark = pytest.mark.slow

HISTORY = 100_000
# The bound asserted on the newcomer's catch-up, and how long it is waited for: longer,
# so that a slow machine fails on the assertion, with the time it took. Seen: 9-18 s on
# a busy 2-core machine, mostly the newcomer's start and the first election's wait for
# its peers; following the 100k events one by one would take ~100 s.
CAUGHT_UP_WITHIN_S = 30.0
CATCH_UP_WAIT_S = 60.0


def write_history(data_dir: Path, n: int) -> NodeId:
    """`n` events in `data_dir`'s log, as a long-lived master would have them:
    it joined, then reported its telemetry again and again. Returns its id
    (its certificate's, also made here)."""
    node_id = NodeCertificate.load_or_create(data_dir / "tls").node_id
    store = EventStore(node_id, EventLog.open(data_dir / "events.log"))
    telemetry = NodeTelemetryReported(
        node_id=node_id,
        telemetry=NodeTelemetry(
            ram_total=1 << 34, ram_available=1 << 33, disk_free=1 << 36, cpu_count=2,
            platform="linux-x86_64", mlx_backend="cpu", accepts_instances=False,
        ),
    )  # fmt: skip
    joined = NodeJoined(node_id=node_id, grpc_address=None, started_at_ms=now_ms())
    events: list[Event] = [joined, *[telemetry] * (n - 1)]
    for start in range(0, n, 5_000):
        store.index(node_id, with_ids(f"history-{start}", events[start : start + 5_000]))
    assert store.snapshot_idx >= n - 10_000  # compacted along the way (every 10k events)
    return node_id


def test_a_node_joining_a_cluster_with_100k_events_catches_up_in_seconds(
    cluster: Cluster,
) -> None:
    veteran_id = write_history(cluster.tmp_path / "node0", HISTORY)
    started = time.monotonic()
    veteran = cluster.start(0)
    # The restart loaded the snapshot and replayed only the log's tail.
    assert veteran.get("/state")["last_idx"] >= HISTORY - 1
    loaded = time.monotonic() - started
    joined_at = time.monotonic()
    newcomer = cluster.start(1)
    wait_until(lambda: agreed(cluster.nodes), CATCH_UP_WAIT_S, "the newcomer caught up")
    caught_up = time.monotonic() - joined_at
    state = newcomer.get("/state")
    assert state["last_idx"] >= HISTORY
    assert set(state["nodes"]) == {veteran_id, newcomer.get("/node_id")}
    # Seconds, including the first election's wait for the other peers (a peer
    # timeout); following 100k events one by one takes minutes (~1,000 events/s).
    print(f"the veteran started in {loaded:.1f}s; the newcomer caught up in {caught_up:.1f}s")
    assert caught_up < CAUGHT_UP_WITHIN_S, f"caught up in {caught_up:.1f}s"
    assert loaded < 40, f"the veteran started in {loaded:.1f}s"
    # The newcomer took a snapshot, not 100k events: its log holds only what followed.
    newcomer_log = EventLog.open(cluster.tmp_path / "node1" / "events.log")
    try:
        assert newcomer_log.base_idx > HISTORY - 10_000
    finally:
        newcomer_log.close()
    assert (cluster.tmp_path / "node1" / "events.snapshot").is_file()
