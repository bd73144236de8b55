"""Events: facts in the past tense. The master indexes them; state folds them."""

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import (
    HistorySetAside,
    Instance,
    NodeTelemetry,
    UnplacedModel,
    UnreadableModelFolder,
)


class NodeJoined(FrozenModel):
    kind: Literal["node_joined"] = "node_joined"
    node_id: NodeId
    grpc_address: str | None  # None: the node has no cluster link
    api_address: str | None = None  # host:port of its HTTP API, None without one
    started_at_ms: int
    hostname: str | None = None  # the machine's name (`socket.gethostname()`)


class NodeTelemetryReported(FrozenModel):
    kind: Literal["node_telemetry_reported"] = "node_telemetry_reported"
    node_id: NodeId
    telemetry: NodeTelemetry


class NodeTimedOut(FrozenModel):
    kind: Literal["node_timed_out"] = "node_timed_out"
    node_id: NodeId


class NodeUnreachable(FrozenModel):
    """The master's link lost the node (its heartbeats stopped, or its address
    refuses connections): it stays in the state until it times out, but nothing
    is placed on it and its instances are placed again."""

    kind: Literal["node_unreachable"] = "node_unreachable"
    node_id: NodeId
    last_heard_ms: int | None = None  # the master's last heartbeat from it


class NodeReachable(FrozenModel):
    """The master's link hears an unreachable node again."""

    kind: Literal["node_reachable"] = "node_reachable"
    node_id: NodeId


class NodeForgotten(FrozenModel):
    """A user removed a node that timed out from the state (`ForgetNode`)."""

    kind: Literal["node_forgotten"] = "node_forgotten"
    node_id: NodeId


class MasterElected(FrozenModel):
    kind: Literal["master_elected"] = "master_elected"
    master_id: NodeId
    term: int


class InstanceCreated(FrozenModel):
    kind: Literal["instance_created"] = "instance_created"
    instance: Instance


class InstanceDeleted(FrozenModel):
    kind: Literal["instance_deleted"] = "instance_deleted"
    instance_id: InstanceId


class RunnerStatusChanged(FrozenModel):
    kind: Literal["runner_status_changed"] = "runner_status_changed"
    instance_id: InstanceId
    node_id: NodeId
    status: RunnerStatus
    error: str | None = None


class ModelCardPublished(FrozenModel):
    """A node described a model it has (or fetched the description of)."""

    kind: Literal["model_card_published"] = "model_card_published"
    card: ModelCard


class DownloadProgressed(FrozenModel):
    kind: Literal["download_progressed"] = "download_progressed"
    node_id: NodeId
    progress: DownloadProgress


class DownloadRemoved(FrozenModel):
    """The node deleted its files of the model."""

    kind: Literal["download_removed"] = "download_removed"
    node_id: NodeId
    model_id: ModelId


class ModelFoldersUnreadable(FrozenModel):
    """The node's model folders that could not be read, all of them (each report
    replaces the last; none: every folder was read)."""

    kind: Literal["model_folders_unreadable"] = "model_folders_unreadable"
    node_id: NodeId
    folders: tuple[UnreadableModelFolder, ...]


class ReplicaReported(FrozenModel):
    """What the first rank of an instance offers the routing of requests
    (`exo.api.routing`): a change of what its prefix cache holds (digests of
    `exo.shared.prefix_digests` added and removed), of its load (requests
    running or waiting there) and of what a request waiting for a slot there
    costs, in prompt tokens (None: unchanged)."""

    kind: Literal["replica_reported"] = "replica_reported"
    node_id: NodeId
    instance_id: InstanceId
    load: int | None = Field(default=None, ge=0)
    wait_tokens: int | None = Field(default=None, ge=0)
    cached_added: tuple[int, ...] = ()
    cached_removed: tuple[int, ...] = ()


class HistoryDiverged(FrozenModel):
    """A node found its history diverged from the master's and set its own
    aside (`EventStore.reset`), to take the master's."""

    kind: Literal["history_diverged"] = "history_diverged"
    node_id: NodeId
    set_aside: HistorySetAside


class ModelUnplaced(FrozenModel):
    """The master could not place a lost instance's model again yet, or stopped
    trying (`unplaced`); None: it need not any more (others serve it as placed)."""

    kind: Literal["model_unplaced"] = "model_unplaced"
    model_id: ModelId
    unplaced: UnplacedModel | None


Event = Annotated[
    NodeJoined
    | NodeTelemetryReported
    | NodeTimedOut
    | NodeUnreachable
    | NodeReachable
    | NodeForgotten
    | MasterElected
    | InstanceCreated
    | InstanceDeleted
    | RunnerStatusChanged
    | ModelCardPublished
    | DownloadProgressed
    | DownloadRemoved
    | ModelFoldersUnreadable
    | ReplicaReported
    | HistoryDiverged
    | ModelUnplaced,
    Field(discriminator="kind"),
]


class IndexedEvent(FrozenModel):
    """An event as the master ordered it: `idx` 0, 1, 2, ... with no gaps."""

    idx: int = Field(ge=0)
    at_ms: int  # master clock when indexed
    origin: NodeId  # the node whose event this is
    event: Event


indexed_event_adapter: TypeAdapter[IndexedEvent] = TypeAdapter(IndexedEvent)
event_adapter: TypeAdapter[Event] = TypeAdapter(Event)
