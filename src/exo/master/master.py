"""The master: the only writer of cluster state.

It turns events published by nodes into indexed events (`idx` 0, 1, 2, ...
with no gaps), appends them to its on-disk log, folds them into its state and
hands them to subscribers, which replay from any index and then follow live.
"""

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from functools import reduce

import anyio

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


class Master:
    def __init__(self, node_id: NodeId, log: EventLog) -> None:
        self.node_id = node_id
        self._log = log
        self._state = replay_state(log)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._appended = anyio.Event()

    @property
    def state(self) -> State:
        return self._state

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
        self._log.append([indexed_event_adapter.dump_json(e) for e in indexed])
        self._state = reduce(apply, indexed, self._state)
        self._appended.set()
        self._appended = anyio.Event()
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
