"""The master re-places instances that lost a rank: a ring of runners cannot
heal itself (its group is gone), and a node that died takes its single-rank
instances with it, so the instance is deleted and its model placed again on the
nodes that are left, with the request it was placed with, if the model still
fits and fewer instances of it are left than its placement asked for (each
node started with `--model` serves its own, one asked for: one node's death
leaves the others serving; of a model placed with `replicas: N`, a lost
replica is placed again, on a node that serves none of them, as soon as one
can take it)."""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from exo.shared.types.commands import DeleteInstance, PlaceInstance
from exo.shared.types.ids import ModelId, NodeId, new_instance_id
from exo.shared.types.state import Instance, Relocation, State

# At most this many re-placements of one model per window (a model that fails
# on every placement must not loop).
MAX_REPLACEMENTS = 3
WINDOW_SECONDS = 600.0


def broken_instances(state: State) -> list[Instance]:
    """Multi-rank instances with a failed rank (single-rank runners restart themselves)."""
    return [
        instance
        for _, instance in sorted(state.instances.items())
        if len(instance.ranks) > 1 and state.instance_status(instance) == "failed"
    ]


def instances_on(state: State, nodes: Iterable[NodeId]) -> list[Instance]:
    """Instances with a rank on one of `nodes`."""
    gone = set(nodes)
    return [i for _, i in sorted(state.instances.items()) if gone & set(i.node_ids)]


def still_served(state: State, instance: Instance, damaged: Iterable[str]) -> bool:
    """Whether as many instances of `instance`'s model as its placement asked
    for are left, not failed, other than it and the `damaged` ones (so a lost
    replica of `replicas: 2` is placed again while one other serves)."""
    lost = {instance.instance_id, *damaged}
    left = sum(
        other.model_id == instance.model_id
        and other.instance_id not in lost
        and state.instance_status(other) != "failed"
        for other in state.instances.values()
    )
    return left >= instance.replicas


def replacement(
    instance: Instance, available_nodes: int, moved: Relocation | None = None
) -> PlaceInstance:
    """The placement of `instance`'s model again: its request's `min_nodes`,
    `max_nodes` and sharding, `min_nodes` lowered to the nodes that are left
    when fewer are (a tensor placement still needs two: refused until then)."""
    return PlaceInstance(
        instance_id=new_instance_id(),
        model_id=instance.model_id,
        min_nodes=max(1, min(instance.min_nodes, available_nodes)),
        max_nodes=instance.max_nodes,
        sharding=instance.sharding,
        moved=moved,
        replicas=instance.replicas,
    )


@dataclass
class Recovery:
    _history: dict[ModelId, list[float]] = field(default_factory=dict)
    # Models whose placement again found no room: (the lost instance, since when).
    _unplaced: dict[ModelId, tuple[Instance, float]] = field(default_factory=dict)

    def unplaced(self, instance: Instance) -> None:
        """Placing `instance`'s model again was refused (no node could take it):
        `retries` offers it again for a while, e.g. until its node is back."""
        self._unplaced.setdefault(instance.model_id, (instance, time.monotonic()))

    def placed(self, model_id: ModelId) -> None:
        self._unplaced.pop(model_id, None)

    def retries(self, state: State, available_nodes: int) -> list[PlaceInstance]:
        """The placements to try again: models refused within the window that no
        instance serves meanwhile."""
        now = time.monotonic()
        for model_id, (instance, since) in list(self._unplaced.items()):
            if now - since >= WINDOW_SECONDS or still_served(state, instance, ()):
                del self._unplaced[model_id]
        return [replacement(i, available_nodes) for i, _ in self._unplaced.values()]

    def commands(
        self,
        instance: Instance,
        still_listed: bool,
        available_nodes: int,
        served: bool = False,
        moved: Relocation | None = None,
    ) -> list[DeleteInstance | PlaceInstance]:
        """Delete `instance` (when the state still lists it) and place its model
        again on `available_nodes` nodes at most, unless another instance still
        `served` it or it was re-placed too often lately."""
        commands: list[DeleteInstance | PlaceInstance] = (
            [DeleteInstance(instance_id=instance.instance_id)] if still_listed else []
        )
        if served:
            return commands
        now = time.monotonic()
        recent = [t for t in self._history.get(instance.model_id, []) if now - t < WINDOW_SECONDS]
        if len(recent) < MAX_REPLACEMENTS:
            recent.append(now)
            commands.append(replacement(instance, available_nodes, moved))
        self._history[instance.model_id] = recent
        return commands
