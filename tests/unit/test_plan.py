import pytest

from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, NodeInfo, State
from exo.worker.plan import StartRunner, StopRunner, plan

ME, OTHER = NodeId("me"), NodeId("other")
M = ModelId("m")


def inst(i: str, node: NodeId) -> Instance:
    return Instance(instance_id=InstanceId(i), model_id=M, node_id=node)


def state(*instances: Instance) -> State:
    nodes = {
        n: NodeInfo(node_id=n, grpc_address=None, started_at_ms=0, last_seen_ms=0)
        for n in (ME, OTHER)
    }
    return State(nodes=nodes, instances={i.instance_id: i for i in instances})


@pytest.mark.parametrize(
    ("current", "running", "action"),
    [
        (state(), set(), None),
        (state(inst("a", ME)), set(), StartRunner(inst("a", ME))),
        (state(inst("a", ME)), {"a"}, None),
        (state(inst("a", OTHER)), set(), None),
        # Deleted: stop it.
        (state(), {"a"}, StopRunner(InstanceId("a"))),
        # Stops come before starts, so memory is freed first.
        (state(inst("b", ME)), {"a"}, StopRunner(InstanceId("a"))),
        # Stable order among starts.
        (state(inst("c", ME), inst("b", ME)), set(), StartRunner(inst("b", ME))),
        (state(inst("c", ME), inst("b", ME)), {"b"}, StartRunner(inst("c", ME))),
    ],
)
def test_plan(current: State, running: set[str], action: object) -> None:
    assert plan(ME, current, {InstanceId(r) for r in running}) == action


def test_stale_instances_from_before_a_restart_get_no_runner() -> None:
    current = state(inst("old", ME), inst("new", ME))
    assert plan(ME, current, set(), stale={InstanceId("old")}) == StartRunner(inst("new", ME))
    assert plan(ME, current, {InstanceId("new")}, stale={InstanceId("old")}) is None
