"""Log replication: this node's copy of the master's history, and this node's
own events on their way to the master.

- Follow: a follower streams the master's log (`SubscribeEvents`) into its
  store. The stream starts one event back, at the last one this node holds
  (or at the master's last, when this node holds more): if the master's
  differs, this node's history diverged and is set aside, and the node
  publishes what it set aside (`HistoryDiverged`) for every node to see.
- Catch up: before taking office, a new master pulls from the most advanced
  peer, so it continues the same index sequence.
- Outbox: events that happened here go to the master (`PublishEvents`),
  acknowledged and retried until they are; the master skips ids it has seen.
  A batch the master refused (events this node may not publish) is logged
  and dropped: sending it again would be refused again.

Every node serves its copy of the log (`serve_log`): to a peer asking for
events its compacted log no longer holds, a snapshot of the state first,
which the peer installs.
"""

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import grpc
import grpc.aio
from loguru import logger
from pydantic import ValidationError

from exo.cluster.channels import CALL_ERRORS, RPC_TIMEOUT_SECONDS, Channels, LinkError
from exo.cluster.membership import Membership
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.timing import LinkTiming
from exo.master.master import Master
from exo.shared.event_log import LogCompacted
from exo.shared.event_store import EventGap, EventLogUnavailable, EventStore, with_ids
from exo.shared.state_snapshot import decode_state, encode_state
from exo.shared.types.events import (
    Event,
    HistoryDiverged,
    IndexedEvent,
    event_adapter,
    indexed_event_adapter,
)
from exo.shared.types.state import State

# How long a silent subscription waits before it reconnects (it also re-checks the master).
SUBSCRIPTION_IDLE_SECONDS = 5.0
OUTBOX_BATCH = 256
INGEST_BATCH = 256
# A follower this far ahead of the master's reported index holds a fork (the
# report is up to a heartbeat old, hence some slack).
MAX_LEAD_EVENTS = 1000


def first_difference(store: EventStore, batch: list[IndexedEvent]) -> int | None:
    """The index of the first event of `batch` that this node holds otherwise."""
    return next((event.idx for event in batch if store.differs(event)), None)


def ingest(store: EventStore, batch: list[IndexedEvent]) -> bool:
    """Append the new events of `batch`; False if this node's history diverged
    (it is then set aside, and the caller reads the master's from the start)."""
    diverged = first_difference(store, batch)
    if diverged is not None:
        store.reset(diverged_at=diverged)
        return False
    store.ingest(batch)
    return True


async def serve_log(store: EventStore, from_idx: int) -> AsyncIterator[pb.IndexedEventEnvelope]:
    """This node's log from `from_idx` for a peer (`SubscribeEvents`): a snapshot
    first when the log was compacted past `from_idx`, then the events, live."""
    async for item in store.follow(max(0, from_idx)):
        if isinstance(item, State):
            yield pb.IndexedEventEnvelope(idx=item.last_idx, snapshot=encode_state(item))
        else:
            yield pb.IndexedEventEnvelope(
                idx=item.idx, payload=indexed_event_adapter.dump_json(item)
            )


async def _wait(event: anyio.Event, timeout: float) -> None:
    with anyio.move_on_after(timeout):
        await event.wait()


@dataclass
class _Outbox:
    pending: list[tuple[str, Event]] = field(default_factory=list)
    wake: anyio.Event = field(default_factory=anyio.Event)

    def put(self, events: list[tuple[str, Event]]) -> None:
        self.pending.extend(events)
        self.wake.set()


class Replication:
    def __init__(
        self,
        store: EventStore,
        membership: Membership,
        master: Master,
        channels: Channels,
        timing: LinkTiming,
    ) -> None:
        self.node_id = store.node_id
        self._store = store
        self._membership = membership
        self._master = master
        self._channels = channels
        self._timing = timing
        self._outbox = _Outbox()

    def publish(self, *events: Event) -> None:
        """Send this node's events to the master (acknowledged, retried, deduplicated)."""
        self._outbox.put(with_ids(uuid.uuid4().hex, events))

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._follow_loop)
            group.start_soon(self._outbox_loop)

    async def catch_up(self) -> None:
        """Pull from the most advanced peer, if it holds events this node lacks
        (bounded by a peer timeout: then it goes on with what it has)."""
        ahead = self._membership.most_advanced_peer()
        if ahead is not None and ahead.last_applied_idx >= self._store.next_idx:
            with anyio.move_on_after(self._timing.peer_timeout_seconds):
                await self._pull(ahead.address, until=ahead.last_applied_idx)

    async def _pull(self, address: str, until: int | None = None, held: int | None = None) -> None:
        """Ingest indexed events from `address` (to `until`, or while they come).
        `held`: the last index the peer holds, as it last said.

        The stream starts one event back, or at `held` when this node holds
        more, so that a history that diverged (this node was master of its own
        side of a partition) is found at once, not once the peer's log has
        grown as long. Where even the first event compared differs, the
        histories parted earlier: the stream starts again further back, until
        the point where they parted is found, so that what is set aside from
        there is told exactly."""
        start = self._store.next_idx - 1
        if held is not None:
            start = min(start, held)
        start, back = max(0, start), 1
        while (diverged := await self._stream(address, start, until)) is not None:
            if diverged > start or start <= self._store.base_idx:
                self._store.reset(diverged_at=diverged)
                self._report_set_aside()
                return
            start, back = max(self._store.base_idx, start - back), back * 2

    async def _stream(self, address: str, from_idx: int, until: int | None) -> int | None:
        """Ingest the events `address` serves from `from_idx` (to `until`, or
        while they come); events that arrived together are appended as one
        batch (one fsync). Stops at the first event this node holds otherwise
        and returns its index (nothing of that batch appended); None when the
        stream ended (idle, an error, `until` reached)."""
        try:
            stub = await self._channels.stub(address)
        except LinkError as error:
            logger.debug(f"no event stream from {address}: {error}")
            return None
        stream = stub.SubscribeEvents(pb.SubscribeRequest(from_idx=from_idx))
        send, receive = anyio.create_memory_object_stream[IndexedEvent](INGEST_BATCH)
        diverged: int | None = None

        async def read() -> None:
            envelopes = aiter(stream)
            async with send:
                while True:
                    with anyio.fail_after(SUBSCRIPTION_IDLE_SECONDS):
                        envelope = await anext(envelopes, None)
                    if envelope is None:
                        return
                    if envelope.snapshot:  # the peer's log was compacted past ours
                        self._store.install(decode_state(envelope.snapshot))
                        continue
                    await send.send(indexed_event_adapter.validate_json(envelope.payload))

        try:
            async with anyio.create_task_group() as group, receive:
                group.start_soon(read)
                async for first in receive:
                    batch = [first]
                    while len(batch) < INGEST_BATCH:
                        try:
                            batch.append(receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    diverged = first_difference(self._store, batch)
                    if diverged is not None:
                        group.cancel_scope.cancel()
                        break
                    self._store.ingest(batch)
                    if until is not None and self._store.next_idx > until:
                        group.cancel_scope.cancel()
        except* (
            *CALL_ERRORS,
            TimeoutError,
            EventGap,
            EventLogUnavailable,
            LogCompacted,
            ValidationError,
        ) as errors:
            # The caller reconnects (or, taking over, goes on with what it has).
            logger.debug(f"event stream from {address} ended: {errors.exceptions[0]!r}")
        finally:
            stream.cancel()
        return diverged

    async def _follow_loop(self) -> None:
        while True:
            changed = self._membership.changed
            master = self._membership.master_peer()
            if master is None:  # we are master, or none is known yet
                await _wait(changed, self._timing.heartbeat_seconds)
                continue
            if self._store.next_idx - 1 > master.last_applied_idx + MAX_LEAD_EVENTS:
                # We hold events the master never had: a fork.
                self._store.reset(diverged_at=master.last_applied_idx + 1)
                self._report_set_aside()
            # Follow until the stream ends (idle, error) or the master changes.
            async with anyio.create_task_group() as group:

                async def stop_on_change(
                    scope: anyio.CancelScope = group.cancel_scope, changed: anyio.Event = changed
                ) -> None:
                    await changed.wait()
                    scope.cancel()

                group.start_soon(stop_on_change)
                await self._pull(master.address, held=master.last_applied_idx)
                await _wait(changed, self._timing.heartbeat_seconds / 2)
                group.cancel_scope.cancel()

    def _report_set_aside(self) -> None:
        """Tell the cluster what this node's store just set aside: in the
        master's history, for `/state` and the dashboard to show."""
        if self._store.set_aside is not None:
            self.publish(HistoryDiverged(node_id=self.node_id, set_aside=self._store.set_aside))

    async def _outbox_loop(self) -> None:
        while True:
            if not self._outbox.pending:
                self._outbox.wake = anyio.Event()
                await _wait(self._outbox.wake, self._timing.heartbeat_seconds)
                continue
            batch = self._outbox.pending[:OUTBOX_BATCH]
            if await self._deliver(batch):
                del self._outbox.pending[: len(batch)]
            else:
                await anyio.sleep(self._timing.heartbeat_seconds / 2)

    async def _deliver(self, batch: list[tuple[str, Event]]) -> bool:
        if self._master.in_office:
            try:
                self._master.accept(self.node_id, batch)  # it logs what it refuses
            except EventLogUnavailable:
                return False  # kept, and retried: the disk may have space again
            return True
        master = self._membership.master_peer()
        if master is None:
            return False
        envelopes = [
            pb.LocalEventEnvelope(id=i, origin=self.node_id, payload=event_adapter.dump_json(e))
            for i, e in batch
        ]
        try:
            stub = await self._channels.stub(master.address)
            ack: pb.Ack = await stub.PublishEvents(
                pb.EventBatch(events=envelopes), timeout=RPC_TIMEOUT_SECONDS
            )
        except (LinkError, *CALL_ERRORS) as error:
            if (
                isinstance(error, grpc.aio.AioRpcError)
                and error.code() == grpc.StatusCode.PERMISSION_DENIED
            ):
                logger.error(f"the master {master.node_id} refused events: {error.details()}")
                return True  # sent again, it would be refused again
            logger.debug(f"publishing to {master.node_id} failed: {error!r}")
            return False
        return ack.ok
