"""The master re-places instances that lost a rank: a ring of runners cannot
heal itself (its group is gone), so the instance is deleted and placed again
on the nodes that are left, with the request it was placed with, if the model
still fits."""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from exo.shared.types.commands import Command, DeleteInstance, PlaceInstance
from exo.shared.types.ids import ModelId, NodeId, new_instance_id
from exo.shared.types.state import Instance, State

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
    """Multi-rank instances with a rank on one of `nodes`."""
    gone = set(nodes)
    return [
        i for _, i in sorted(state.instances.items()) if len(i.ranks) > 1 and gone & set(i.node_ids)
    ]


def replacement(instance: Instance, available_nodes: int) -> PlaceInstance:
    """The placement of `instance`'s model again: its request's `min_nodes` and
    `max_nodes`, `min_nodes` lowered to the nodes that are left when fewer are."""
    return PlaceInstance(
        instance_id=new_instance_id(),
        model_id=instance.model_id,
        min_nodes=max(1, min(instance.min_nodes, available_nodes)),
        max_nodes=instance.max_nodes,
    )


@dataclass
class Recovery:
    _history: dict[ModelId, list[float]] = field(default_factory=dict)

    def commands(
        self, instance: Instance, still_listed: bool, available_nodes: int
    ) -> list[Command]:
        """Delete `instance` (when the state still lists it) and place its model
        again on `available_nodes` nodes at most, unless it was re-placed too
        often lately."""
        now = time.monotonic()
        recent = [t for t in self._history.get(instance.model_id, []) if now - t < WINDOW_SECONDS]
        commands: list[Command] = (
            [DeleteInstance(instance_id=instance.instance_id)] if still_listed else []
        )
        if len(recent) < MAX_REPLACEMENTS:
            recent.append(now)
            commands.append(replacement(instance, available_nodes))
        self._history[instance.model_id] = recent
        return commands
