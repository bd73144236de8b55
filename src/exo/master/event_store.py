"""A node's copy of the cluster history: the indexed events it has applied.

Every node keeps one: the event log on disk, the state folded from it, and
subscriptions that replay from any index and then follow live. The master
also *indexes* events (`publish`): it turns events published by nodes into
indexed events (`idx` 0, 1, 2, ... with no gaps). Followers `ingest` the
master's indexed events as they are, so a node that becomes master continues
the same sequence.
"""

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from functools import reduce

import anyio
from loguru import logger

from exo.master.event_log import EventLog
from exo.shared.apply import apply
from exo.shared.types.events import Event, IndexedEvent, NodeTimedOut, indexed_event_adapter
from exo.shared.types.ids import NodeId
from exo.shared.types.state import State

# Event ids remembered for deduplicating retried publishes.
DEDUP_WINDOW = 65_536


def now_ms() -> int:
    return int(time.time() * 1000)


def replay_state(log: EventLog) -> State:
    events = (indexed_event_adapter.validate_json(payload) for _, payload in log.read_from(0))
    return reduce(apply, events, State())


def timed_out_nodes(state: State, now: int, timeout_ms: int, keep: NodeId) -> list[NodeId]:
    """Nodes not heard from for `timeout_ms` (never `keep`, the master itself)."""
    return sorted(
        node_id
        for node_id, node in state.nodes.items()
        if node_id != keep and now - node.last_seen_ms > timeout_ms
    )


class EventGap(Exception):
    """Indexed events arrived that do not continue this node's log."""


class EventStore:
    def __init__(self, node_id: NodeId, log: EventLog) -> None:
        self.node_id = node_id
        self._log = log
        self._state = replay_state(log)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._appended = anyio.Event()

    @property
    def state(self) -> State:
        return self._state

    @property
    def next_idx(self) -> int:
        return self._log.next_idx

    def ingest(self, events: Sequence[IndexedEvent]) -> int:
        """Append the master's indexed events; ones already held are skipped.
        Returns how many were new."""
        fresh = [e for e in events if e.idx >= self._log.next_idx]
        for expected, event in enumerate(fresh, start=self._log.next_idx):
            if event.idx != expected:
                raise EventGap(f"expected event {expected}, got {event.idx}")
        self._append(fresh)
        return len(fresh)

    async def wait_for_change(self, timeout: float) -> None:
        """Until the next event is applied (or `timeout` passes)."""
        appended = self._appended
        with anyio.move_on_after(timeout):
            await appended.wait()

    def event_at(self, idx: int) -> IndexedEvent | None:
        for _, payload in self._log.read_from(idx):
            return indexed_event_adapter.validate_json(payload)
        return None

    def reset(self) -> None:
        """Set this node's history aside and start empty: it diverged from the
        master's (e.g. this node indexed events as master that never reached the
        others), and the master's history is the one the cluster keeps."""
        path = self._log.path
        self._log.close()
        aside = path.with_name(f"{path.name}.diverged-{now_ms()}")
        path.rename(aside)
        logger.warning(f"event history diverged from the master's; kept it as {aside.name}")
        self._log = EventLog.open(path)
        self._state = State()
        self._appended.set()
        self._appended = anyio.Event()

    def _append(self, indexed: Sequence[IndexedEvent]) -> None:
        if not indexed:
            return
        self._log.append([indexed_event_adapter.dump_json(e) for e in indexed])
        self._state = reduce(apply, indexed, self._state)
        self._appended.set()
        self._appended = anyio.Event()

    def publish(self, origin: NodeId, events: Sequence[tuple[str, Event]]) -> list[IndexedEvent]:
        """Index, persist and apply `(event_id, event)` pairs; an id seen before
        (a retried publish) is skipped. Returns the newly indexed events."""
        fresh = []
        for event_id, event in events:
            if event_id in self._seen:
                continue
            self._seen[event_id] = None
            fresh.append(event)
        while len(self._seen) > DEDUP_WINDOW:
            self._seen.popitem(last=False)
        if not fresh:
            return []
        at = now_ms()
        first = self._log.next_idx
        indexed = [
            IndexedEvent(idx=first + i, at_ms=at, origin=origin, event=event)
            for i, event in enumerate(fresh)
        ]
        self._append(indexed)
        return indexed

    def time_out_silent_nodes(self, timeout_ms: int) -> list[NodeId]:
        gone = timed_out_nodes(self._state, now_ms(), timeout_ms, keep=self.node_id)
        self.publish(
            self.node_id, [(f"timeout-{n}-{now_ms()}", NodeTimedOut(node_id=n)) for n in gone]
        )
        return gone

    async def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]:
        """Every indexed event from `from_idx` on: the log, then live ones as they come."""
        next_idx = from_idx
        while True:
            appended = self._appended
            for idx, payload in self._log.read_from(next_idx):
                yield indexed_event_adapter.validate_json(payload)
                next_idx = idx + 1
            if next_idx >= self._log.next_idx:
                await appended.wait()
