"""mDNS discovery: the pure decisions table-driven, then real zeroconf on loopback."""

import ipaddress
import socket
import time
from collections.abc import Iterator

import anyio
import pytest
from anyio.abc import TaskGroup
from loguru import logger
from zeroconf.asyncio import AsyncServiceInfo

from exo.cluster.discovery import (
    CLOSE_TIMEOUT_S,
    SERVICE_TYPE,
    DiscoveredPeer,
    MdnsDiscovery,
    advertised_properties,
    default_advertised_addresses,
    parse_properties,
    peer_from_service,
    select_address,
    service_label,
    service_name,
    usable_ipv4_addresses,
)
from exo.shared.types.ids import NodeId

LOOPBACK = "127.0.0.1"
# How long the test waits for two nodes to find each other, and the bound it asserts:
# ~1.2 s on loopback (zeroconf probes a name ~1 s before announcing it); the wait is
# longer so that a slow machine fails on the assertion, with the time it took.
FIND_TIMEOUT_S = 10.0
FOUND_WITHIN_S = 5.0
SETTLE_S = 1.0
# TEST-NET-3 (RFC 5737): never an address of this machine, so joining mDNS on it fails.
NOT_OUR_ADDRESS = "203.0.113.77"


def _loopback_multicast_works() -> bool:
    """Whether a multicast datagram sent on loopback comes back (an admin-scoped group, TTL 0)."""
    group = "239.255.77.77"
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        receiver.bind(("", 0))
        port = receiver.getsockname()[1]
        membership = socket.inet_aton(group) + socket.inet_aton(LOOPBACK)
        receiver.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
        receiver.settimeout(1.0)
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(LOOPBACK))
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        sender.sendto(b"exo-probe", (group, port))
        return receiver.recv(64) == b"exo-probe"
    except OSError:
        return False
    finally:
        receiver.close()
        sender.close()


LOOPBACK_MULTICAST = _loopback_multicast_works()
needs_multicast = pytest.mark.skipif(
    not LOOPBACK_MULTICAST,
    reason="multicast on loopback does not work in this environment (probe datagram not received)",
)


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(sink)


# --- pure parts --------------------------------------------------------------


@pytest.mark.parametrize(
    ("node_id", "expected"),
    [
        ("node-a", "exo-node-a"),
        ("0123456789abcdef0123456789abcdef", "exo-0123456789abcdef0123456789abcdef"),
    ],
)
def test_service_label_keeps_simple_ids_readable(node_id: str, expected: str) -> None:
    assert service_label(NodeId(node_id)) == expected


@pytest.mark.parametrize(
    "node_id",
    ["Node_A", "node.a", "nöde a", "x" * 200, "", "a-b-" + "0" * 50],
)
def test_service_label_sanitizes_and_stays_a_dns_label(node_id: str) -> None:
    label = service_label(NodeId(node_id))
    assert label.startswith("exo-")
    assert len(label.encode()) <= 63
    assert all(c.isascii() and (c.isalnum() or c == "-") for c in label)
    assert label == label.lower()
    # zeroconf accepts the name (it raises BadTypeInNameException otherwise)
    info = AsyncServiceInfo(SERVICE_TYPE, service_name(NodeId(node_id)), port=1)
    assert info.name.endswith(SERVICE_TYPE)


def test_service_labels_of_distinct_ids_are_distinct() -> None:
    ids = ["a-b", "a_b", "A-B", "a.b", "x" * 100, "x" * 101, "exo-a-b"]
    labels = {service_label(NodeId(i)) for i in ids}
    assert len(labels) == len(ids)


def test_advertised_properties_round_trip_and_carry_nothing_of_the_secret() -> None:
    props = advertised_properties(NodeId("node-a"))
    assert props == {"node_id": "node-a"}  # no secret fingerprint to guess from offline
    raw = {k.encode(): v.encode() for k, v in props.items()}
    assert parse_properties(raw) == NodeId("node-a")


@pytest.mark.parametrize(
    ("properties", "expected"),
    [
        ({b"node_id": b"n1"}, "n1"),
        ({b"node_id": b"n1", b"cluster": b"fp"}, "n1"),  # an older node's record
        ({b"node_id": b"n1", b"extra": None}, "n1"),
        ({b"cluster": b"fp"}, None),
        ({b"node_id": None}, None),
        ({b"node_id": b""}, None),
        ({b"node_id": b"\xff\xfe"}, None),
        ({}, None),
    ],
)
def test_parse_properties(properties: dict[bytes, bytes | None], expected: str | None) -> None:
    assert parse_properties(properties) == expected


@pytest.mark.parametrize(
    ("addresses", "usable", "selected"),
    [
        (["192.168.1.10"], ["192.168.1.10"], "192.168.1.10"),
        (["127.0.0.1"], ["127.0.0.1"], "127.0.0.1"),
        (["127.0.0.1", "10.0.0.5"], ["127.0.0.1", "10.0.0.5"], "10.0.0.5"),
        (["169.254.3.4", "192.168.1.10"], ["192.168.1.10"], "192.168.1.10"),
        (["169.254.3.4"], [], None),
        (["fe80::1", "::1", "fd00::2"], [], None),
        (["fd00::2", "192.168.1.10"], ["192.168.1.10"], "192.168.1.10"),
        (["0.0.0.0", "224.0.0.251", "255.255.255.255"], [], None),
        (["not an address", "", "10.0.0.5"], ["10.0.0.5"], "10.0.0.5"),
        (["10.0.0.5", "10.0.0.5", "10.0.0.6"], ["10.0.0.5", "10.0.0.6"], "10.0.0.5"),
        ([], [], None),
    ],
)
def test_address_selection(addresses: list[str], usable: list[str], selected: str | None) -> None:
    assert usable_ipv4_addresses(addresses) == usable
    assert select_address(addresses) == selected


ME = NodeId("me")
OURS = {b"node_id": b"peer"}


@pytest.mark.parametrize(
    ("properties", "addresses", "port", "expected"),
    [
        (OURS, ["192.168.1.7"], 52414, DiscoveredPeer(NodeId("peer"), "192.168.1.7:52414")),
        (
            OURS,
            ["169.254.1.1", "127.0.0.1"],
            5000,
            DiscoveredPeer(NodeId("peer"), "127.0.0.1:5000"),
        ),
        ({b"node_id": b"me"}, ["192.168.1.7"], 52414, None),
        ({b"cluster": b"fp"}, ["192.168.1.7"], 52414, None),
        (OURS, ["169.254.1.1", "fe80::1"], 52414, None),
        (OURS, [], 52414, None),
        (OURS, ["192.168.1.7"], None, None),
        (OURS, ["192.168.1.7"], 0, None),
    ],
)
def test_peer_from_service(
    properties: dict[bytes, bytes | None],
    addresses: list[str],
    port: int | None,
    expected: DiscoveredPeer | None,
) -> None:
    assert peer_from_service(ME, properties, addresses, port) == expected


def test_default_advertised_addresses_are_dialable_ipv4() -> None:
    addresses = default_advertised_addresses()
    assert addresses
    for address in addresses:
        parsed = ipaddress.ip_address(address)
        assert isinstance(parsed, ipaddress.IPv4Address)
        assert not parsed.is_link_local
    assert addresses == [LOOPBACK] or not any(
        ipaddress.ip_address(a).is_loopback for a in addresses
    )


@pytest.mark.parametrize(
    ("port", "addresses"),
    [(0, None), (70000, None), (5000, []), (5000, ["::1"]), (5000, ["169.254.1.1"]), (5000, ["x"])],
)
def test_constructor_rejects_bad_arguments(port: int, addresses: list[str] | None) -> None:
    with pytest.raises(ValueError):
        MdnsDiscovery(NodeId("n"), port, addresses)


# --- real zeroconf -----------------------------------------------------------


async def test_unusable_interface_warns_once_and_returns(warnings: list[str]) -> None:
    discovery = MdnsDiscovery(NodeId("n"), 5000, [NOT_OUR_ADDRESS])
    found: list[DiscoveredPeer] = []
    with anyio.fail_after(5):
        await discovery.run(found.append)
    assert found == []
    assert len(warnings) == 1
    assert "mDNS discovery is unavailable" in warnings[0]
    assert "--peers" in warnings[0]


class Node:
    """One `MdnsDiscovery` on loopback and the peers it reported."""

    def __init__(self, node_id: str, port: int) -> None:
        self.discovery = MdnsDiscovery(NodeId(node_id), port, [LOOPBACK])
        self.found: list[DiscoveredPeer] = []
        self.scope = anyio.CancelScope()

    def start(self, tg: TaskGroup) -> None:
        async def run() -> None:
            with self.scope:
                await self.discovery.run(self.found.append)

        tg.start_soon(run)

    def saw(self, node_id: str) -> bool:
        return any(p.node_id == node_id for p in self.found)


@needs_multicast
async def test_nodes_find_each_other_on_loopback(warnings: list[str]) -> None:
    a = Node("node-a", 41001)
    b = Node("node-b", 41002)
    started = closing = time.monotonic()
    found_after_s = float("inf")
    async with anyio.create_task_group() as tg:
        for node in (a, b):
            node.start(tg)

        with anyio.fail_after(FIND_TIMEOUT_S):
            while not (a.saw("node-b") and b.saw("node-a")):
                await anyio.sleep(0.05)
        found_after_s = time.monotonic() - started
        await anyio.sleep(SETTLE_S)  # give late reports a moment to show up

        assert a.found == [DiscoveredPeer(NodeId("node-b"), f"{LOOPBACK}:41002")]
        assert b.found == [DiscoveredPeer(NodeId("node-a"), f"{LOOPBACK}:41001")]

        # b restarts on another port: a reports it again with its new address
        b.scope.cancel()
        b2 = Node("node-b", 41012)
        b2.start(tg)
        with anyio.fail_after(FIND_TIMEOUT_S):
            while len(a.found) < 2:
                await anyio.sleep(0.05)
        assert a.found[1] == DiscoveredPeer(NodeId("node-b"), f"{LOOPBACK}:41012")

        # cancellation unregisters and closes within a bound
        closing = time.monotonic()
        tg.cancel_scope.cancel()
    closed_after_s = time.monotonic() - closing
    logger.info(
        "mDNS on loopback: found after {:.2f} s, closed in {:.2f} s", found_after_s, closed_after_s
    )
    # ~0.25 s; each of its two steps (unregister, close) gives up after CLOSE_TIMEOUT_S.
    assert closed_after_s < CLOSE_TIMEOUT_S, f"closed in {closed_after_s:.2f} s"
    assert found_after_s < FOUND_WITHIN_S, f"found after {found_after_s:.2f} s"
    assert warnings == []
