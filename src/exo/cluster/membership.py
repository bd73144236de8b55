"""Membership: who is in the cluster, and who is master.

Every heartbeat a node says `Hello` to every address it knows; a reply carries
the peer's facts and the peers it knows, so membership spreads by gossip (of
addresses only: a peer's id is the one its certificate names, and a reply that
states another is ignored). A peer silent for a peer timeout is dropped. From the live peers every node
elects the master on its own (`elect`: the same facts give the same master)
and reports a change to `on_master_changed`, which brings this node into or
out of office.
"""

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

import anyio
from loguru import logger

from exo.cluster.channels import CALL_ERRORS, RPC_TIMEOUT_SECONDS, Channels, LinkError
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.timing import LinkTiming
from exo.shared.election import Candidate, elect
from exo.shared.event_store import EventStore
from exo.shared.types.ids import NodeId


class _HelloFields(TypedDict):
    node_id: str
    address: str
    started_at_ms: int
    force_master: bool
    last_applied_idx: int
    master_id: str
    term: int


def master_to_keep(
    current: NodeId | None,
    claims: Mapping[NodeId, int],
    following: Mapping[NodeId, int],
    candidates: list[Candidate],
) -> NodeId | None:
    """The master to keep, from the nodes that claim to be master (`claims`:
    each one's term). None claiming: `current`, this node's. One: that one,
    even if this node followed another (a healed partition's losing master,
    which now follows the winner). Several (two clusters that met, a partition
    that healed): the one more nodes follow (`following`, itself included), so
    that the bigger side keeps its history and the fewest nodes set theirs
    aside (a lone node cut off elects itself in a newer term: the term alone
    would make the cluster take its history over everyone else's); then the
    newer term; then the election order."""
    if not claims:
        return current
    if len(claims) == 1:
        return next(iter(claims))
    ranks = {c.node_id: c for c in candidates}
    weight = {n: (following.get(n, 0), term) for n, term in claims.items() if n in ranks}
    top = max(weight.values(), default=None)
    return elect(ranks[n] for n, w in weight.items() if w == top)


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


class Membership:
    def __init__(
        self,
        store: EventStore,
        address: str,
        channels: Channels,
        static_peers: list[str],
        on_master_changed: Callable[[NodeId], Awaitable[None]],
        timing: LinkTiming,
        force_master: bool = False,
        discovering: bool = False,
        on_peer_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.node_id = store.node_id
        self.address = address
        self.force_master = force_master
        self.started_at_ms = int(time.time() * 1000)
        self.master_id: NodeId | None = None
        self._store = store  # read only: this node's index and term
        self._channels = channels
        self._on_master_changed = on_master_changed
        self._on_peer_lost = on_peer_lost
        self._timing = timing
        # mDNS may still find peers: the first election waits a peer timeout.
        self._discovering = discovering
        self._started_monotonic = time.monotonic()
        self._addresses: set[str] = set(static_peers) - {address}
        self._peers: dict[NodeId, PeerView] = {}
        # Addresses that failed the secret's challenge or stated another node's id.
        self._untrusted: set[str] = set()
        self._changed = anyio.Event()

    @property
    def changed(self) -> anyio.Event:
        """Set when the master changes (a fresh event after each change)."""
        return self._changed

    def add_peer_address(self, address: str) -> None:
        if address != self.address and address not in self._addresses:
            logger.info(f"peer address {address} discovered")
            self._addresses.add(address)

    def peers(self) -> list[PeerView]:
        return sorted(self._peers.values(), key=lambda p: p.node_id)

    def heard_ms(self) -> dict[NodeId, int]:
        """When each live peer was last heard (wall-clock ms): the master's
        liveness signal, which, unlike events, never grows the log."""
        now_wall, now_mono = time.time() * 1000, time.monotonic()
        return {
            p.node_id: int(now_wall - (now_mono - p.heard_at) * 1000) for p in self._peers.values()
        }

    def master_peer(self) -> PeerView | None:
        """The master, when it is another node that answers."""
        return self._peers.get(self.master_id) if self.master_id else None

    def most_advanced_peer(self) -> PeerView | None:
        return max(self._peers.values(), key=lambda p: p.last_applied_idx, default=None)

    def _hello_view(self) -> _HelloFields:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "started_at_ms": self.started_at_ms,
            "force_master": self.force_master,
            "last_applied_idx": self._store.next_idx - 1,
            "master_id": self.master_id or "",
            "term": self._store.state.master_term,
        }

    def answer(self, request: pb.HelloRequest) -> pb.HelloReply:
        """A peer's Hello: note its facts, answer with ours and the peers we know."""
        self._heard(request)
        peers = [pb.Peer(node_id=p.node_id, address=p.address) for p in self.peers()]
        return pb.HelloReply(**self._hello_view(), peers=peers)

    async def run(self) -> None:
        while True:
            async with anyio.create_task_group() as group:
                for address in list(self._addresses):
                    group.start_soon(self._hello, address)
            for address in self._drop_silent_peers():
                await self._channels.forget(address)  # reconnect afresh once it answers
            await self._elect()
            await anyio.sleep(self._timing.heartbeat_seconds)

    async def _hello(self, address: str, retry: bool = True) -> None:
        try:
            session = await self._channels.session(address)
            reply: pb.HelloReply = await session.stub.Hello(
                pb.HelloRequest(**self._hello_view()), timeout=RPC_TIMEOUT_SECONDS
            )
        except LinkError as error:
            if error.untrusted:
                self._warn_once(address, f"peer {address} is not of this cluster: {error}")
            if error.refused:  # its process is gone: no need to wait out the timeout
                self._drop(address, "its address refuses connections")
            return
        except CALL_ERRORS as error:
            if await self._channels.failed(address, error) and retry:
                await self._hello(address, retry=False)  # a fresh session at once: gone or back?
            return
        if reply.node_id != session.peer_id:
            self._warn_once(
                address,
                f"peer {address} is node {session.peer_id} (its certificate) but says it is "
                f"node {reply.node_id!r}; ignored",
            )
            return
        self._untrusted.discard(address)
        self._heard(reply)

    def _warn_once(self, address: str, warning: str) -> None:
        """Warn about an untrusted address once, until it answers rightly."""
        if address not in self._untrusted:
            self._untrusted.add(address)
            logger.warning(warning)

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

    def _drop_silent_peers(self) -> list[str]:
        """Drop the peers silent for a peer timeout; returns their addresses."""
        deadline = time.monotonic() - self._timing.peer_timeout_seconds
        dropped: list[str] = []
        for node_id, peer in list(self._peers.items()):
            if peer.heard_at < deadline:
                logger.warning(f"node {node_id} at {peer.address} stopped answering")
                del self._peers[node_id]
                dropped.append(peer.address)
                self._on_peer_lost()
        return dropped

    def _drop(self, address: str, why: str) -> None:
        for node_id, peer in list(self._peers.items()):
            if peer.address == address:
                logger.warning(f"node {node_id} at {address} is gone: {why}")
                del self._peers[node_id]
                self._on_peer_lost()

    async def _elect(self) -> None:
        if self.master_id is None and not self._settled():
            return
        master = elect(self._candidates(), incumbent=self._incumbent())
        if master == self.master_id or master is None:
            return
        logger.info(f"master is now {master} (was {self.master_id})")
        self.master_id = master
        self._changed.set()
        self._changed = anyio.Event()
        await self._on_master_changed(master)

    def _settled(self) -> bool:
        """Before a first election: every known peer answered, or a peer timeout
        passed (always waited when discovery may still find peers), so a node does
        not start a history of its own beside a cluster."""
        waited = time.monotonic() - self._started_monotonic
        if waited >= self._timing.peer_timeout_seconds:
            return True
        heard = {p.address for p in self._peers.values()}
        return not self._discovering and self._addresses <= heard

    def _incumbent(self) -> NodeId | None:
        """The master to keep (`master_to_keep`); when two nodes claim to be
        master, the other side follows the one kept and takes its history
        (setting its own aside)."""
        claims = {p.node_id: p.term for p in self._peers.values() if p.master_id == p.node_id}
        if self.master_id == self.node_id:
            claims[self.node_id] = self._store.state.master_term
        following = Counter(p.master_id for p in self._peers.values() if p.master_id)
        if self.master_id is not None:
            following[self.master_id] += 1
        return master_to_keep(self.master_id, claims, following, self._candidates())

    def _candidates(self) -> list[Candidate]:
        return [Candidate(self.node_id, self.started_at_ms, self.force_master)] + [
            Candidate(p.node_id, p.started_at_ms, p.force_master) for p in self._peers.values()
        ]
