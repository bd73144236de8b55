"""The cluster state: what every node knows, the fold of the indexed events."""

from typing import Literal

from pydantic import Field

from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.runner import RunnerStatus

MlxBackend = Literal["metal", "cuda", "cpu"]
# How an instance splits a model between its ranks: consecutive layers each
# ("pipeline"), or a slice of every layer each ("tensor").
Sharding = Literal["pipeline", "tensor"]


class NodeTelemetry(FrozenModel):
    ram_total: int
    ram_available: int
    disk_free: int  # of the node's models directory
    cpu_count: int
    platform: str
    mlx_backend: MlxBackend
    accepts_instances: bool = True  # False: a node started with --no-worker
    # Why the node cannot write its event log (e.g. a full disk); None when it can.
    event_log_error: str | None = None


class NodeInfo(FrozenModel):
    node_id: NodeId
    grpc_address: str | None
    api_address: str | None = None
    started_at_ms: int
    hostname: str | None = None  # the machine's name, for people (None: not told)
    telemetry: NodeTelemetry | None = None
    # Master-assigned time of the last event heard from this node.
    last_seen_ms: int
    # The master's last heartbeat from the node, as of its last word on it (a
    # node that is heard now is newer: the link's `heard_ms`, `GET /cluster`).
    last_heartbeat_ms: int | None = None
    # Since when the master's link does not hear the node (None: it does). The
    # node is still in the state until the node timeout; nothing is placed on it.
    unreachable_since_ms: int | None = None
    # When the master timed the node out (only in `State.gone_nodes`).
    timed_out_at_ms: int | None = None


class InstanceRank(FrozenModel):
    """One node's part of an instance: layers [start_layer, end_layer); a tensor
    rank holds a slice of each of them, [0, n_layers)."""

    node_id: NodeId
    start_layer: int = Field(ge=0)
    end_layer: int  # exclusive
    # A tensor rank's KV heads (with their query heads): a split may be uneven.
    # None: a pipeline rank, or a model without a card; left out of the JSON
    # then, so a pipeline rank reads as it did before the field existed.
    kv_heads: int | None = Field(default=None, exclude_if=lambda heads: heads is None)


class Relocation(FrozenModel):
    """Why an instance is where it is: its model was placed again after the
    instance before it lost these nodes (`node_lost`) or a runner on them
    failed (`runner_failed`)."""

    from_nodes: tuple[NodeId, ...]
    reason: Literal["node_lost", "runner_failed"]


class Instance(FrozenModel):
    """A model served by one runner per rank, the ranks in pipeline order (a
    pipeline) or in ring order, each over every layer (tensor)."""

    instance_id: InstanceId
    model_id: ModelId
    ranks: tuple[InstanceRank, ...] = Field(min_length=1)
    # "ip:port" each rank's runner listens on for mx.distributed (ring backend),
    # in rank order; empty for a single rank.
    ring_hosts: tuple[str, ...] = ()
    # What the placement asked for: a re-placement asks for the same.
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)
    sharding: Sharding = "pipeline"
    # Instances of the model its placement asked for (`replicas`): one lost is
    # placed again while fewer than this serve the model.
    replicas: int = Field(default=1, ge=1)
    # Set when the master placed the model again after a failure (None: placed as asked).
    moved: Relocation | None = None

    @property
    def n_layers(self) -> int:
        return self.ranks[-1].end_layer

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return tuple(rank.node_id for rank in self.ranks)

    def rank_of(self, node_id: NodeId) -> int | None:
        """This node's rank in the instance, None when it has no part in it."""
        for index, rank in enumerate(self.ranks):
            if rank.node_id == node_id:
                return index
        return None


class RunnerInfo(FrozenModel):
    instance_id: InstanceId
    node_id: NodeId
    status: RunnerStatus
    error: str | None = None
    # Whether it has been ready since it was placed: a failure before that may
    # be the model's own (it cannot load), not a fault around it.
    served: bool = False


class UnreadableModelFolder(FrozenModel):
    """A folder in a node's models directories that could not be described as
    a model: the node skips it and serves the others."""

    path: str
    reason: str


class ReplicaReport(FrozenModel):
    """What an instance's first rank last reported for routing (`ReplicaReported`)."""

    cached: frozenset[int] = frozenset()  # digests of its prefix cache (`prefix_digests`)
    load: int = 0  # requests running or waiting on it
    # What a request waiting for a slot there costs, in prompt tokens it could
    # prefill meanwhile (`ModelGate.wait_tokens`); None: not measured yet.
    wait_tokens: int | None = None


class UnplacedModel(FrozenModel):
    """A model whose instance was lost and that is not placed again yet. The
    state holds it so that every master keeps trying (not only the one that
    lost it), and every node answers it as coming back, not as unknown."""

    instance: Instance  # the lost instance: its placement request is asked for again
    since_ms: int  # master clock when it was first left unplaced
    # Why it is not placed: the last refusal, or why the master stopped trying.
    reason: str
    given_up: bool = False  # True: not tried again (False: tried each round)


class HistorySetAside(FrozenModel):
    """Events a node held that the cluster's history does not: its history
    diverged (it was master of its own side of a partition, say) and the
    master's is the one the cluster keeps. They are kept in the node's data
    dir, not applied; this says when, from where and how many."""

    at_ms: int
    from_idx: int  # the first index at which the node's history differed
    events: int  # how many events it set aside
    kept_as: str  # the file in the node's data dir that holds them


InstanceStatus = Literal["downloading", "starting", "loading", "ready", "running", "failed"]


class State(FrozenModel):
    nodes: dict[NodeId, NodeInfo] = Field(default_factory=dict)
    # Nodes the master timed out, as last known, until they join again or a
    # user forgets them (`NodeForgotten`): a node that died stays visible.
    gone_nodes: dict[NodeId, NodeInfo] = Field(default_factory=dict)
    instances: dict[InstanceId, Instance] = Field(default_factory=dict)
    # The runner of each rank: by instance, then by node.
    runners: dict[InstanceId, dict[NodeId, RunnerInfo]] = Field(default_factory=dict)
    # What each node has of each model (complete, downloading, failed).
    downloads: dict[NodeId, dict[ModelId, DownloadProgress]] = Field(default_factory=dict)
    # Every model some node has described (placement needs its layers and bytes).
    cards: dict[ModelId, ModelCard] = Field(default_factory=dict)
    # Each node's model folders that could not be read, and why (absent: none).
    unreadable_models: dict[NodeId, tuple[UnreadableModelFolder, ...]] = Field(default_factory=dict)
    master_id: NodeId | None = None
    master_term: int = 0
    # What each instance's first rank reports for routing, by instance.
    replicas: dict[InstanceId, ReplicaReport] = Field(default_factory=dict)
    # The latest history each node set aside (`HistoryDiverged`): after a
    # partition, what the side that lost had done is not silently gone.
    set_aside: dict[NodeId, HistorySetAside] = Field(default_factory=dict)
    # Models whose lost instance is not placed again yet (cleared by a new
    # instance of the model).
    unplaced: dict[ModelId, UnplacedModel] = Field(default_factory=dict)
    # Index of the last applied event; -1 before the first.
    last_idx: int = -1

    def instance_status(self, instance: Instance) -> InstanceStatus:
        """The least advanced rank's status: failed if any rank failed, ready or
        running only when every rank's runner is up."""
        runners = self.runners.get(instance.instance_id, {})
        statuses = [runners[n].status if n in runners else None for n in instance.node_ids]
        if any(status in ("failed", "stopped") for status in statuses):
            return "failed"
        if any(status is None for status in statuses):
            return "downloading"
        for status in ("starting", "loading", "running"):
            if status in statuses:
                return status
        return "ready"
