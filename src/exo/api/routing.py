"""Which node serves a model this node does not: pure, over the cluster state.

Requests go to an instance's first rank (the runner that takes tasks)."""

from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import State

SERVING = ("ready", "running")
COMING = ("downloading", "starting", "loading")
# Which of a model's instances' statuses `cluster_models` reports: the most advanced.
_ADVANCE = {"failed": 0, "downloading": 1, "starting": 1, "loading": 1, "ready": 2, "running": 2}


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
    """Every model some instance in the cluster serves, with the best status
    (serving, then on its way, then failed)."""
    best: dict[ModelId, str] = {}
    for instance in state.instances.values():
        status = state.instance_status(instance)
        known = best.get(instance.model_id)
        if known is None or _ADVANCE[status] > _ADVANCE[known]:
            best[instance.model_id] = status
    return best


def coming_status(state: State, model_id: ModelId, self_id: NodeId) -> str | None:
    """How far an instance of `model_id` that is about to serve has got: still
    downloading, starting or loading, or ready with its first rank on this node a
    moment before this node's API serves it ("starting"); None when none is."""
    for _, instance in sorted(state.instances.items()):
        if instance.model_id != model_id:
            continue
        status = state.instance_status(instance)
        if status in COMING:
            return status
        if status in SERVING and instance.ranks[0].node_id == self_id:
            return "starting"
    return None
