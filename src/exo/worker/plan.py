"""`plan(node_id, state, local) -> next action`: pure. The worker calls it after
every event and carries the action out, until it says None.

For each instance with a rank on this node: fetch the rank's files, then, once
every rank's node has its files, start the rank's runner (a ring of runners
only forms when all of them start). Runners and downloads nothing needs any
more are stopped first, to free memory and bandwidth.
"""

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from exo.models.weight_files import shard_files
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, State


@dataclass(frozen=True)
class LocalFacts:
    """What the worker knows that the state does not."""

    running: Set[InstanceId] = frozenset()  # instances with a runner here
    # Files complete here, by model (ahead of the state, which hears of them
    # only once the master has indexed this node's progress event).
    have_files: Mapping[ModelId, Set[str]] = field(default_factory=dict)
    downloading: Set[ModelId] = frozenset()  # models with a download task here
    cancelling: Set[ModelId] = frozenset()  # of those, the ones already told to stop
    # Instances whose download failed here: not retried for them (the state
    # shows the failure; deleting and placing again retries).
    download_failed: Set[InstanceId] = frozenset()
    # Instances left from before this node restarted, being deleted: no runner.
    stale: Set[InstanceId] = field(default_factory=frozenset)


@dataclass(frozen=True)
class StartDownload:
    model_id: ModelId
    files: frozenset[str] | None  # None: the model's card is unknown, fetch all
    instance_id: InstanceId


@dataclass(frozen=True)
class CancelDownload:
    model_id: ModelId


@dataclass(frozen=True)
class StartRunner:
    instance: Instance
    rank: int


@dataclass(frozen=True)
class StopRunner:
    instance_id: InstanceId


Action = StartDownload | CancelDownload | StartRunner | StopRunner


def stop_reason(state: State, stopped: Instance) -> str:
    """What a request cut short by stopping `stopped` (gone from `state`) is
    told: where its model went, when the master placed it again after a
    failure; else that the instance was deleted. Never "the node is shutting
    down": the node is fine."""
    what = f"the instance of {stopped.model_id} this node served was stopped"
    for instance in state.instances.values():
        if instance.model_id != stopped.model_id or instance.moved is None:
            continue
        moved = instance.moved
        nodes = ", ".join(moved.from_nodes) or "one of its nodes"
        why = (
            f"after node {nodes} was lost"
            if moved.reason == "node_lost"
            else f"after its runner failed on node {nodes}"
        )
        return (
            f"{what}: the cluster moved it to node {', '.join(instance.node_ids)} {why}; "
            "send the request again once it is ready"
        )
    return f"{what}: it was deleted or placed again; send the request again"


def needed_files(state: State, instance: Instance, node_id: NodeId) -> frozenset[str] | None:
    """The files `node_id` needs for its rank; None when the card is unknown."""
    card = state.cards.get(instance.model_id)
    rank = instance.rank_of(node_id)
    if card is None or rank is None:
        return None
    part = instance.ranks[rank]
    return frozenset(shard_files(card, part.start_layer, part.end_layer))


def has_files(
    state: State, instance: Instance, node_id: NodeId, have: Set[str] | None = None
) -> bool:
    """Whether `node_id` has every file of its rank complete: `have` when given,
    else as the state shows it."""
    if have is None:
        download = state.downloads.get(node_id, {}).get(instance.model_id)
        if download is None:
            return False
        if download.status != "complete" and not download.have_files:
            return False
        have = set(download.have_files)
    needed = needed_files(state, instance, node_id)
    return bool(have) if needed is None else needed <= have


def plan(node_id: NodeId, state: State, local: LocalFacts) -> Action | None:
    mine = [
        state.instances[i]
        for i in sorted(state.instances)
        if node_id in state.instances[i].node_ids and i not in local.stale
    ]
    for instance_id in sorted(local.running):
        if instance_id not in {instance.instance_id for instance in mine}:
            return StopRunner(instance_id)
    wanted = {instance.model_id for instance in mine if instance.instance_id not in local.running}
    for model_id in sorted(local.downloading - local.cancelling):
        if model_id not in wanted:
            return CancelDownload(model_id)
    for instance in mine:
        if instance.instance_id in local.running:
            continue
        if not has_files(
            state, instance, node_id, local.have_files.get(instance.model_id, frozenset())
        ):
            if (
                instance.model_id not in local.downloading
                and instance.instance_id not in local.download_failed
            ):
                return StartDownload(
                    instance.model_id, needed_files(state, instance, node_id), instance.instance_id
                )
            continue
        if all(
            has_files(state, instance, other) for other in instance.node_ids if other != node_id
        ):
            rank = instance.rank_of(node_id)
            assert rank is not None
            return StartRunner(instance, rank)
    return None


def wants_standby(state: State) -> bool:
    """Whether a node keeps a runner process started ahead (`runner/standby.py`):
    while a model runs across nodes, whose re-placement after a node's death
    must not wait for processes to start."""
    return len(state.nodes) > 1 and any(
        len(instance.ranks) > 1 for instance in state.instances.values()
    )
