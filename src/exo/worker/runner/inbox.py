"""What the node asks of a runner: tasks to serve, cancellations, and when to stop.

A thread reads the runner's stdin into a queue (None once stdin ends); the
runner looks at it whenever it may act on it: between steps, while idle, while
it waits on its pipeline's ring, between prefill chunks. `Shutdown` and the end
of stdin both mean stop: the inbox raises `StopRequested` where it reads them.
"""

import queue
import time
from collections import deque
from collections.abc import Mapping

from exo.worker.runner.protocol import Cancel, Generate, Shutdown, ToRunner


class StopRequested(BaseException):
    """The node asked the runner to stop. A `BaseException`, as `KeyboardInterrupt`
    is, so that no handler of a failed request (`except Exception`) takes it for one."""


class Inbox:
    """Tasks not taken yet, in order; tasks taken and not ended; the cancellations
    asked for either."""

    def __init__(self, messages: "queue.Queue[ToRunner | None]") -> None:
        self._messages = messages
        self._pending: deque[Generate] = deque()
        self._taken: dict[str, Generate] = {}  # by task id
        self._cancelled: set[str] = set()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def taken(self) -> Mapping[str, Generate]:
        """The tasks taken and not ended, in the order taken."""
        return self._taken

    def drain(self) -> None:
        """Take the messages waiting, without blocking."""
        while True:
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return
            if not self._accept(message):
                raise StopRequested

    def wait(self, timeout: float) -> None:
        """Take the next message, waiting up to `timeout` seconds for it."""
        try:
            message = self._messages.get(timeout=timeout)
        except queue.Empty:
            return
        if not self._accept(message):
            raise StopRequested

    def stop_arrives(self, within: float) -> bool:
        """Whether the node asks to stop within `within` seconds."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._messages.get(timeout=left)
            except queue.Empty:
                return False
            if not self._accept(message):
                return True
        return False

    def peek(self) -> Generate | None:
        """The next task to serve, left first in line (`take` takes it); a task
        cancelled before it started is dropped."""
        while self._pending:
            task = self._pending[0]
            if task.task_id not in self._cancelled:
                return task
            self._pending.popleft()
            self._cancelled.discard(task.task_id)
        return None

    def take(self) -> Generate | None:
        """The next task to serve; a task cancelled before it started is dropped."""
        while self._pending:
            task = self._pending.popleft()
            if task.task_id in self._cancelled:
                self._cancelled.discard(task.task_id)
                continue
            self._taken[task.task_id] = task
            return task
        return None

    def is_cancelled(self, task_id: str) -> bool:
        return task_id in self._cancelled

    def end(self, task_id: str) -> None:
        """A taken task is over: a later `Cancel` for it is ignored."""
        self._taken.pop(task_id, None)
        self._cancelled.discard(task_id)

    def drop_pending(self) -> list[Generate]:
        """The tasks not taken yet, which the runner will not serve."""
        dropped = list(self._pending)
        self._pending.clear()
        self._cancelled -= {task.task_id for task in dropped}
        return dropped

    def _accept(self, message: ToRunner | None) -> bool:
        """Note `message`; False when it asks to stop."""
        match message:
            case None | Shutdown():
                return False
            case Cancel(task_id=task_id):
                pending = any(task.task_id == task_id for task in self._pending)
                if pending or task_id in self._taken:
                    self._cancelled.add(task_id)
            case Generate():
                self._pending.append(message)
        return True
