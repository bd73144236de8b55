"""The master re-places instances that lost a rank: a ring of runners cannot
heal itself (its group is gone), and a node that died takes its single-rank
instances with it, so the instance is deleted and its model placed again on the
nodes that are left, with the request it was placed with, if the model still
fits and fewer instances of it are left than its placement asked for (each
node started with `--model` serves its own, one asked for: one node's death
leaves the others serving; of a model placed with `replicas: N`, a lost
replica is placed again, on a node that serves none of them, as soon as one
can take it). A model no node can take now is recorded in the state
(`State.unplaced`): whichever node is master tries it again each round for
`WINDOW_SECONDS`, and every node answers its requests with a 503 meanwhile."""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from exo.shared.types.commands import PlaceInstance
from exo.shared.types.ids import ModelId, NodeId, new_instance_id
from exo.shared.types.state import Instance, Relocation, RunnerInfo, State, UnplacedModel

# At most this many re-placements of one model per window after a runner of it
# failed before serving (a model that fails on every placement must not loop).
MAX_REPLACEMENTS = 3
# How long a lost model no node can take is tried again, and the guard's window.
WINDOW_SECONDS = 600.0
# How long a model the master stopped placing again is shown as such.
GAVE_UP_SHOWN_SECONDS = 3600.0


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


def failed_before_serving(state: State, instance: Instance) -> RunnerInfo | None:
    """A failed rank's runner of `instance` that was never ready: its failure
    may be the model's own (it cannot load there), unlike a rank lost to a
    node's death or to a peer's."""
    runners = state.runners.get(instance.instance_id, {})
    return next(
        (
            runner
            for runner in runners.values()
            if runner.status in ("failed", "stopped") and not runner.served
        ),
        None,
    )


@dataclass
class Recovery:
    """The master's guard against a model that fails on every placement: it is
    placed again at most `MAX_REPLACEMENTS` times in `WINDOW_SECONDS` after a
    runner of it failed before it ever served. A lost node, or a runner that had
    served, says nothing about the model: those are always placed again."""

    _history: dict[ModelId, list[float]] = field(default_factory=dict)

    def may_place_again(self, model_id: ModelId, failed_before_serving: bool) -> bool:
        """Whether the model is placed again now (counted when it failed before
        serving)."""
        if not failed_before_serving:
            return True
        now = time.monotonic()
        recent = [t for t in self._history.get(model_id, []) if now - t < WINDOW_SECONDS]
        allowed = len(recent) < MAX_REPLACEMENTS
        if allowed:
            recent.append(now)
        self._history[model_id] = recent
        return allowed


def gave_up(runner: RunnerInfo) -> str:
    """Why a model is not placed again: its runners keep failing before they serve."""
    minutes = round(WINDOW_SECONDS / 60)
    last = f" (the last, on node {runner.node_id}: {runner.error})" if runner.error else ""
    return (
        f"its runners failed before serving {MAX_REPLACEMENTS} times in {minutes} minutes{last}; "
        "place it again once the cause is fixed"
    )


def waited_too_long(unplaced: UnplacedModel) -> str:
    minutes = round(WINDOW_SECONDS / 60)
    return (
        f"no node could take it for {minutes} minutes (the last reason: {unplaced.reason}); "
        "place it again when a node can"
    )
