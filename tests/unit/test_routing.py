"""Which status the API reports for a model, and when a request for a placed
model is worth retrying (503) rather than unknown (404): pure, over the state."""

import pytest

from exo.api.routing import cluster_models, coming_status
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import State
from tests.unit.test_apply import I1, I2, MODEL, A, B, inst, runner

Runs = dict[InstanceId, tuple[NodeId, RunnerStatus | None]]


def state_of(statuses: Runs) -> State:
    """Instances of MODEL by id: (the node of its one rank, its runner's status)."""
    instances = {i: inst(i, node) for i, (node, _) in statuses.items()}
    runners = {
        i: {node: runner(i, node, status)}
        for i, (node, status) in statuses.items()
        if status is not None
    }
    return State(instances=instances, runners=runners)


@pytest.mark.parametrize("order", [(I1, I2), (I2, I1)])
def test_the_most_advanced_instance_names_a_model_s_status(
    order: tuple[InstanceId, InstanceId],
) -> None:
    runs: Runs = {I1: (A, "failed"), I2: (B, "loading")}
    state = state_of({i: runs[i] for i in order})
    assert cluster_models(state) == {MODEL: "loading"}
    runs[I1] = (A, "running")
    assert cluster_models(state_of({i: runs[i] for i in order})) == {MODEL: "running"}


@pytest.mark.parametrize(
    ("status", "first_rank", "expected"),
    [
        (None, B, "downloading"),
        ("starting", B, "starting"),
        ("loading", B, "loading"),
        # Serving on this node, whose API does not serve it yet: a moment away.
        ("ready", A, "starting"),
        ("running", A, "starting"),
        # Serving elsewhere but not reachable from here, or failed: nothing to wait for.
        ("ready", B, None),
        ("failed", A, None),
        ("stopped", B, None),
    ],
)
def test_a_request_is_worth_retrying_only_for_an_instance_on_its_way(
    status: RunnerStatus | None, first_rank: NodeId, expected: str | None
) -> None:
    state = state_of({I1: (first_rank, status)})
    assert coming_status(state, MODEL, A) == expected
    assert coming_status(state, ModelId("org/other"), A) is None
