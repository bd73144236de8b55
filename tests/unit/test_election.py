import pytest

from exo.cluster.membership import master_to_keep
from exo.shared.election import Candidate, elect
from exo.shared.types.ids import NodeId

OLD = Candidate(NodeId("b-old"), started_at_ms=100)
OLD_TWIN = Candidate(NodeId("a-twin"), started_at_ms=100)
YOUNG = Candidate(NodeId("c-young"), started_at_ms=500)
FORCED = Candidate(NodeId("z-forced"), started_at_ms=900, force_master=True)
FORCED_OLDER = Candidate(NodeId("y-forced"), started_at_ms=800, force_master=True)


@pytest.mark.parametrize(
    ("candidates", "incumbent", "master"),
    [
        ([], None, None),
        ([YOUNG], None, "c-young"),
        # Seniority, then node id.
        ([YOUNG, OLD], None, "b-old"),
        ([OLD, OLD_TWIN, YOUNG], None, "a-twin"),
        # --force-master beats seniority; between two forced nodes, seniority.
        ([OLD, FORCED], None, "z-forced"),
        ([FORCED, FORCED_OLDER, OLD], None, "y-forced"),
        # The incumbent stays while alive: a more senior node rejoining does not flap.
        ([OLD, YOUNG], NodeId("c-young"), "c-young"),
        # ... unless a forced node is there and the incumbent is not forced.
        ([YOUNG, FORCED], NodeId("c-young"), "z-forced"),
        ([FORCED, FORCED_OLDER], NodeId("z-forced"), "z-forced"),
        # A dead incumbent: the best of the living.
        ([YOUNG, OLD], NodeId("gone"), "b-old"),
    ],
)
def test_elect(candidates: list[Candidate], incumbent: NodeId | None, master: str | None) -> None:
    assert elect(candidates, incumbent) == master
    assert elect(list(reversed(candidates)), incumbent) == master  # order never matters


# Who claims to be master (term each), who follows whom (nodes each), and the
# master kept by a node that followed "b-old".
@pytest.mark.parametrize(
    ("claims", "following", "kept"),
    [
        # None claims (yet): the one this node follows.
        ({}, {}, "b-old"),
        # One claims: that one, even if this node followed another (the losing
        # master of a healed partition, which now follows the winner).
        ({YOUNG.node_id: 2}, {YOUNG.node_id: 3}, "c-young"),
        # A lone node cut off elected itself in a newer term; the two others kept
        # theirs: the bigger side's master stays, the lone node takes its history.
        ({YOUNG.node_id: 3, OLD.node_id: 2}, {YOUNG.node_id: 1, OLD.node_id: 2}, "b-old"),
        # Halves of two: the newer term...
        ({YOUNG.node_id: 3, OLD.node_id: 2}, {YOUNG.node_id: 2, OLD.node_id: 2}, "c-young"),
        # ... then the election order.
        ({YOUNG.node_id: 2, OLD.node_id: 2}, {YOUNG.node_id: 2, OLD.node_id: 2}, "b-old"),
        # A claimant that is no candidate (no longer heard) is not kept.
        ({NodeId("gone"): 9, YOUNG.node_id: 1}, {NodeId("gone"): 5}, "c-young"),
    ],
)
def test_the_master_more_nodes_follow_is_kept(
    claims: dict[NodeId, int], following: dict[NodeId, int], kept: str
) -> None:
    assert master_to_keep(OLD.node_id, claims, following, [OLD, YOUNG]) == kept
