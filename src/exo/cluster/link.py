"""The cluster link of a node: its gRPC server and the parts of the transport,
put together.

- `Membership`: Hello, peers, who is master;
- `Replication`: following the master's log, this node's outbox;
- `ModelFileService`: this node's model files for peers;
- commands: sent to the master, or handed to this node's `Master` while it is
  in office. The link decides nothing: a command received over gRPC goes to
  the `Master`, and its outcome goes back.

The server runs over TLS with this node's certificate, whose key this node's
id is a digest of; `ServerAuth` answers the secret's challenge and lets
through only calls with a session, and a session speaks for the one node whose
key proved: the node its Hello names and the origin of the events it publishes
must be that node (else PERMISSION_DENIED, logged), and the master indexes only
the events that node may originate (a refusal is reported to the caller).
"""

import uuid
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import anyio
import grpc
import grpc.aio
from loguru import logger
from pydantic import ValidationError

from exo.cluster.auth import ProofRefused, ServerAuth, SessionInterceptor
from exo.cluster.channels import CALL_ERRORS, RPC_TIMEOUT_SECONDS, Channels, LinkError
from exo.cluster.membership import Membership
from exo.cluster.model_files import ModelFileService
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.replication import Replication, serve_log
from exo.cluster.timing import LinkTiming
from exo.cluster.tls import NodeCertificate, server_credentials
from exo.master.master import Master, NotMaster
from exo.models.local_store import ModelStore
from exo.shared.event_store import EventLogUnavailable, EventStore
from exo.shared.types.commands import (
    ClusterUnavailable,
    Command,
    CommandRejected,
    command_adapter,
)
from exo.shared.types.events import Event, IndexedEvent, event_adapter
from exo.shared.types.ids import NodeId
from exo.shared.types.state import State

COMMAND_TIMEOUT_SECONDS = 10.0


class ClusterLink:
    def __init__(
        self,
        store: EventStore,
        master: Master,
        grpc_host: str,
        grpc_port: int,
        advertised_host: str,
        secret: str,
        static_peers: list[str],
        timing: LinkTiming,
        certificate: NodeCertificate,
        force_master: bool = False,
        discovering: bool = False,
        model_store: ModelStore | None = None,
    ) -> None:
        if store.node_id != certificate.node_id:
            raise ValueError(
                f"the event store is node {store.node_id}'s, the certificate node "
                f"{certificate.node_id}'s: a node's id is its certificate's"
            )
        self.store = store
        self.master = master
        self.node_id = store.node_id
        self.certificate = certificate  # this node's identity, for calls to peers
        self.address = f"{advertised_host}:{grpc_port}"
        self.resumed_from_idx = store.next_idx
        self._bind = f"{grpc_host}:{grpc_port}"
        self._secret_is_empty = not secret
        self.auth = ServerAuth(secret, certificate)
        self._timing = timing
        self._channels = Channels(secret, certificate)
        self.membership = Membership(
            store,
            self.address,
            self._channels,
            static_peers,
            self._on_master_changed,
            timing,
            force_master=force_master,
            discovering=discovering,
            on_peer_lost=master.wake,  # its instances are placed again at once
        )
        self.replication = Replication(store, self.membership, master, self._channels, timing)
        # Serves this node's model files to peers (FetchFile); None: serves none.
        self.files = ModelFileService(model_store)

    # -- what other components use -------------------------------------------------

    @property
    def state(self) -> State:
        return self.store.state

    @property
    def master_id(self) -> NodeId | None:
        return self.membership.master_id

    @property
    def event_log_error(self) -> str | None:
        return self.store.fault

    def events_behind(self) -> int:
        master = self.membership.master_peer()
        return max(0, master.last_applied_idx - self.store.state.last_idx) if master else 0

    def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]:
        return self.store.subscribe(from_idx)

    def heard_ms(self) -> dict[NodeId, int]:
        """When this node's link last heard each live peer (wall-clock ms)."""
        return self.membership.heard_ms()

    def publish(self, *events: Event) -> None:
        """Send this node's events to the master (acknowledged, retried, deduplicated)."""
        self.replication.publish(*events)

    async def wait_until(self, idx: int, timeout: float) -> bool:
        """Until this node has applied the event `idx` (True) or `timeout` passes."""
        return await self.store.wait_until(idx, timeout)

    async def send_command(self, command: Command) -> int:
        """Have the master carry out `command`; returns the index of its last
        event (wait for it with `wait_until` to see the effect here). Raises
        `CommandRejected` with its reason, or `ClusterUnavailable` when no master
        answers in time. Retries (a master change) keep the command's id, so the
        master indexes its events once."""
        command_id = uuid.uuid4().hex
        envelope = pb.CommandEnvelope(
            id=command_id, origin=self.node_id, payload=command_adapter.dump_json(command)
        )
        with anyio.move_on_after(COMMAND_TIMEOUT_SECONDS):
            while True:
                if self.master.in_office:
                    return self.master.execute(command_id, self.node_id, command)
                master = self.membership.master_peer()
                if master is not None:
                    try:
                        stub = await self._channels.stub(master.address)
                        reply: pb.CommandReply = await stub.SendCommand(
                            envelope, timeout=RPC_TIMEOUT_SECONDS
                        )
                        return reply.last_idx
                    except LinkError:
                        pass  # the master is gone or not ours: wait for the next one
                    except CALL_ERRORS as error:
                        if isinstance(error, grpc.aio.AioRpcError) and error.code() in (
                            grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.INVALID_ARGUMENT,
                        ):
                            raise CommandRejected(
                                error.details() or "rejected",
                                not_found=error.code() == grpc.StatusCode.NOT_FOUND,
                            ) from error
                await anyio.sleep(self._timing.heartbeat_seconds / 2)  # a master change: retry
        raise ClusterUnavailable(f"no master answered within {COMMAND_TIMEOUT_SECONDS:.0f}s")

    def add_peer_address(self, address: str) -> None:
        self.membership.add_peer_address(address)

    # -- running ---------------------------------------------------------------------

    async def run(self, on_ready: Callable[[], None] = lambda: None) -> None:
        server = grpc.aio.server(interceptors=[SessionInterceptor(self.auth)])
        pb_grpc.add_ClusterServicer_to_server(_Servicer(self), server)
        if server.add_secure_port(self._bind, server_credentials(self.certificate)) == 0:
            raise OSError(f"cannot listen for gRPC on {self._bind}")
        await server.start()
        logger.info(
            f"node {self.node_id}: cluster link (gRPC over TLS) on {self._bind}, "
            f"event log resumes at index {self.resumed_from_idx}"
        )
        if self._secret_is_empty:
            logger.warning(
                "no --cluster-secret: anyone who can reach this node's cluster port can join "
                "the cluster and control it"
            )
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.membership.run)
                group.start_soon(self.replication.run)
                on_ready()
        finally:
            with anyio.CancelScope(shield=True):
                await server.stop(grace=1)
                await self._channels.close()

    async def _on_master_changed(self, master_id: NodeId) -> None:
        """Elected: catch up from the most advanced peer, then take office (the
        index sequence goes on). Another node elected: leave office."""
        if master_id != self.node_id:
            self.master.leave_office()
            return
        await self.replication.catch_up()
        self.master.take_office()
        self.master.wake()


class _Servicer(pb_grpc.ClusterServicer):
    """Hands each call to the part of the node that answers it."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    async def _caller(self, context: grpc.aio.ServicerContext) -> NodeId:
        """The node the call's session speaks for (the interceptor let only
        sessions through; one may have expired since)."""
        caller = self.link.auth.caller_of(context)
        if caller is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the session expired")
            raise AssertionError  # abort raises
        return caller

    async def _deny(self, context: grpc.aio.ServicerContext, what: str, reason: str) -> NoReturn:
        """Refuse a call from a member that acts beyond its own node (logged)."""
        self.link.auth.rejections.warn(context.peer(), what, reason)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        raise AssertionError  # abort raises

    async def Challenge(
        self, request: pb.ChallengeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChallengeReply:
        return self.link.auth.challenge(request)

    async def Prove(
        self, request: pb.ProofRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionGrant:
        try:
            return self.link.auth.prove(request, context.peer())
        except ProofRefused as refusal:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"no session: {refusal}")
            raise

    async def Hello(
        self, request: pb.HelloRequest, context: grpc.aio.ServicerContext
    ) -> pb.HelloReply:
        caller = await self._caller(context)
        if request.node_id != caller:
            await self._deny(
                context, "a Hello", f"node {caller} says Hello as node {request.node_id!r}"
            )
        return self.link.membership.answer(request)

    async def PublishEvents(
        self, request: pb.EventBatch, context: grpc.aio.ServicerContext
    ) -> pb.Ack:
        # A session speaks for the node that proved: it publishes its own events only.
        caller = await self._caller(context)
        if any(envelope.origin != caller for envelope in request.events):
            await self._deny(
                context, "events", f"node {caller} publishes only its own events, as itself"
            )
        try:
            events = [
                (envelope.id, event_adapter.validate_json(envelope.payload))
                for envelope in request.events
            ]
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad event: {error}")
            raise
        try:
            refused = self.link.master.accept(caller, events)
        except NotMaster:
            return pb.Ack(ok=False, message=f"not the master (master is {self.link.master_id})")
        except EventLogUnavailable as error:
            return pb.Ack(ok=False, message=str(error))
        # Answered only once durable: the node drops what was acknowledged or refused.
        if not await self.link.store.flush():
            return pb.Ack(ok=False, message=self.link.store.fault or "the event log is not durable")
        if refused:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"refused event(s) that node {caller} may not publish: "
                + ", ".join(sorted({e.kind for e in refused})),
            )
        return pb.Ack(ok=True)

    async def SubscribeEvents(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IndexedEventEnvelope]:
        async for envelope in serve_log(self.link.store, request.from_idx):
            yield envelope

    async def SendCommand(
        self, request: pb.CommandEnvelope, context: grpc.aio.ServicerContext
    ) -> pb.CommandReply:
        caller = await self._caller(context)
        try:
            command = command_adapter.validate_json(request.payload)
            last_idx = self.link.master.execute(request.id, caller, command)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad command: {error}")
            raise
        except CommandRejected as error:
            code = (
                grpc.StatusCode.NOT_FOUND if error.not_found else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(error))
            raise
        except NotMaster:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"not the master ({self.link.master_id})"
            )
            raise
        except EventLogUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
            raise
        return pb.CommandReply(last_idx=last_idx)

    async def ListModelFiles(
        self, request: pb.ListModelFilesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelFileList:
        return await self.link.files.list_files(request, context)

    async def FetchFile(
        self, request: pb.FetchFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        async for chunk in self.link.files.fetch_file(request, context):
            yield chunk
