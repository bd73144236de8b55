"""The clocks of the cluster link (heartbeats, timeouts)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkTiming:
    heartbeat_seconds: float = 1.0
    # A peer not heard from for this long is dropped from membership (and elections).
    peer_timeout_seconds: float = 5.0
    # The master times out a node whose events stopped for this long.
    node_timeout_seconds: float = 20.0
