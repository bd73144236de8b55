"""A node whose event log cannot be written (a full disk, injected here as
ENOSPC from the write) keeps running: the master takes office and does its
duties once there is space; appends fail with a clear reason meanwhile and
apply nothing."""

import errno
import os
from pathlib import Path

import anyio
import pytest

from exo.master.master import Master
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore
from exo.shared.types.commands import ClusterUnavailable
from exo.shared.types.events import NodeJoined
from exo.shared.types.ids import NodeId

A, B = NodeId("a"), NodeId("b")


class FullDisk:
    """os.pwrite fails with ENOSPC while `full` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = True
        real = os.pwrite

        def pwrite(fd: int, data: bytes, offset: int) -> int:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)


def joined(node_id: NodeId) -> NodeJoined:
    return NodeJoined(node_id=node_id, grpc_address=None, started_at_ms=0)


async def test_a_master_elected_on_a_full_disk_takes_office_once_there_is_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(A, EventLog.open(tmp_path / "events.log"))
    master = Master(store, node_timeout_seconds=60, duty_interval_seconds=0.01)
    disk = FullDisk(monkeypatch)
    master.take_office()  # does not raise: the node goes on
    assert master.in_office
    assert store.state.master_id is None
    assert store.fault is not None and "No space left on device" in store.fault
    with anyio.move_on_after(0.05):
        await master.run()  # duty rounds on a full disk: logged, not raised
    disk.full = False
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(master.run)
            while store.state.master_id != A:
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    assert store.state.master_term == 1
    assert await store.flush()
    assert store.fault is None


def test_an_append_that_fails_applies_nothing_and_its_retry_is_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(A, EventLog.open(tmp_path / "events.log"))
    store.index(A, [("a", joined(A))])
    before = store.state
    disk = FullDisk(monkeypatch)
    # A ClusterUnavailable: the API answers 503 with the reason.
    with pytest.raises(ClusterUnavailable, match="cannot write its event log"):
        store.index(A, [("b", joined(B))])
    assert store.state == before
    assert store.next_idx == 1
    disk.full = False
    assert [e.idx for e in store.index(A, [("b", joined(B))])] == [1]
    assert set(store.state.nodes) == {A, B}


def test_a_reset_or_a_snapshot_install_on_a_full_disk_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(A, EventLog.open(tmp_path / "events.log"))
    store.index(A, [("a", joined(A))])
    before = store.state
    disk = FullDisk(monkeypatch)
    with pytest.raises(ClusterUnavailable, match="cannot start a new event log"):
        store.reset()
    with pytest.raises(ClusterUnavailable, match="cannot install a snapshot"):
        store.install(before.model_copy(update={"last_idx": 41}))
    assert (store.state, store.next_idx, store.snapshot_idx) == (before, 1, -1)
    disk.full = False
    assert [e.idx for e in store.index(A, [("b", joined(B))])] == [1]
    assert EventStore(A, EventLog.open(tmp_path / "events.log")).state == store.state
