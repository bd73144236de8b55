"""Who is master: a deterministic choice every node computes the same way.

Order: a `--force-master` node wins; otherwise the incumbent stays while it is
alive (so a node that rejoins never causes flapping); otherwise the most senior
node (earliest start), ties broken by node id.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from exo.shared.types.ids import NodeId


@dataclass(frozen=True)
class Candidate:
    node_id: NodeId
    started_at_ms: int
    force_master: bool = False


def _rank(candidate: Candidate) -> tuple[bool, int, str]:
    return (not candidate.force_master, candidate.started_at_ms, candidate.node_id)


def elect(candidates: Iterable[Candidate], incumbent: NodeId | None = None) -> NodeId | None:
    """The master among the live `candidates`, or None when there are none."""
    alive = sorted(candidates, key=_rank)
    if not alive:
        return None
    best = alive[0]
    current = next((c for c in alive if c.node_id == incumbent), None)
    if current is not None and (current.force_master or not best.force_master):
        return current.node_id
    return best.node_id
