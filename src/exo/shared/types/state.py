"""The cluster state: what every node knows, the fold of the indexed events."""

from typing import Literal

from pydantic import Field

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.runner import RunnerStatus

MlxBackend = Literal["metal", "cuda", "cpu"]


class NodeTelemetry(FrozenModel):
    ram_total: int
    ram_available: int
    disk_free: int  # of the node's models directory
    cpu_count: int
    platform: str
    mlx_backend: MlxBackend


class NodeInfo(FrozenModel):
    node_id: NodeId
    grpc_address: str | None
    api_address: str | None = None
    started_at_ms: int
    telemetry: NodeTelemetry | None = None
    # Master-assigned time of the last event heard from this node.
    last_seen_ms: int


class Instance(FrozenModel):
    """A model served by runners; one node for now (placement issue: ranks)."""

    instance_id: InstanceId
    model_id: ModelId
    node_id: NodeId


class RunnerInfo(FrozenModel):
    instance_id: InstanceId
    node_id: NodeId
    status: RunnerStatus
    error: str | None = None


class State(FrozenModel):
    nodes: dict[NodeId, NodeInfo] = Field(default_factory=dict)
    instances: dict[InstanceId, Instance] = Field(default_factory=dict)
    runners: dict[InstanceId, RunnerInfo] = Field(default_factory=dict)
    master_id: NodeId | None = None
    master_term: int = 0
    # Index of the last applied event; -1 before the first.
    last_idx: int = -1
