import pytest

from exo.master.commands import CommandRejected, decide
from exo.shared.types.commands import CreateInstance, DeleteInstance
from exo.shared.types.events import InstanceCreated, InstanceDeleted
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, NodeInfo, State

A = NodeId("a")
M = ModelId("m")
EXISTING = Instance(instance_id=InstanceId("i1"), model_id=M, node_id=A)
STATE = State(
    nodes={A: NodeInfo(node_id=A, grpc_address=None, started_at_ms=0, last_seen_ms=0)},
    instances={EXISTING.instance_id: EXISTING},
)


def test_create_on_a_known_node() -> None:
    command = CreateInstance(instance_id=InstanceId("i2"), model_id=ModelId("other"), node_id=A)
    [event] = decide(STATE, command)
    assert event == InstanceCreated(
        instance=Instance(instance_id=InstanceId("i2"), model_id=ModelId("other"), node_id=A)
    )


def test_a_retried_create_is_a_no_op() -> None:
    assert decide(STATE, CreateInstance(instance_id=InstanceId("i1"), model_id=M, node_id=A)) == []


@pytest.mark.parametrize(
    ("command", "message", "not_found"),
    [
        (
            CreateInstance(instance_id=InstanceId("x"), model_id=M, node_id=NodeId("ghost")),
            "no node 'ghost'",
            True,
        ),
        (
            CreateInstance(instance_id=InstanceId("x"), model_id=M, node_id=A),
            "already serves m",
            False,
        ),
        (DeleteInstance(instance_id=InstanceId("nope")), "no instance 'nope'", True),
    ],
)
def test_rejections(
    command: CreateInstance | DeleteInstance, message: str, not_found: bool
) -> None:
    with pytest.raises(CommandRejected, match=message) as info:
        decide(STATE, command)
    assert info.value.not_found is not_found


def test_delete() -> None:
    assert decide(STATE, DeleteInstance(instance_id=InstanceId("i1"))) == [
        InstanceDeleted(instance_id=InstanceId("i1"))
    ]
