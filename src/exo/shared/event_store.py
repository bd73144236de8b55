"""A node's copy of the cluster history: the indexed events it has applied.

Every node keeps one: the event log on disk, the state folded from it, and
subscriptions that replay from any index and then follow live. On the master,
`index` turns events into indexed events (`idx` 0, 1, 2, ... with no gaps);
followers `ingest` the master's indexed events as they are, so a node that
becomes master continues the same sequence.

Event ids: every batch of events (a command, a node's publish, a round of the
master's duties) has an id, and its events are `f"{batch_id}:{i}"` (`with_ids`).
`index` skips ids it has seen, so a retried batch is indexed once.

Durability: `index` and `ingest` write and apply at once, on the event loop, in
order; the fsync runs in a thread (`flush`, which `run` calls after every
append and which anyone waiting for durability calls too). Only durable events
leave the node (`subscribe`) or count as applied for `wait_until`, so no peer
and no client ever sees an event a crash could take back.

Compaction: every `compact_every` events the state is written as a snapshot
and the log keeps only its last `retain` events. A restart loads the snapshot
and replays the tail; a peer asking for events the log no longer holds gets
the snapshot first (`follow`), and installs it (`install`).

A full disk: a write or fsync that fails is an error the node survives:
`index`/`ingest` raise `EventLogUnavailable` (nothing was applied), `fault`
says why, and appends work again once there is space.
"""

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from functools import reduce

import anyio
from loguru import logger

from exo.shared.apply import apply
from exo.shared.data_dir import fsync_dir
from exo.shared.event_log import EventLog, EventLogCorrupted
from exo.shared.state_snapshot import read_snapshot, snapshot_path, write_snapshot
from exo.shared.types.commands import ClusterUnavailable
from exo.shared.types.events import Event, IndexedEvent, indexed_event_adapter
from exo.shared.types.ids import NodeId
from exo.shared.types.state import HistorySetAside, State

# Event ids remembered for deduplicating retried batches.
DEDUP_WINDOW = 65_536
# A snapshot every this many events; the log keeps this many before it, so a
# peer a little behind resumes from the log rather than the snapshot.
COMPACT_EVERY = 10_000
RETAIN_EVENTS = 1_000
# How long to wait before trying a failed fsync again.
FAULT_RETRY_SECONDS = 1.0


def now_ms() -> int:
    return int(time.time() * 1000)


def with_ids(batch_id: str, events: Sequence[Event]) -> list[tuple[str, Event]]:
    """The events of one batch with their ids (the one id scheme of the cluster)."""
    return [(f"{batch_id}:{i}", event) for i, event in enumerate(events)]


def _fold(state: State, log: EventLog, from_idx: int) -> State:
    events = (indexed_event_adapter.validate_json(p) for _, p in log.read_from(from_idx))
    return reduce(apply, events, state)


class EventGap(Exception):
    """Indexed events arrived that do not continue this node's log."""


class EventLogUnavailable(ClusterUnavailable):
    """The event log cannot be written (a full disk); nothing was applied."""


class EventStore:
    def __init__(
        self,
        node_id: NodeId,
        log: EventLog,
        *,
        compact_every: int = COMPACT_EVERY,
        retain: int = RETAIN_EVENTS,
    ) -> None:
        self.node_id = node_id
        self._compact_every = compact_every
        self._retain = retain
        self._snapshot_path = snapshot_path(log.path)
        self._snapshot = read_snapshot(self._snapshot_path)
        self._log = self._log_after(self._snapshot, log)
        start = self._snapshot or State()
        self._state = _fold(start, self._log, start.last_idx + 1)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._appended = anyio.Event()  # set (and replaced) on every append
        self._synced = anyio.Event()  # set (and replaced) on every successful fsync
        self._flush_lock = anyio.Lock()
        self._fault: str | None = None
        self._set_aside: HistorySetAside | None = None

    @property
    def set_aside(self) -> HistorySetAside | None:
        """What this node last set aside (`reset`) since it started; None: nothing."""
        return self._set_aside

    @property
    def state(self) -> State:
        return self._state

    @property
    def next_idx(self) -> int:
        return self._log.next_idx

    @property
    def fault(self) -> str | None:
        """Why the log cannot be written now (e.g. a full disk), None when it can."""
        return self._fault

    @property
    def base_idx(self) -> int:
        """The oldest index the log holds (those before are in the snapshot)."""
        return self._log.base_idx

    @property
    def snapshot_idx(self) -> int:
        """The index the latest snapshot holds the state at (-1: none)."""
        return self._snapshot.last_idx if self._snapshot else -1

    def ingest(self, events: Sequence[IndexedEvent]) -> int:
        """Append the master's indexed events; ones already held are skipped.
        Returns how many were new."""
        fresh = [e for e in events if e.idx >= self._log.next_idx]
        for expected, event in enumerate(fresh, start=self._log.next_idx):
            if event.idx != expected:
                raise EventGap(f"expected event {expected}, got {event.idx}")
        self._append(fresh)
        return len(fresh)

    def differs(self, event: IndexedEvent) -> bool:
        """This node holds another event at `event.idx` (its history diverged).
        An index compacted into the snapshot counts as held alike."""
        if event.idx < self._log.base_idx or event.idx >= self._log.next_idx:
            return False
        for _, payload in self._log.read_from(event.idx):
            return indexed_event_adapter.validate_json(payload) != event
        return False

    def index(self, origin: NodeId, events: Sequence[tuple[str, Event]]) -> list[IndexedEvent]:
        """Index, write and apply `(event_id, event)` pairs; an id seen before (a
        retried batch) is skipped. Returns the newly indexed events; raises
        `EventLogUnavailable` (indexing nothing) when the log cannot be written."""
        fresh: dict[str, Event] = {}
        for event_id, event in events:
            if event_id not in self._seen:
                fresh.setdefault(event_id, event)
        if not fresh:
            return []
        at = now_ms()
        first = self._log.next_idx
        indexed = [
            IndexedEvent(idx=first + i, at_ms=at, origin=origin, event=event)
            for i, event in enumerate(fresh.values())
        ]
        self._append(indexed)
        # Seen only once written: a batch that failed is indexed when retried.
        self._seen.update(dict.fromkeys(fresh))
        while len(self._seen) > DEDUP_WINDOW:
            self._seen.popitem(last=False)
        return indexed

    async def flush(self) -> bool:
        """Make every written event durable (an fsync in a thread); False (and
        `fault` says why) when the disk refused."""
        async with self._flush_lock:
            log = self._log
            if log.synced_idx == log.next_idx:
                return True
            try:
                await anyio.to_thread.run_sync(log.sync)
            except ValueError:
                return True  # that log was replaced (reset, snapshot) meanwhile
            except OSError as error:
                self._failed(f"cannot sync the event log: {error}")
                return False
            if self._fault is not None:
                logger.info("the event log is writable again")
                self._fault = None
            self._synced.set()
            self._synced = anyio.Event()
            return True

    async def run(self) -> None:
        """Flush after every append, retrying while the disk refuses; a last
        flush when cancelled."""
        try:
            while True:
                appended = self._appended
                if self._log.synced_idx == self._log.next_idx:
                    await appended.wait()
                elif not await self.flush():
                    await anyio.sleep(FAULT_RETRY_SECONDS)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(FAULT_RETRY_SECONDS):
                await self.flush()

    async def wait_until(self, idx: int, timeout: float) -> bool:
        """Until the event `idx` is durable and applied here (True) or `timeout`
        passes (False). Wakes on every append and fsync, never polls."""
        with anyio.move_on_after(timeout):
            await self._wait_durable(idx)
            return True
        return False

    def event_at(self, idx: int) -> IndexedEvent | None:
        """The event at `idx`, None when this node does not hold it (not yet, or compacted)."""
        if idx < self._log.base_idx:
            return None
        for _, payload in self._log.read_from(idx):
            return indexed_event_adapter.validate_json(payload)
        return None

    def reset(self, diverged_at: int = 0) -> HistorySetAside:
        """Set this node's history aside and start empty: it diverged from the
        master's at index `diverged_at` (e.g. this node indexed events as master
        that never reached the others), and the master's history is the one the
        cluster keeps. Returns what was set aside (also `set_aside`)."""
        path, held = self._log.path, self._log.next_idx
        at = now_ms()
        aside = path.with_name(f"{path.name}.diverged-{at}")
        try:
            # The new, empty log is made first: on a full disk nothing changes.
            fresh = EventLog.create_empty(path.with_name(f"{path.name}.new"), 0)
        except OSError as error:
            self._failed(f"cannot set the diverged history aside: {error}")
            raise EventLogUnavailable(
                f"this node cannot start a new event log ({error})"
            ) from error
        self._log.close()
        path.rename(aside)
        if self._snapshot_path.exists():
            self._snapshot_path.rename(self._snapshot_path.with_name(f"{aside.name}.snapshot"))
        fresh.close()
        path.with_name(f"{path.name}.new").rename(path)
        fsync_dir(path.parent)
        # The whole log is kept aside, but only its events from `diverged_at` on
        # are lost to the cluster: those are the ones worth telling.
        diverged_at = max(0, min(diverged_at, held))
        set_aside = HistorySetAside(
            at_ms=at,
            from_idx=diverged_at,
            events=held - diverged_at,
            kept_as=aside.name,
        )
        logger.warning(
            f"event history diverged from the master's at index {diverged_at}: "
            f"{set_aside.events} event(s) this node held are not the cluster's; "
            f"kept them as {aside.name} and took the master's history"
        )
        self._set_aside = set_aside
        self._snapshot = None
        self._log = EventLog.open(path)
        self._replaced(State())
        return set_aside

    def install(self, snapshot: State) -> None:
        """Take a peer's snapshot as this node's history up to its index (the
        events this node lacks were compacted there). The empty log after it is
        made aside first, then the snapshot written, then the log renamed into
        place: a full disk changes nothing, and a crash before the rename
        leaves the snapshot beside the older log, which loading replaces."""
        path = self._log.path
        aside = path.with_name(f"{path.name}.new")
        try:
            EventLog.create_empty(aside, snapshot.last_idx + 1).close()
            try:
                write_snapshot(self._snapshot_path, snapshot)
            except OSError:
                aside.unlink()
                raise
        except OSError as error:
            self._failed(f"cannot install a snapshot: {error}")
            raise EventLogUnavailable(f"this node cannot install a snapshot ({error})") from error
        self._log.close()
        aside.rename(path)
        fsync_dir(path.parent)
        self._log = EventLog.open(path)
        self._snapshot = snapshot
        logger.info(f"installed a snapshot of the cluster state at index {snapshot.last_idx}")
        self._replaced(snapshot)

    async def follow(self, from_idx: int) -> AsyncIterator[State | IndexedEvent]:
        """What a peer needs from `from_idx` on: the snapshot first when the log
        no longer holds `from_idx`, then every durable event, live."""
        if from_idx < self._log.base_idx and self._snapshot is not None:
            snapshot = self._snapshot
            yield snapshot
            from_idx = snapshot.last_idx + 1
        async for event in self.subscribe(from_idx):
            yield event

    async def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]:
        """Every durable indexed event from `from_idx` on (from the oldest the
        log holds, when it was compacted): the log, then live ones as they come.
        A reader that falls behind a compaction gets `LogCompacted`."""
        next_idx = max(from_idx, self._log.base_idx)
        while True:
            await self._wait_durable(next_idx)
            synced = self._log.synced_idx
            for idx, payload in self._log.read_from(next_idx):
                if idx >= synced:
                    break
                yield indexed_event_adapter.validate_json(payload)
                next_idx = idx + 1

    async def _wait_durable(self, idx: int) -> None:
        """Until the event `idx` is durable here (flushing it if need be)."""
        while self._log.synced_idx <= idx:
            appended, synced = self._appended, self._synced
            if self._log.next_idx > idx:
                if not await self.flush():
                    with anyio.move_on_after(FAULT_RETRY_SECONDS):
                        await synced.wait()
                continue
            await appended.wait()

    def _append(self, indexed: Sequence[IndexedEvent]) -> None:
        if not indexed:
            return
        try:
            self._log.write([indexed_event_adapter.dump_json(e) for e in indexed])
        except OSError as error:
            self._failed(f"cannot write the event log: {error}")
            raise EventLogUnavailable(
                f"this node cannot write its event log ({error.strerror or error})"
            ) from error
        self._state = reduce(apply, indexed, self._state)
        self._appended.set()
        self._appended = anyio.Event()
        if self._state.last_idx - self.snapshot_idx >= self._compact_every:
            self._compact()

    def _compact(self) -> None:
        """Snapshot the state, then drop all but the last `retain` events before it."""
        state = self._state
        try:
            write_snapshot(self._snapshot_path, state)
            self._snapshot = state
            self._log.rewrite_from(state.last_idx + 1 - self._retain)
        except OSError as error:
            self._failed(f"cannot compact the event log: {error}")
            return
        logger.info(
            f"event log compacted: snapshot at index {state.last_idx}, "
            f"the log holds {self._log.base_idx}..{self._log.next_idx - 1}"
        )

    def _failed(self, fault: str) -> None:
        if self._fault != fault:
            logger.error(f"{fault}; the node goes on and retries")
        self._fault = fault

    def _replaced(self, state: State) -> None:
        self._state = state
        self._appended.set()
        self._appended = anyio.Event()

    @staticmethod
    def _log_after(snapshot: State | None, log: EventLog) -> EventLog:
        """`log`, checked to continue `snapshot` (replaced by an empty log after
        the snapshot when it ends before it: a crash while a snapshot was installed)."""
        after = snapshot.last_idx + 1 if snapshot else 0
        if log.base_idx > after:
            raise EventLogCorrupted(
                log.path, 0, log.base_idx, f"the log starts after its snapshot (index {after - 1})"
            )
        if log.next_idx < after:
            log.close()
            return EventLog.create_empty(log.path, after)
        return log
