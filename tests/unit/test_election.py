import pytest

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
