"""mDNS discovery: advertise this node and find the other nodes of its cluster on the LAN.

Every node registers one service of type `_exo-cluster._tcp.local.` whose port
is its gRPC port and whose TXT record carries its `node_id`, and nothing derived
from the cluster secret (a hash of it would let anyone on the LAN guess the
secret offline). Which cluster a node belongs to is settled when it is dialed:
the link's challenge (`exo.cluster.auth`) refuses a node of another cluster.

`MdnsDiscovery.run(on_peer)` registers, browses, and calls `on_peer` with a
`DiscoveredPeer` for every resolved exo node (never for itself),
again when a peer's address changes or after it left and came back; it runs
until cancelled and then says goodbye and closes within a bound. When mDNS
cannot work here (no multicast, no permission, no usable interface) it logs one
warning and returns: peers given statically (`--peers`) still work.

zeroconf runs on asyncio, so `run` needs anyio's asyncio backend (under trio it
logs the same warning and returns). The decisions (TXT properties, which
services are peers, which address to dial) are pure functions below.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import psutil
from anyio.streams.memory import MemoryObjectReceiveStream
from loguru import logger
from zeroconf import Error as ZeroconfError
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from exo.shared.types.ids import NodeId

SERVICE_TYPE = "_exo-cluster._tcp.local."
NODE_ID_PROPERTY = "node_id"

RESOLVE_TIMEOUT_S = 3.0
CLOSE_TIMEOUT_S = 3.0
# Browser notifications waiting to be resolved; beyond this they are dropped
# (the browser reports a service again when its records change).
PENDING_CHANGES = 1024

# A DNS label is at most 63 bytes; keep the instance label well under it.
_MAX_READABLE_NODE_ID = 40
_UNSAFE_LABEL_CHARS = re.compile(r"[^a-z0-9-]")


@dataclass(frozen=True, slots=True)
class DiscoveredPeer:
    """An exo node found on the LAN (of this cluster or not: dialing tells): its
    id and its gRPC address "host:port"."""

    node_id: NodeId
    address: str


def service_label(node_id: NodeId) -> str:
    """The DNS label naming this node's service and host: `exo-<node id>`.

    A node id that is not already a short lowercase DNS label is sanitized and
    truncated, and a digest of the full id is appended so that labels stay unique.
    """
    safe = _UNSAFE_LABEL_CHARS.sub("-", node_id.lower())
    if safe == node_id and 0 < len(node_id) <= _MAX_READABLE_NODE_ID:
        return f"exo-{node_id}"
    digest = hashlib.sha256(node_id.encode("utf-8")).hexdigest()[:10]
    return f"exo-{safe[:_MAX_READABLE_NODE_ID]}-{digest}"


def service_name(node_id: NodeId) -> str:
    """The full mDNS service instance name of a node."""
    return f"{service_label(node_id)}.{SERVICE_TYPE}"


def advertised_properties(node_id: NodeId) -> dict[str, str]:
    """The TXT properties a node publishes."""
    return {NODE_ID_PROPERTY: node_id}


def parse_properties(properties: Mapping[bytes, bytes | None]) -> NodeId | None:
    """The node id from a TXT record, or None if it is not an exo node's."""
    raw_node_id = properties.get(NODE_ID_PROPERTY.encode())
    if raw_node_id is None:
        return None
    try:
        node_id = raw_node_id.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return NodeId(node_id) if node_id else None


def usable_ipv4_addresses(addresses: Iterable[str]) -> list[str]:
    """The IPv4 dotted addresses among `addresses` that a peer can dial, in order, deduplicated.

    Drops IPv6, link-local (169.254/16), unspecified, multicast, broadcast and
    anything that does not parse.
    """
    usable: list[str] = []
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if not isinstance(address, ipaddress.IPv4Address):
            continue
        if (
            address.is_link_local
            or address.is_unspecified
            or address.is_multicast
            or address == ipaddress.IPv4Address("255.255.255.255")
        ):
            continue
        dotted = str(address)
        if dotted not in usable:
            usable.append(dotted)
    return usable


def select_address(addresses: Iterable[str]) -> str | None:
    """The address to dial a peer at: its first usable non-loopback IPv4, else a loopback one."""
    usable = usable_ipv4_addresses(addresses)
    for address in usable:
        if not ipaddress.IPv4Address(address).is_loopback:
            return address
    return usable[0] if usable else None


def peer_from_service(
    own_node_id: NodeId,
    properties: Mapping[bytes, bytes | None],
    addresses: Iterable[str],
    port: int | None,
) -> DiscoveredPeer | None:
    """The peer a resolved service describes, or None: not an exo node, us, or undialable."""
    node_id = parse_properties(properties)
    if node_id is None or node_id == own_node_id:
        return None
    if port is None or not 0 < port < 65536:
        return None
    host = select_address(addresses)
    if host is None:
        return None
    return DiscoveredPeer(node_id=node_id, address=f"{host}:{port}")


def default_advertised_addresses() -> list[str]:
    """This machine's dialable IPv4 addresses other than loopback; loopback if it has none."""
    candidates = [
        address.address
        for interface_addresses in psutil.net_if_addrs().values()
        for address in interface_addresses
        if address.family == socket.AF_INET
    ]
    lan = [a for a in usable_ipv4_addresses(candidates) if not ipaddress.IPv4Address(a).is_loopback]
    return lan or ["127.0.0.1"]


class MdnsDiscovery:
    """Advertises this node over mDNS and reports the exo nodes it finds.

    `addresses`: the IPv4 addresses to advertise, which are also the only
    interfaces mDNS runs on (e.g. `["127.0.0.1"]` in tests). By default mDNS
    runs on every IPv4 interface and advertises this machine's non-loopback
    IPv4 addresses.
    """

    def __init__(
        self,
        node_id: NodeId,
        grpc_port: int,
        addresses: Sequence[str] | None = None,
        *,
        resolve_timeout_s: float = RESOLVE_TIMEOUT_S,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        if not 0 < grpc_port < 65536:
            raise ValueError(f"grpc_port must be in 1..65535, got {grpc_port}")
        if addresses is not None:
            usable = usable_ipv4_addresses(addresses)
            if not usable or len(usable) != len(addresses):
                raise ValueError(
                    f"addresses must be distinct IPv4 addresses that are not link-local, got {list(addresses)}"
                )
        self.node_id = node_id
        self.grpc_port = grpc_port
        self.addresses: list[str] | None = None if addresses is None else list(addresses)
        self.resolve_timeout_s = resolve_timeout_s
        self.close_timeout_s = close_timeout_s
        self._warned = False

    async def run(self, on_peer: Callable[[DiscoveredPeer], None]) -> None:
        """Advertise, browse and report peers until cancelled; return early if mDNS cannot work."""
        interfaces: list[str] | InterfaceChoice = (
            InterfaceChoice.All if self.addresses is None else list(self.addresses)
        )
        try:
            advertised = self.addresses or default_advertised_addresses()
            aiozc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        except (OSError, RuntimeError, ZeroconfError) as error:
            self._warn_unavailable(error)
            return
        try:
            await self._serve(aiozc, advertised, on_peer)
        finally:
            await self._close(aiozc)

    async def _serve(
        self,
        aiozc: AsyncZeroconf,
        advertised: list[str],
        on_peer: Callable[[DiscoveredPeer], None],
    ) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[str, ServiceStateChange]](
            max_buffer_size=PENDING_CHANGES
        )

        def on_change(
            zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
        ) -> None:
            # Called by zeroconf on the event loop; resolution happens in our task group.
            try:
                send.send_nowait((name, state_change))
            except anyio.WouldBlock:
                logger.debug("mDNS: too many pending service changes, dropped {}", name)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._report_peers, aiozc, receive, on_peer)
            try:
                browser = AsyncServiceBrowser(aiozc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
            except (OSError, ZeroconfError) as error:
                self._warn_unavailable(error)
                send.close()  # ends _report_peers
                return
            try:
                if not await self._register(aiozc, advertised):
                    tg.cancel_scope.cancel()
                    return
                await anyio.sleep_forever()
            finally:
                with anyio.move_on_after(self.close_timeout_s, shield=True):
                    await browser.async_cancel()
                send.close()  # ends _report_peers once its resolutions are done

    async def _register(self, aiozc: AsyncZeroconf, advertised: list[str]) -> bool:
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            service_name(self.node_id),
            port=self.grpc_port,
            properties=advertised_properties(self.node_id),
            server=f"{service_label(self.node_id)}.local.",
            parsed_addresses=advertised,
        )
        try:
            announced = await aiozc.async_register_service(info, allow_name_change=True)
            await announced
        except (OSError, ZeroconfError) as error:
            self._warn_unavailable(error)
            return False
        if info.name != service_name(self.node_id):
            logger.warning(
                "mDNS: another service already uses the name of node {}; advertising as {}",
                self.node_id,
                info.name,
            )
        logger.info(
            "mDNS: advertising node {} at {} port {}",
            self.node_id,
            ", ".join(advertised),
            self.grpc_port,
        )
        return True

    async def _report_peers(
        self,
        aiozc: AsyncZeroconf,
        changes: MemoryObjectReceiveStream[tuple[str, ServiceStateChange]],
        on_peer: Callable[[DiscoveredPeer], None],
    ) -> None:
        own_name = service_name(self.node_id)
        reported: dict[str, DiscoveredPeer] = {}  # service name -> last peer reported for it
        resolving: set[str] = set()
        async with changes, anyio.create_task_group() as tg:
            async for name, change in changes:
                if change is ServiceStateChange.Removed:
                    reported.pop(name, None)
                elif name not in resolving and name != own_name:
                    resolving.add(name)
                    tg.start_soon(
                        self._resolve_and_report, aiozc, name, reported, resolving, on_peer
                    )

    async def _resolve_and_report(
        self,
        aiozc: AsyncZeroconf,
        name: str,
        reported: dict[str, DiscoveredPeer],
        resolving: set[str],
        on_peer: Callable[[DiscoveredPeer], None],
    ) -> None:
        try:
            peer = await self._resolve(aiozc, name)
        finally:
            resolving.discard(name)
        if peer is None or reported.get(name) == peer:
            return
        reported[name] = peer
        logger.info("mDNS: found node {} at {}", peer.node_id, peer.address)
        on_peer(peer)

    async def _resolve(self, aiozc: AsyncZeroconf, name: str) -> DiscoveredPeer | None:
        found = False
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            # zeroconf bounds the request itself; the cancel scope is a backstop.
            with anyio.move_on_after(self.resolve_timeout_s + 1.0):
                found = await info.async_request(aiozc.zeroconf, self.resolve_timeout_s * 1000)
        except (OSError, ZeroconfError) as error:
            logger.debug("mDNS: resolving {} failed: {}", name, error)
            return None
        if not found:
            logger.debug("mDNS: {} did not resolve within {} s", name, self.resolve_timeout_s)
            return None
        peer = peer_from_service(
            self.node_id,
            info.properties,
            info.parsed_addresses(IPVersion.V4Only),
            info.port,
        )
        if peer is None:
            logger.debug("mDNS: ignoring {} (us, not exo, or no usable address)", name)
        return peer

    async def _close(self, aiozc: AsyncZeroconf) -> None:
        """Say goodbye and close, each step bounded, even while being cancelled."""
        with anyio.move_on_after(self.close_timeout_s, shield=True) as scope:
            await aiozc.async_unregister_all_services()
        if scope.cancelled_caught:
            logger.warning("mDNS: unregistering took over {} s, gave up", self.close_timeout_s)
        with anyio.move_on_after(self.close_timeout_s, shield=True) as scope:
            await aiozc.async_close()
        if scope.cancelled_caught:
            logger.warning("mDNS: closing took over {} s, gave up", self.close_timeout_s)

    def _warn_unavailable(self, error: BaseException) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "mDNS discovery is unavailable ({}: {}); peers given with --peers still work",
            type(error).__name__,
            error,
        )


__all__ = [
    "NODE_ID_PROPERTY",
    "SERVICE_TYPE",
    "DiscoveredPeer",
    "MdnsDiscovery",
    "advertised_properties",
    "default_advertised_addresses",
    "parse_properties",
    "peer_from_service",
    "select_address",
    "service_label",
    "service_name",
    "usable_ipv4_addresses",
]
