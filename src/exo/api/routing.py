"""Which node serves a model this node does not: pure, over the cluster state.

Requests go to an instance's first rank (the runner that takes tasks)."""

from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import State

SERVING = ("ready", "running")


def remote_api_for(state: State, model_id: ModelId, self_id: NodeId) -> str | None:
    """The API address (host:port) of another node whose instance of `model_id`
    serves, preferring an idle one; None when there is none."""
    choices = []
    for _, instance in sorted(state.instances.items()):
        first = instance.ranks[0].node_id
        node = state.nodes.get(first)
        status = state.instance_status(instance)
        if (
            instance.model_id != model_id
            or first == self_id
            or node is None
            or node.api_address is None
            or status not in SERVING
        ):
            continue
        choices.append((status != "ready", node.api_address))
    return min(choices)[1] if choices else None


def cluster_models(state: State) -> dict[ModelId, str]:
    """Every model some instance in the cluster serves, with the best status."""
    best: dict[ModelId, str] = {}
    for instance in state.instances.values():
        if best.get(instance.model_id) not in SERVING:
            best[instance.model_id] = state.instance_status(instance)
    return best
