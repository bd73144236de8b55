"""The cluster link of a node: gRPC server and clients, membership, election,
the master's event stream and this node's outbox of local events.

Every node serves its copy of the event history (`SubscribeEvents`), so a
follower can catch up from any peer and a new master continues the same index
sequence. Local events go to the master (`PublishEvents`), acknowledged and
retried until they are; the master deduplicates them by id.
"""

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import BinaryIO, TypedDict

import anyio
import grpc
import grpc.aio
from loguru import logger
from pydantic import ValidationError

from exo.cluster.auth import cluster_channel, cluster_server, secret_fingerprint
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.master.commands import CommandRejected, decide
from exo.master.event_store import EventGap, EventStore
from exo.master.recovery import Recovery, broken_instances, instances_on
from exo.models.local_store import ModelStore
from exo.models.store import InvalidModelId, validate_model_id
from exo.shared.election import Candidate, elect
from exo.shared.types.commands import Command, command_adapter
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    MasterElected,
    event_adapter,
    indexed_event_adapter,
)
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import State

RPC_TIMEOUT_SECONDS = 2.0
# How long a silent subscription waits before it reconnects (it also re-checks the master).
SUBSCRIPTION_IDLE_SECONDS = 5.0
OUTBOX_BATCH = 256
INGEST_BATCH = 256
COMMAND_TIMEOUT_SECONDS = 10.0
# A follower this far ahead of the master's reported index holds a fork (the
# report is up to a heartbeat old, hence some slack).
MAX_LEAD_EVENTS = 1000
# Model file chunks (gRPC's default message limit is 4 MiB).
FILE_CHUNK_BYTES = 1 << 20
CHUNKS_PER_READ = 8


class ClusterUnavailable(Exception):
    """No master could be reached."""


class _HelloFields(TypedDict):
    node_id: str
    address: str
    started_at_ms: int
    force_master: bool
    last_applied_idx: int
    master_id: str
    term: int


@dataclass(frozen=True)
class LinkTiming:
    heartbeat_seconds: float = 1.0
    # A peer not heard from for this long is dropped from membership (and elections).
    peer_timeout_seconds: float = 5.0
    # The master times out a node whose events stopped for this long.
    node_timeout_seconds: float = 20.0


@dataclass
class PeerView:
    node_id: NodeId
    address: str
    started_at_ms: int
    force_master: bool
    last_applied_idx: int
    master_id: NodeId | None
    term: int
    heard_at: float  # monotonic


@dataclass
class _Outbox:
    pending: list[tuple[str, Event]] = field(default_factory=list)
    wake: anyio.Event = field(default_factory=anyio.Event)

    def put(self, events: list[tuple[str, Event]]) -> None:
        self.pending.extend(events)
        self.wake.set()


class ClusterLink:
    def __init__(
        self,
        store: EventStore,
        grpc_host: str,
        grpc_port: int,
        advertised_host: str,
        secret: str,
        static_peers: list[str],
        force_master: bool = False,
        timing: LinkTiming = LinkTiming(),
        discovering: bool = False,
        model_store: ModelStore | None = None,
    ) -> None:
        self.store = store
        # Serves this node's model files to peers (FetchFile); None: serves none.
        self.model_store = model_store
        self.node_id = store.node_id
        self.address = f"{advertised_host}:{grpc_port}"
        self._bind = f"{grpc_host}:{grpc_port}"
        self.secret = secret
        self.force_master = force_master
        # mDNS may still find peers: the first election waits a peer timeout.
        self.discovering = discovering
        self.started_at_ms = int(time.time() * 1000)
        self._started_monotonic = time.monotonic()
        self.timing = timing
        self.master_id: NodeId | None = None
        self.resumed_from_idx = store.next_idx
        self._addresses: set[str] = set(static_peers) - {self.address}
        self._peers: dict[NodeId, PeerView] = {}
        self._outbox = _Outbox()
        self._master_changed = anyio.Event()
        self._channels: dict[str, grpc.aio.Channel] = {}

    # -- what other components use -------------------------------------------------

    @property
    def state(self) -> State:
        return self.store.state

    def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]:
        return self.store.subscribe(from_idx)

    def publish(self, *events: Event) -> None:
        """Send this node's events to the master (acknowledged, retried, deduplicated)."""
        self._outbox.put([(uuid.uuid4().hex, e) for e in events])

    async def send_command(self, command: Command) -> None:
        """Have the master carry out `command`; raises `CommandRejected` with its
        reason, or `ClusterUnavailable` when no master answers in time."""
        envelope = pb.CommandEnvelope(
            id=uuid.uuid4().hex, origin=self.node_id, payload=command_adapter.dump_json(command)
        )
        with anyio.move_on_after(COMMAND_TIMEOUT_SECONDS):
            while True:
                if self.master_id == self.node_id:
                    self.store.publish(
                        self.node_id,
                        [(uuid.uuid4().hex, e) for e in decide(self.store.state, command)],
                    )
                    return
                master = self._peers.get(self.master_id) if self.master_id else None
                if master is not None:
                    try:
                        await self._stub(master.address).SendCommand(
                            envelope, timeout=RPC_TIMEOUT_SECONDS
                        )
                        return
                    except grpc.aio.AioRpcError as error:
                        if error.code() in (
                            grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.INVALID_ARGUMENT,
                        ):
                            raise CommandRejected(
                                error.details() or "rejected",
                                not_found=error.code() == grpc.StatusCode.NOT_FOUND,
                            ) from error
                await anyio.sleep(self.timing.heartbeat_seconds / 2)  # a master change: retry
        raise ClusterUnavailable(f"no master answered within {COMMAND_TIMEOUT_SECONDS:.0f}s")

    def add_peer_address(self, address: str) -> None:
        if address != self.address and address not in self._addresses:
            logger.info(f"peer address {address} discovered")
            self._addresses.add(address)

    def peers(self) -> list[PeerView]:
        return sorted(self._peers.values(), key=lambda p: p.node_id)

    # -- running ---------------------------------------------------------------------

    async def run(self, on_ready: Callable[[], None] = lambda: None) -> None:
        server = cluster_server(self.secret)
        pb_grpc.add_ClusterServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port(self._bind) == 0:
            raise OSError(f"cannot listen for gRPC on {self._bind}")
        await server.start()
        logger.info(
            f"node {self.node_id}: gRPC on {self._bind} (cluster {secret_fingerprint(self.secret)}), "
            f"event log resumes at index {self.resumed_from_idx}"
        )
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._membership_loop)
                group.start_soon(self._follow_loop)
                group.start_soon(self._outbox_loop)
                group.start_soon(self._master_duties_loop)
                on_ready()
        finally:
            with anyio.CancelScope(shield=True):
                await server.stop(grace=1)
                for channel in self._channels.values():
                    await channel.close()

    def _stub(self, address: str) -> pb_grpc.ClusterStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = cluster_channel(address, self.secret)
        return pb_grpc.ClusterStub(channel)

    def hello_view(self) -> "_HelloFields":
        return {
            "node_id": self.node_id,
            "address": self.address,
            "started_at_ms": self.started_at_ms,
            "force_master": self.force_master,
            "last_applied_idx": self.store.next_idx - 1,
            "master_id": self.master_id or "",
            "term": self.store.state.master_term,
        }

    # -- membership and election -------------------------------------------------

    async def _hello(self, address: str) -> None:
        try:
            reply: pb.HelloReply = await self._stub(address).Hello(
                pb.HelloRequest(**self.hello_view()), timeout=RPC_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                logger.warning(f"peer {address} rejected our cluster secret: {error.details()}")
            return
        self._heard(reply)

    def _heard(self, view: pb.HelloRequest | pb.HelloReply) -> None:
        node_id = NodeId(view.node_id)
        if node_id == self.node_id:
            return
        if node_id not in self._peers:
            logger.info(f"node {node_id} joined at {view.address}")
        self._peers[node_id] = PeerView(
            node_id=node_id,
            address=view.address,
            started_at_ms=view.started_at_ms,
            force_master=view.force_master,
            last_applied_idx=view.last_applied_idx,
            master_id=NodeId(view.master_id) if view.master_id else None,
            term=view.term,
            heard_at=time.monotonic(),
        )
        self._addresses.add(view.address)
        if isinstance(view, pb.HelloReply):
            for peer in view.peers:
                if peer.node_id != self.node_id:
                    self._addresses.add(peer.address)

    async def _membership_loop(self) -> None:
        while True:
            async with anyio.create_task_group() as group:
                for address in list(self._addresses):
                    group.start_soon(self._hello, address)
            self._drop_silent_peers()
            await self._elect()
            await anyio.sleep(self.timing.heartbeat_seconds)

    def _drop_silent_peers(self) -> None:
        deadline = time.monotonic() - self.timing.peer_timeout_seconds
        for node_id, peer in list(self._peers.items()):
            if peer.heard_at < deadline:
                logger.warning(f"node {node_id} at {peer.address} stopped answering")
                del self._peers[node_id]

    async def _elect(self) -> None:
        if self.master_id is None and not self._settled():
            return
        master = elect(self._candidates(), incumbent=self._incumbent())
        if master == self.master_id:
            return
        logger.info(f"master is now {master} (was {self.master_id})")
        self.master_id = master
        self._master_changed.set()
        self._master_changed = anyio.Event()
        if master == self.node_id:
            await self._take_over()

    def _settled(self) -> bool:
        """Before a first election: every known peer answered, or a peer timeout
        passed (always waited when discovery may still find peers), so a node does
        not start a history of its own beside a cluster."""
        waited = time.monotonic() - self._started_monotonic
        if waited >= self.timing.peer_timeout_seconds:
            return True
        heard = {p.address for p in self._peers.values()}
        return not self.discovering and self._addresses <= heard

    def _incumbent(self) -> NodeId | None:
        """The master to keep. When two nodes claim to be master (two clusters that
        met, a partition that healed), the claim with the higher term wins, then
        the election order; the other side follows and takes that history."""
        claims = {p.node_id: p.term for p in self._peers.values() if p.master_id == p.node_id}
        if self.master_id == self.node_id:
            claims[self.node_id] = self.store.state.master_term
        if len(claims) <= 1:
            return self.master_id
        ranks = {c.node_id: c for c in self._candidates()}
        top = max(claims.values())
        return elect(ranks[n] for n, term in claims.items() if term == top and n in ranks)

    def _candidates(self) -> list[Candidate]:
        return [Candidate(self.node_id, self.started_at_ms, self.force_master)] + [
            Candidate(p.node_id, p.started_at_ms, p.force_master) for p in self._peers.values()
        ]

    async def _take_over(self) -> None:
        """Catch up from the most advanced peer, then continue the sequence as master."""
        ahead = max(self._peers.values(), key=lambda p: p.last_applied_idx, default=None)
        if ahead is not None and ahead.last_applied_idx >= self.store.next_idx:
            with anyio.move_on_after(self.timing.peer_timeout_seconds):
                await self._pull(ahead.address, until=ahead.last_applied_idx)
        term = self.store.state.master_term + 1
        self.store.publish(
            self.node_id, [(uuid.uuid4().hex, MasterElected(master_id=self.node_id, term=term))]
        )
        logger.info(f"node {self.node_id} is master (term {term}) at index {self.store.next_idx}")

    # -- the event stream --------------------------------------------------------

    async def _pull(self, address: str, until: int | None = None) -> None:
        """Ingest indexed events from `address` (to `until`, or while they come).

        The stream starts one event back, at the last one this node holds: if
        the peer's differs, this node's history diverged and is set aside.
        Events that arrived together are appended as one batch (one fsync).
        """
        overlap = max(0, self.store.next_idx - 1)
        stream = self._stub(address).SubscribeEvents(pb.SubscribeRequest(from_idx=overlap))
        send, receive = anyio.create_memory_object_stream[IndexedEvent](INGEST_BATCH)

        async def read() -> None:
            envelopes = aiter(stream)
            async with send:
                while True:
                    with anyio.fail_after(SUBSCRIPTION_IDLE_SECONDS):
                        envelope = await anext(envelopes, None)
                    if envelope is None:
                        return
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
                    if not self._ingest(batch) or (
                        until is not None and self.store.next_idx > until
                    ):
                        group.cancel_scope.cancel()
        except* (grpc.aio.AioRpcError, TimeoutError, EventGap, ValidationError) as errors:
            # The caller reconnects (or, taking over, goes on with what it has).
            logger.debug(f"event stream from {address} ended: {errors.exceptions[0]!r}")
        finally:
            stream.cancel()

    def _ingest(self, batch: list[IndexedEvent]) -> bool:
        """Append the new events of `batch`; False if this node's history diverged."""
        for event in batch:
            if event.idx < self.store.next_idx and event != self.store.event_at(event.idx):
                self.store.reset()
                return False
        self.store.ingest(batch)
        return True

    async def _follow_loop(self) -> None:
        while True:
            changed = self._master_changed
            master = self._peers.get(self.master_id) if self.master_id else None
            if master is None:  # we are master, or none is known yet
                await _wait(changed, self.timing.heartbeat_seconds)
                continue
            if self.store.next_idx - 1 > master.last_applied_idx + MAX_LEAD_EVENTS:
                self.store.reset()  # we hold events the master never had: a fork
            # Follow until the stream ends (idle, error) or the master changes.
            async with anyio.create_task_group() as group:

                async def stop_on_change(
                    scope: anyio.CancelScope = group.cancel_scope, changed: anyio.Event = changed
                ) -> None:
                    await changed.wait()
                    scope.cancel()

                group.start_soon(stop_on_change)
                await self._pull(master.address)
                await _wait(changed, self.timing.heartbeat_seconds / 2)
                group.cancel_scope.cancel()

    async def _outbox_loop(self) -> None:
        while True:
            if not self._outbox.pending:
                self._outbox.wake = anyio.Event()
                await _wait(self._outbox.wake, self.timing.heartbeat_seconds)
                continue
            batch = self._outbox.pending[:OUTBOX_BATCH]
            if await self._deliver(batch):
                del self._outbox.pending[: len(batch)]
            else:
                await anyio.sleep(self.timing.heartbeat_seconds / 2)

    async def _deliver(self, batch: list[tuple[str, Event]]) -> bool:
        if self.master_id == self.node_id:
            self.store.publish(self.node_id, batch)
            return True
        master = self._peers.get(self.master_id) if self.master_id else None
        if master is None:
            return False
        envelopes = [
            pb.LocalEventEnvelope(id=i, origin=self.node_id, payload=event_adapter.dump_json(e))
            for i, e in batch
        ]
        try:
            ack: pb.Ack = await self._stub(master.address).PublishEvents(
                pb.EventBatch(events=envelopes), timeout=RPC_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            logger.debug(f"publishing to {master.node_id} failed: {error.code()}")
            return False
        return ack.ok

    async def _master_duties_loop(self) -> None:
        recovery = Recovery()
        while True:
            await anyio.sleep(self.timing.heartbeat_seconds)
            if self.master_id != self.node_id:
                continue
            before = self.store.state
            gone = self.store.time_out_silent_nodes(int(self.timing.node_timeout_seconds * 1000))
            for node_id in gone:
                logger.warning(f"node {node_id} timed out; its instances are removed")
            lost = [(i, False) for i in instances_on(before, gone)]
            for instance, listed in lost + [(i, True) for i in broken_instances(self.store.state)]:
                logger.warning(
                    f"instance {instance.instance_id} of {instance.model_id} lost a rank; placing it again"
                )
                for command in recovery.commands(instance, listed):
                    try:
                        events = decide(self.store.state, command)
                    except CommandRejected as error:
                        logger.warning(f"cannot place {instance.model_id} again: {error}")
                        continue
                    self.store.publish(self.node_id, [(uuid.uuid4().hex, e) for e in events])


def _valid_model_id(value: str) -> ModelId | None:
    try:
        return validate_model_id(value)
    except InvalidModelId:
        return None


def _read_chunks(f: BinaryIO) -> list[bytes]:
    chunks: list[bytes] = []
    for _ in range(CHUNKS_PER_READ):
        data = f.read(FILE_CHUNK_BYTES)
        if not data:
            break
        chunks.append(data)
    return chunks


async def _wait(event: anyio.Event, timeout: float) -> None:
    with anyio.move_on_after(timeout):
        await event.wait()


class _Servicer(pb_grpc.ClusterServicer):
    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext
    ) -> pb.HelloReply:
        self.link._heard(request)
        peers = [pb.Peer(node_id=p.node_id, address=p.address) for p in self.link.peers()]
        return pb.HelloReply(**self.link.hello_view(), peers=peers)

    async def PublishEvents(
        self, request: pb.EventBatch, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        link = self.link
        if link.master_id != link.node_id:
            return pb.Ack(ok=False, message=f"not the master (master is {link.master_id})")
        try:
            by_origin: dict[str, list[tuple[str, Event]]] = {}
            for envelope in request.events:
                event = event_adapter.validate_json(envelope.payload)
                by_origin.setdefault(envelope.origin, []).append((envelope.id, event))
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad event: {error}")
            raise
        for origin, events in by_origin.items():
            link.store.publish(NodeId(origin), events)
        return pb.Ack(ok=True)

    async def SubscribeEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IndexedEventEnvelope]:
        async for indexed in self.link.store.subscribe(max(0, request.from_idx)):
            yield pb.IndexedEventEnvelope(
                idx=indexed.idx, payload=indexed_event_adapter.dump_json(indexed)
            )

    async def SendCommand(
        self, request: pb.CommandEnvelope, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        link = self.link
        if link.master_id != link.node_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"not the master ({link.master_id})"
            )
        try:
            command = command_adapter.validate_json(request.payload)
            events = decide(link.store.state, command)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad command: {error}")
            raise
        except CommandRejected as error:
            code = (
                grpc.StatusCode.NOT_FOUND if error.not_found else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(error))
            raise
        # The envelope id makes a retried command's events dedupe at the master.
        link.store.publish(
            NodeId(request.origin), [(f"{request.id}:{i}", e) for i, e in enumerate(events)]
        )
        return pb.Ack(ok=True)

    async def ListModelFiles(
        self, request: pb.ListModelFilesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelFileList:
        store = self.link.model_store
        model_id = _valid_model_id(request.model_id)
        if store is None or model_id is None or store.find(model_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no copy of {request.model_id!r} here")
            raise AssertionError  # abort raises
        files = await anyio.to_thread.run_sync(store.list_files, model_id)
        return pb.ModelFileList(
            files=[pb.ModelFile(path=f.path, size=f.size, sha256=f.sha256) for f in files]
        )

    async def FetchFile(
        self, request: pb.FetchFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        store = self.link.model_store
        model_id = _valid_model_id(request.model_id)
        path = store.file(model_id, request.path) if store and model_id else None
        if path is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no file {request.path!r} of {request.model_id!r} here"
            )
            raise AssertionError  # abort raises
        size = path.stat().st_size
        offset = max(0, request.offset)
        with path.open("rb") as f:
            f.seek(offset)
            while offset < size:
                # Several chunks per thread hop: the hop costs more than a read.
                chunks = await anyio.to_thread.run_sync(_read_chunks, f)
                if not chunks:
                    break
                for data in chunks:
                    yield pb.FileChunk(offset=offset, data=data, total_size=size)
                    offset += len(data)

    async def Elect(
        self, request: pb.ElectionMessage, context: grpc.aio.ServicerContext
    ) -> pb.ElectionMessage:
        view = self.link.hello_view()
        return pb.ElectionMessage(
            node_id=self.link.node_id,
            started_at_ms=self.link.started_at_ms,
            force_master=self.link.force_master,
            term=self.link.store.state.master_term,
            master_id=self.link.master_id or "",
            last_idx=view["last_applied_idx"],
        )
