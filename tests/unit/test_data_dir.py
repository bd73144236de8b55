"""The data dir: one process owns it (tested with real processes); small state
files are replaced atomically."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from exo.shared.data_dir import DataDirInUse, DataDirLock, atomic_write_bytes

HOLD = """
import sys, time
from pathlib import Path
from exo.shared.data_dir import DataDirLock
lock = DataDirLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def hold_lock(data_dir: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(data_dir)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_node_on_the_same_data_dir_exits_with_a_clear_message(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    holder = hold_lock(data_dir)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "exo.main", "--data-dir", str(data_dir), "--model", "none"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert f"another exo node (pid {holder.pid}) uses {data_dir}" in second.stderr
        with pytest.raises(DataDirInUse, match=f"pid {holder.pid}"):
            DataDirLock.acquire(data_dir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # A killed holder leaves the lock file behind, but not the lock.
    with DataDirLock.acquire(data_dir):
        assert (data_dir / "lock").read_text().strip() == str(os.getpid())


def test_the_lock_is_released_when_its_holder_releases_it(tmp_path: Path) -> None:
    with DataDirLock.acquire(tmp_path):
        pass
    lock = DataDirLock.acquire(tmp_path)
    lock.release()
    lock.release()  # idempotent
    DataDirLock.acquire(tmp_path).release()


def test_atomic_write_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "node_id"
    atomic_write_bytes(path, b"first")
    atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["node_id"]  # no temporary left
