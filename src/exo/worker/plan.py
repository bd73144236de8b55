"""`plan(node_id, state, running) -> next action`: pure. The worker calls it
after every event and carries the action out, until it says None."""

from collections.abc import Set
from dataclasses import dataclass

from exo.shared.types.ids import InstanceId, NodeId
from exo.shared.types.state import Instance, State


@dataclass(frozen=True)
class StartRunner:
    instance: Instance


@dataclass(frozen=True)
class StopRunner:
    instance_id: InstanceId


def plan(
    node_id: NodeId,
    state: State,
    running: Set[InstanceId],
    stale: Set[InstanceId] = frozenset(),
) -> StartRunner | StopRunner | None:
    """Stop runners whose instance is gone first (to free memory), then start
    runners for this node's instances, in a stable order. `stale` instances
    (left from before this node restarted, being deleted) get no runner."""
    for instance_id in sorted(running):
        instance = state.instances.get(instance_id)
        if instance is None or instance.node_id != node_id:
            return StopRunner(instance_id)
    for instance_id in sorted(state.instances):
        instance = state.instances[instance_id]
        if instance.node_id == node_id and instance_id not in running and instance_id not in stale:
            return StartRunner(instance)
    return None
