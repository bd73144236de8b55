"""Recovery of instances that lost a rank."""

from types import SimpleNamespace

import pytest

from exo.master import recovery
from exo.master.recovery import (
    MAX_REPLACEMENTS,
    WINDOW_SECONDS,
    Recovery,
    broken_instances,
    failed_before_serving,
    instances_on,
    replacement,
    still_served,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import Instance, InstanceRank, RunnerInfo, State

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")
M, N = ModelId("org/m"), ModelId("org/n")


def inst(i: str, *nodes: NodeId, model_id: ModelId = M) -> Instance:
    ranks = tuple(
        InstanceRank(node_id=n, start_layer=k, end_layer=k + 1) for k, n in enumerate(nodes)
    )
    return Instance(instance_id=InstanceId(i), model_id=model_id, ranks=ranks)


def state(*instances: tuple[Instance, dict[NodeId, RunnerStatus]]) -> State:
    return State(
        instances={i.instance_id: i for i, _ in instances},
        runners={
            i.instance_id: {
                n: RunnerInfo(instance_id=i.instance_id, node_id=n, status=s)
                for n, s in statuses.items()
            }
            for i, statuses in instances
        },
    )


SOLO = inst("solo", A)
PAIR = inst("pair", A, B)
TRIO = inst("trio", C, B, A)


@pytest.mark.parametrize(
    ("current", "broken"),
    [
        (state(), []),
        (state((PAIR, {A: "ready", B: "ready"})), []),
        (state((PAIR, {A: "running", B: "loading"})), []),
        (state((PAIR, {A: "ready"})), []),  # b still downloading
        (state((PAIR, {A: "ready", B: "failed"})), ["pair"]),
        (state((PAIR, {A: "stopped", B: "ready"})), ["pair"]),
        (state((PAIR, {B: "failed"})), ["pair"]),
        # a single rank's runner restarts itself
        (state((SOLO, {A: "failed"})), []),
        (state((SOLO, {A: "failed"}), (PAIR, {A: "ready", B: "ready"})), []),
        (
            state((SOLO, {A: "failed"}), (TRIO, {A: "failed"}), (PAIR, {A: "ready", B: "failed"})),
            ["pair", "trio"],
        ),
        (state((TRIO, {A: "ready", B: "ready", C: "loading"})), []),
    ],
)
def test_broken_instances(current: State, broken: list[str]) -> None:
    assert [i.instance_id for i in broken_instances(current)] == broken


TRIO_N = inst("trio", C, B, A, model_id=N)
ALL = state((SOLO, {}), (PAIR, {}), (TRIO_N, {}), (inst("bc", B, C), {}))


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([], []),
        ([A], ["pair", "solo", "trio"]),
        ([B], ["bc", "pair", "trio"]),
        ([C], ["bc", "trio"]),
        ([A, C], ["bc", "pair", "solo", "trio"]),
        ([NodeId("ghost")], []),
    ],
)
def test_instances_on(nodes: list[NodeId], expected: list[str]) -> None:
    assert [i.instance_id for i in instances_on(ALL, nodes)] == expected
    assert [i.instance_id for i in instances_on(ALL, iter(nodes))] == expected


@pytest.mark.parametrize(
    ("current", "damaged", "served"),
    [
        (state((SOLO, {})), [], False),
        (state((SOLO, {}), (PAIR, {})), [], True),  # same model elsewhere
        (state((SOLO, {}), (PAIR, {})), ["pair"], False),  # lost too
        (state((SOLO, {}), (PAIR, {A: "failed"})), [], False),  # failed: serves nothing
        (state((SOLO, {}), (TRIO_N, {})), [], False),  # another model
    ],
)
def test_still_served(current: State, damaged: list[str], served: bool) -> None:
    assert still_served(current, SOLO, damaged) is served


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(recovery, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


def test_replacement_places_the_model_again_under_a_new_id() -> None:
    place = replacement(PAIR, available_nodes=3)
    assert place.model_id == M and place.instance_id != PAIR.instance_id
    assert (place.min_nodes, place.max_nodes) == (1, None)


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "available", "expected"),
    [
        (1, None, 3, (1, None)),
        (2, None, 3, (2, None)),  # the request is kept
        (2, 2, 2, (2, 2)),
        (2, 3, 5, (2, 3)),
        (3, None, 2, (2, None)),  # fewer survivors: as many as are left
        (2, 2, 1, (1, 2)),
        (2, None, 0, (1, None)),  # none reported yet: the placement says why it fails
    ],
)
def test_a_replacement_keeps_the_request_where_the_survivors_allow(
    min_nodes: int, max_nodes: int | None, available: int, expected: tuple[int, int | None]
) -> None:
    placed = PAIR.model_copy(update={"min_nodes": min_nodes, "max_nodes": max_nodes})
    again = replacement(placed, available)
    assert (again.min_nodes, again.max_nodes) == expected
    assert again.model_id == M and again.instance_id != PAIR.instance_id
    assert again.sharding == "pipeline"


def test_a_replacement_asks_for_the_same_sharding() -> None:
    split = Instance(
        instance_id=InstanceId("t"),
        model_id=M,
        ranks=tuple(InstanceRank(node_id=n, start_layer=0, end_layer=4) for n in (A, B)),
        sharding="tensor",
    )
    assert replacement(split, available_nodes=2).sharding == "tensor"
    # One node left: still a tensor request, which placement refuses until a second is back.
    lone = replacement(split, available_nodes=1)
    assert (lone.min_nodes, lone.sharding) == (1, "tensor")


def test_a_model_failing_before_it_serves_is_placed_again_at_most_the_limit_within_the_window(
    clock: Clock,
) -> None:
    rec = Recovery()
    for _ in range(MAX_REPLACEMENTS):
        assert rec.may_place_again(M, failed_before_serving=True)
        clock.now += 1
    assert not rec.may_place_again(M, failed_before_serving=True)
    assert not rec.may_place_again(M, failed_before_serving=True)  # refusals are not counted
    # Lost nodes and runners that had served say nothing about the model: never limited.
    assert all(rec.may_place_again(M, failed_before_serving=False) for _ in range(10))
    assert rec.may_place_again(N, failed_before_serving=True)  # another model: its own budget
    # Once the first is older than the window, one more is allowed.
    clock.now = 1000.0 + WINDOW_SECONDS
    assert rec.may_place_again(M, failed_before_serving=True)
    assert not rec.may_place_again(M, failed_before_serving=True)
    clock.now += WINDOW_SECONDS  # all of them older than the window
    assert all(rec.may_place_again(M, failed_before_serving=True) for _ in range(MAX_REPLACEMENTS))
    assert not rec.may_place_again(M, failed_before_serving=True)


@pytest.mark.parametrize(
    ("runners", "failed_node"),
    [
        ({A: ("ready", True), B: ("failed", False)}, B),  # b never loaded
        ({A: ("failed", True), B: ("ready", True)}, None),  # a had served: a fault around it
        ({A: ("stopped", False), B: ("loading", False)}, A),
        ({A: ("loading", False)}, None),  # b not started: nothing failed
    ],
)
def test_failed_before_serving(
    runners: dict[NodeId, tuple[RunnerStatus, bool]], failed_node: NodeId | None
) -> None:
    current = State(
        instances={PAIR.instance_id: PAIR},
        runners={
            PAIR.instance_id: {
                n: RunnerInfo(instance_id=PAIR.instance_id, node_id=n, status=s, served=served)
                for n, (s, served) in runners.items()
            }
        },
    )
    failed = failed_before_serving(current, PAIR)
    assert (failed.node_id if failed else None) == failed_node


def replica(i: str, node: NodeId, of: int) -> Instance:
    return inst(i, node).model_copy(update={"replicas": of})


@pytest.mark.parametrize(
    ("others", "of", "served"),
    [
        (["r2"], 2, False),  # one of 2 left: the lost one is placed again
        (["r2", "r3"], 2, True),  # as many as asked for, another re-placed meanwhile
        (["r2", "r3"], 3, False),
        ([], 1, False),
    ],
)
def test_a_lost_replica_is_placed_again_while_fewer_than_its_placement_asked_for_serve(
    others: list[str], of: int, served: bool
) -> None:
    lost = replica("r1", A, of)
    ready: dict[NodeId, RunnerStatus] = {B: "ready"}
    current = state((lost, {}), *((replica(i, B, of), ready) for i in others))
    assert still_served(current, lost, []) is served
    # Its replacement asks for as many: the next loss is judged alike.
    assert replacement(lost, 3).replicas == of
