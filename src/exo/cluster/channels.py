"""One authenticated session per peer address, shared by everything that calls peers."""

import anyio
import grpc
import grpc.aio

from exo.cluster.auth import LinkError, PeerSession, connect
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import NodeCertificate

# How long a unary call to a peer may take.
RPC_TIMEOUT_SECONDS = 2.0

# What a call to a peer may raise besides `LinkError` (UsageError: its session
# was closed under it, after the peer failed another call).
CALL_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError)

# A call that failed with one of these ends the session: the peer restarted
# (a new certificate, a new process) or no longer takes our token.
_SESSION_ENDING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


class Channels:
    def __init__(self, secret: str, identity: NodeCertificate) -> None:
        self._secret = secret
        self._identity = identity
        self._sessions: dict[str, PeerSession] = {}
        # Sessions forgotten but not closed yet, by address (see `_forget`).
        self._retired: dict[str, PeerSession] = {}
        self._locks: dict[str, anyio.Lock] = {}

    async def session(self, address: str) -> PeerSession:
        """The authenticated session with `address` (its `stub`, its `peer_id`);
        opens or renews it first when needed. Raises `LinkError`."""
        lock = self._locks.setdefault(address, anyio.Lock())
        async with lock:
            session = self._sessions.get(address)
            if session is None:
                session = self._sessions[address] = await connect(
                    address, self._secret, self._identity
                )
            elif session.expiring():
                try:
                    await session.authenticate()
                except LinkError:
                    await self._forget(address)
                    raise
        return session

    async def stub(self, address: str) -> pb_grpc.ClusterStub:
        """A stub whose calls reach `address` authenticated (see `session`)."""
        return (await self.session(address)).stub

    async def failed(self, address: str, error: Exception) -> bool:
        """A call to `address` failed: a new session next time, if the failure
        says so (True)."""
        if isinstance(error, grpc.aio.AioRpcError) and error.code() in _SESSION_ENDING:
            await self._forget(address)
            return True
        return False

    async def forget(self, address: str) -> None:
        """End the session with `address`: the next call opens a new connection.
        For a peer gone silent: its old connection may be alive to gRPC but
        dead on the wire (a partition), and TCP, backing off its retransmits,
        would notice the network is back only many seconds after it is."""
        await self._forget(address)

    async def _forget(self, address: str) -> None:
        """New calls to `address` get a new session. The old one is retired, not
        closed: a call under way on it (a log stream just opened) may never
        return from a channel closed under it (seen with grpc.aio), so it is
        closed when the next one is retired, long after, or at shutdown."""
        session = self._sessions.pop(address, None)
        if session is None:
            return
        older = self._retired.pop(address, None)
        self._retired[address] = session
        if older is not None:
            with anyio.CancelScope(shield=True):
                await older.close()

    async def close(self) -> None:
        sessions = [*self._sessions.values(), *self._retired.values()]
        self._sessions.clear()
        self._retired.clear()
        with anyio.CancelScope(shield=True):
            for session in sessions:
                await session.close()


__all__ = ["CALL_ERRORS", "RPC_TIMEOUT_SECONDS", "Channels", "LinkError"]
