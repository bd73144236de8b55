import errno
import os
from pathlib import Path

import anyio
import pytest

from exo.shared.apply import apply
from exo.shared.event_log import EventLog, EventLogCorrupted
from exo.shared.event_store import EventGap, EventLogUnavailable, EventStore, with_ids
from exo.shared.state_snapshot import read_snapshot, write_snapshot
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    MasterElected,
    NodeJoined,
    NodeTelemetryReported,
)
from exo.shared.types.ids import NodeId
from exo.shared.types.state import NodeTelemetry, State
from tests.unit.small_tmpfs import fill, small_tmpfs

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")


def joined(node_id: NodeId) -> NodeJoined:
    return NodeJoined(node_id=node_id, grpc_address=None, started_at_ms=1)


def open_master(path: Path) -> EventStore:
    return EventStore(A, EventLog.open(path / "events.log"))


def test_index_persists_and_applies(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    first = master.index(A, [("e1", joined(A)), ("e2", MasterElected(master_id=A, term=1))])
    second = master.index(B, [("e3", joined(B))])
    assert [e.idx for e in first + second] == [0, 1, 2]
    assert [e.origin for e in first + second] == [A, A, B]
    assert master.state.last_idx == 2
    assert set(master.state.nodes) == {A, B}
    assert master.state.master_id == A
    # A restarted master folds its log back into the same state and goes on from there.
    again = open_master(tmp_path)
    assert again.state == master.state
    assert again.index(C, [("e4", joined(C))])[0].idx == 3


def test_retried_events_are_indexed_once(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    master.index(A, [("e1", joined(A))])
    assert master.index(A, [("e1", joined(A)), ("e2", joined(B))])[0].idx == 1
    assert master.index(A, [("e1", joined(A)), ("e2", joined(B))]) == []
    assert master.state.last_idx == 1


def test_event_ids_are_the_batch_id_and_the_position() -> None:
    assert with_ids("c1", [joined(A), joined(B)]) == [("c1:0", joined(A)), ("c1:1", joined(B))]
    assert with_ids("c1", []) == []


async def test_wait_until_wakes_when_the_index_is_applied(tmp_path: Path) -> None:
    store = open_master(tmp_path)
    store.index(A, [("e0", joined(A))])
    assert await store.wait_until(0, timeout=1)  # applied; made durable on the way
    assert not await store.wait_until(1, timeout=0.01)
    woke: list[bool] = []

    async def wait() -> None:
        woke.append(await store.wait_until(2, timeout=5))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(wait)
            await anyio.sleep(0.01)
            store.index(B, [("e1", joined(B))])
            await anyio.sleep(0.01)
            assert woke == []  # index 1 is not 2
            store.index(C, [("e2", joined(C))])
    assert woke == [True]


async def test_subscribe_replays_then_follows(tmp_path: Path) -> None:
    master = open_master(tmp_path)
    master.index(A, [(f"e{i}", joined(NodeId(f"n{i}"))) for i in range(3)])
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
            master.index(B, [("late1", joined(B))])
            await anyio.sleep(0.05)
            master.index(C, [("late2", joined(C))])
    assert [e.idx for e in received] == [1, 2, 3, 4]
    assert [e.origin for e in received[-2:]] == [B, C]


def test_a_follower_ingests_the_masters_events_and_can_take_over(tmp_path: Path) -> None:
    master = EventStore(A, EventLog.open(tmp_path / "a.log"))
    follower = EventStore(B, EventLog.open(tmp_path / "b.log"))
    indexed = master.index(A, [("e1", joined(A)), ("e2", MasterElected(master_id=A, term=1))])
    assert follower.ingest(indexed[:1]) == 1
    assert follower.ingest(indexed) == 1  # the first one again is skipped
    assert follower.state == master.state
    with pytest.raises(EventGap):
        follower.ingest([indexed[0].model_copy(update={"idx": 5})])
    # The follower becomes master: it continues the same sequence.
    assert follower.index(B, [("e3", joined(B))])[0].idx == 2


# --- compaction --------------------------------------------------------------------


def telemetry_event(node_id: NodeId, ram: int) -> NodeTelemetryReported:
    return NodeTelemetryReported(
        node_id=node_id,
        telemetry=NodeTelemetry(
            ram_total=1 << 30, ram_available=ram, disk_free=1 << 30, cpu_count=2,
            platform="linux-x86_64", mlx_backend="cpu",
        ),
    )  # fmt: skip


def fill_store(store: EventStore, n: int, batch: int = 10) -> None:
    """`n` events, `batch` per index call: node a joins, then reports telemetry."""
    events: list[Event] = [joined(A), *(telemetry_event(A, i) for i in range(n - 1))]
    for start in range(0, n, batch):
        store.index(A, with_ids(f"b{start}", events[start : start + batch]))


def compacting(path: Path, every: int = 100, retain: int = 10) -> EventStore:
    return EventStore(A, EventLog.open(path / "events.log"), compact_every=every, retain=retain)


def test_the_log_is_compacted_into_a_snapshot_and_a_restart_replays_only_the_tail(
    tmp_path: Path,
) -> None:
    store = compacting(tmp_path)
    fill_store(store, 250)
    # Snapshots at 99 and 199; the log holds the 10 events before the last one and after it.
    assert store.snapshot_idx == 199
    log = EventLog.open(tmp_path / "events.log")
    assert (log.base_idx, log.next_idx) == (190, 250)
    log.close()
    assert read_snapshot(tmp_path / "events.snapshot") is not None
    again = compacting(tmp_path)
    assert again.state == store.state
    assert again.next_idx == 250
    assert again.index(A, [("next", joined(B))])[0].idx == 250


async def test_a_peer_behind_the_compacted_log_gets_the_snapshot_first(tmp_path: Path) -> None:
    store = compacting(tmp_path)
    fill_store(store, 250)
    snapshot_state = read_snapshot(tmp_path / "events.snapshot")
    received: list[State | IndexedEvent] = []
    with anyio.fail_after(5):
        async for item in store.follow(5):
            received.append(item)
            if isinstance(item, IndexedEvent) and item.idx == 249:
                break
    first, *events = received
    assert first == snapshot_state
    assert [e.idx for e in events if isinstance(e, IndexedEvent)] == list(range(200, 250))
    # A peer within the log's tail gets events only.
    async for item in store.follow(195):
        assert isinstance(item, IndexedEvent) and item.idx == 195
        break


def test_a_follower_installs_a_snapshot_and_goes_on_from_it(tmp_path: Path) -> None:
    master = compacting(tmp_path / "a")
    fill_store(master, 3)
    follower = EventStore(B, EventLog.open(tmp_path / "b" / "events.log"))
    follower.ingest(master_events(master, 0, 3))  # it had the first few
    more = [telemetry_event(A, i) for i in range(247)]
    master.index(A, with_ids("more", more[:200]))  # compacted: the snapshot is at 202
    master.index(A, with_ids("tail", more[200:]))
    snapshot = read_snapshot(tmp_path / "a" / "events.snapshot")
    assert snapshot is not None and snapshot.last_idx == 202
    follower.install(snapshot)
    assert follower.ingest(master_events(master, 203, 250)) == 47
    assert follower.state == master.state
    # Its restart loads the installed snapshot and the events after it.
    assert EventStore(B, EventLog.open(tmp_path / "b" / "events.log")).state == master.state


def master_events(store: EventStore, start: int, stop: int) -> list[IndexedEvent]:
    found = [store.event_at(i) for i in range(start, stop)]
    assert all(e is not None for e in found)
    return [e for e in found if e is not None]


@pytest.mark.parametrize(
    "crash_after",
    ["snapshot tmp written", "snapshot renamed", "log tmp written", "log renamed"],
)
def test_a_crash_at_any_step_of_a_compaction_leaves_a_loadable_state(
    tmp_path: Path, crash_after: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction writes the snapshot aside, renames it, writes the new log aside,
    renames it; a crash after any step reopens to the same state."""
    store = compacting(tmp_path)
    fill_store(store, 99)
    expected_before = store.state
    steps: list[str] = []
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        name = Path(dst).name
        kind = "snapshot" if name.endswith(".snapshot") else "log"
        steps.append(f"{kind} tmp written")
        if f"{kind} tmp written" == crash_after:
            raise Crash
        real_replace(src, dst)
        steps.append(f"{kind} renamed")
        if f"{kind} renamed" == crash_after:
            raise Crash

    class Crash(BaseException):
        pass

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        store.index(A, [("the 100th", joined(B))])  # compacts at 100 events
    monkeypatch.setattr(os, "replace", real_replace)
    assert crash_after in steps
    reopened = compacting(tmp_path)
    # The event that triggered the compaction was written (not yet durable, but
    # in the file), so it is there after the crash in every case.
    last = reopened.event_at(99)  # the log keeps the events just before a snapshot
    assert last is not None and last.event == joined(B)
    assert reopened.state == apply(expected_before, last)
    assert reopened.index(A, [("after", joined(C))])[0].idx == 100


def test_a_crash_while_a_snapshot_is_installed_leaves_a_loadable_state(tmp_path: Path) -> None:
    """The snapshot is written before the log restarts after it: a crash between
    leaves the new snapshot beside the old, shorter log, which loading replaces."""
    master = compacting(tmp_path / "a")
    fill_store(master, 3)
    follower_dir = tmp_path / "b"
    follower = EventStore(B, EventLog.open(follower_dir / "events.log"))
    follower.ingest(master_events(master, 0, 3))
    master.index(A, with_ids("more", [telemetry_event(A, i) for i in range(147)]))
    snapshot = read_snapshot(tmp_path / "a" / "events.snapshot")
    assert snapshot is not None
    write_snapshot(follower_dir / "events.snapshot", snapshot)  # ...and the crash
    reopened = EventStore(B, EventLog.open(follower_dir / "events.log"))
    assert reopened.state == snapshot
    assert reopened.next_idx == snapshot.last_idx + 1


def test_a_log_that_starts_after_its_snapshot_is_refused(tmp_path: Path) -> None:
    EventLog.create_empty(tmp_path / "events.log", 50).close()
    with pytest.raises(EventLogCorrupted, match="starts after its snapshot"):
        open_master(tmp_path)


def test_a_reset_reports_the_events_from_where_the_histories_parted(tmp_path: Path) -> None:
    store = open_master(tmp_path)
    fill_store(store, 10)
    assert store.set_aside is None
    set_aside = store.reset(diverged_at=7)
    assert (set_aside.from_idx, set_aside.events) == (7, 3)
    assert (tmp_path / set_aside.kept_as).exists()
    assert store.set_aside == set_aside
    # Unknown where: all of it.
    store.index(A, with_ids("again", [joined(A), joined(B)]))
    assert store.reset() == store.set_aside
    assert store.set_aside is not None
    assert (store.set_aside.from_idx, store.set_aside.events) == (0, 2)


def test_a_reset_sets_the_snapshot_aside_too(tmp_path: Path) -> None:
    store = compacting(tmp_path)
    fill_store(store, 150)
    store.reset()
    assert (store.next_idx, store.state) == (0, State())
    assert not (tmp_path / "events.snapshot").exists()
    assert len(list(tmp_path.glob("events.log.diverged-*.snapshot"))) == 1
    assert compacting(tmp_path).state == State()


# --- durability and a full disk ------------------------------------------------------


async def test_only_durable_events_are_served_and_flush_makes_them_so(tmp_path: Path) -> None:
    store = open_master(tmp_path)
    store.index(A, [("e0", joined(A))])
    assert store.next_idx == 1
    received: list[int] = []
    with anyio.fail_after(5):
        async for event in store.subscribe(0):  # flushes what it waits for
            received.append(event.idx)
            break
    assert received == [0]
    assert await store.flush()


async def test_a_full_disk_is_a_fault_the_store_survives_and_appends_resume(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        store = EventStore(A, EventLog.open(disk / "events.log"))
        store.index(A, [("e0", joined(A))])
        filler = fill(disk)
        big = [(f"t{i}", telemetry_event(A, i)) for i in range(2_000)]
        before = store.state
        with pytest.raises(EventLogUnavailable, match="cannot write its event log"):
            store.index(A, big)
        assert store.state == before  # nothing applied
        assert store.fault is not None and "No space left on device" in store.fault
        filler.unlink()
        # The same batch (a retry) is indexed now: a failed batch is not "seen".
        assert len(store.index(A, big)) == 2_000
        assert await store.flush()
        assert store.fault is None
    # (the tmpfs is gone; the state was checked above)


async def test_a_failed_fsync_is_a_fault_and_the_events_become_durable_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_master(tmp_path)
    real_fsync = os.fsync

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    store.index(A, [("e0", joined(A))])
    assert not await store.flush()
    assert store.fault == "cannot sync the event log: [Errno 28] No space left on device"
    assert not await store.wait_until(0, timeout=0.05)  # not durable: not served
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert await store.wait_until(0, timeout=5)
    assert store.fault is None
    assert open_master(tmp_path).state == store.state
