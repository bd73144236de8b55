"""Which node serves a model this node does not: pure, over the cluster state."""

from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import State

SERVING = ("ready", "running")


def remote_api_for(state: State, model_id: ModelId, self_id: NodeId) -> str | None:
    """The API address (host:port) of another node whose runner serves `model_id`,
    preferring an idle runner; None when there is none."""
    choices = []
    for instance_id, instance in sorted(state.instances.items()):
        node = state.nodes.get(instance.node_id)
        runner = state.runners.get(instance_id)
        if (
            instance.model_id != model_id
            or instance.node_id == self_id
            or node is None
            or node.api_address is None
            or runner is None
            or runner.status not in SERVING
        ):
            continue
        choices.append((runner.status != "ready", node.api_address))
    return min(choices)[1] if choices else None


def cluster_models(state: State) -> dict[ModelId, str]:
    """Every model some runner in the cluster serves, with the best runner status."""
    best: dict[ModelId, str] = {}
    for instance_id, instance in state.instances.items():
        runner = state.runners.get(instance_id)
        status = runner.status if runner else "starting"
        if best.get(instance.model_id) not in SERVING:
            best[instance.model_id] = status
    return best
