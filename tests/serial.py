"""Tests marked `serial` run alone while the suite runs on several pytest-xdist
workers: they bound a latency or compare two speeds, which the other worker's
load would skew. Every other test runs beside others.

A readers-writer lock between the workers' processes, on two files named by
the run: a test takes the room shared, a serial test takes it exclusively.
Both pass a turnstile first, which a waiting serial test holds, so that a
stream of other tests cannot keep it waiting. A worker keeps the room through
a run of serial tests that follow one another (a module of them)."""

import fcntl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest


def is_serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@dataclass
class SerialLock:
    turnstile: IO[bytes]
    room: IO[bytes]
    paths: list[Path]
    alone: bool = False  # this worker holds the room exclusively

    @classmethod
    def for_run(cls, run_id: str) -> "SerialLock":
        base = Path(tempfile.gettempdir()) / f"exo-tests-{run_id}"
        paths = [base.with_suffix(".turnstile"), base.with_suffix(".room")]
        turnstile, room = (path.open("ab") for path in paths)
        return cls(turnstile, room, paths)

    def before(self, item: pytest.Item) -> None:
        if not is_serial(item):
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            fcntl.flock(self.room, fcntl.LOCK_SH)
        elif not self.alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            fcntl.flock(self.room, fcntl.LOCK_EX)
            self.alone = True

    def after(self, next_item: pytest.Item | None) -> None:
        if not self.alone:
            fcntl.flock(self.room, fcntl.LOCK_UN)  # after every test: a serial one may wait
        elif not is_serial(next_item):
            fcntl.flock(self.room, fcntl.LOCK_UN)
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            self.alone = False

    def close(self) -> None:
        """Other workers keep the files they opened; none opens them again."""
        self.turnstile.close()
        self.room.close()
        for path in self.paths:
            path.unlink(missing_ok=True)


def worker_lock(config: pytest.Config) -> SerialLock | None:
    """The lock of this xdist run in a worker, else None (tests run one at a
    time; a pytest that a test starts inherits the run's environment, not its
    lock)."""
    worker: dict[str, object] | None = getattr(config, "workerinput", None)
    return SerialLock.for_run(str(worker["testrunuid"])) if worker else None
