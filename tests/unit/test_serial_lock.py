"""The lock that runs `serial` tests alone between xdist workers: each worker
opens the lock's files itself, as two threads here do (flock locks belong to
an open file, so they exclude each other in one process as across two)."""

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.serial import SerialLock

WAIT_SECONDS = 0.3


class Item:
    """The part of a `pytest.Item` the lock reads."""

    def __init__(self, serial: bool) -> None:
        self.serial = serial

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "serial" and self.serial else None


PLAIN: Any = Item(serial=False)
SERIAL: Any = Item(serial=True)


def started(action: Callable[[], None]) -> threading.Event:
    """`action` on a thread; the event is set once it returned."""
    done = threading.Event()
    threading.Thread(target=lambda: (action(), done.set()), daemon=True).start()
    return done


@pytest.fixture
def workers() -> Iterator[list[SerialLock]]:
    run_id = uuid.uuid4().hex
    locks = [SerialLock.for_run(run_id) for _ in range(3)]
    yield locks
    for lock in locks:
        lock.close()


def test_a_serial_test_waits_for_the_others_and_then_runs_alone(
    workers: list[SerialLock],
) -> None:
    first, second, third = workers
    first.before(PLAIN)
    second.before(PLAIN)  # two plain tests run together
    serial_in = started(lambda: third.before(SERIAL))
    assert not serial_in.wait(WAIT_SECONDS)
    first.after(PLAIN)
    assert not serial_in.wait(WAIT_SECONDS)  # the second test still runs
    # A test that starts now waits behind the serial one (no overtaking).
    first_again = started(lambda: first.before(PLAIN))
    second.after(None)
    assert serial_in.wait(5)
    assert not first_again.wait(WAIT_SECONDS)
    # A serial test next on the same worker keeps the room.
    third.after(SERIAL)
    third.before(SERIAL)
    assert not first_again.wait(WAIT_SECONDS)
    third.after(PLAIN)
    assert first_again.wait(5)
    first.after(None)
