"""A private LAN of network namespaces for tests that run real nodes as on
separate machines: one namespace per node, a veth from each to one bridge,
private IPv4 addresses, multicast (real mDNS) between them. `cut` partitions
the LAN (nodes on one side stop hearing those on the other, as when a switch
between them fails: packets are lost, not refused), `heal` joins it again;
the test process reaches every node throughout.

Needs Linux, root and `ip` (CI runs as root); `NetnsLan.create` raises `NetnsUnavailable`
with the reason where it cannot be built, and everything it made is removed on
`close()`, whatever state it reached."""

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

# A locally administered MAC that no interface has: where `cut` sends packets.
NOWHERE_MAC = "02:00:00:00:de:ad"


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


@dataclass
class NetnsLan:
    """`count` namespaces on the bridge; host i is `addresses[i]`; the test
    process (root namespace) reaches them through the bridge's `gateway`."""

    tag: str  # short and unique to this test run: names of links and namespaces
    subnet: str  # "10.a.b", a /24
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    _bridge_up: bool = False
    # (namespace index, address) of every neighbour entry `cut` made.
    _cuts: set[tuple[int, str]] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @classmethod
    def create(cls, count: int, tag: str | None = None) -> "NetnsLan":
        if not sys.platform.startswith("linux"):
            raise NetnsUnavailable(f"network namespaces are Linux's (this is {sys.platform})")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        pid = os.getpid()
        lan = cls(tag=tag or f"xc{pid % 100000}", subnet=f"10.{200 + pid % 50}.{pid // 50 % 250}")
        try:
            lan._build(count)
        except BaseException:
            lan.close()
            raise
        return lan

    def _build(self, count: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_up = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(count):
            namespace = f"{self.tag}n{i}"
            _ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            host_end = f"{self.tag}v{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            address = f"{self.subnet}.{10 + i}"
            inside = ("netns", "exec", namespace, "ip")
            _ip(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "route", "add", "default", "via", self.gateway)
            self.addresses.append(address)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside namespace `i`."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def cut(self, side: Sequence[int], other: Sequence[int] | None = None) -> None:
        """Nodes `side` and nodes `other` (default: all the rest) stop hearing
        each other, both ways, while both still reach the bridge's gateway (the
        test process). Each names the other's address with a MAC no port has
        (a permanent neighbour entry): the bridge floods those frames and every
        host drops them, so packets vanish as on a dead link (TCP retransmits,
        nothing refuses; a blackhole route would fail `connect` at once)."""
        rest = [i for i in range(len(self.namespaces)) if i not in side] if other is None else other
        for a, b in ((a, b) for a in side for b in rest):
            for here, there in ((a, b), (b, a)):
                inside = ("netns", "exec", self.namespaces[here], "ip")
                address = self.addresses[there]
                _ip(*inside, "neigh", "replace", address, "lladdr", NOWHERE_MAC,
                    "nud", "permanent", "dev", "eth0")  # fmt: skip
                self._cuts.add((here, address))

    def heal(self) -> None:
        """Undo every `cut` (the addresses are resolved again, by ARP)."""
        for here, address in sorted(self._cuts):
            inside = ("netns", "exec", self.namespaces[here], "ip")
            _ip(*inside, "neigh", "del", address, "dev", "eth0", check=False)
        self._cuts.clear()

    def close(self) -> None:
        self._cuts.clear()  # the entries go with their namespaces
        for namespace in self.namespaces:  # takes its veth (and the host end) with it
            _ip("netns", "del", namespace, check=False)
        self.namespaces.clear()
        if self._bridge_up:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_up = False
