"""Commands: what a node asks the master to do (imperative). The master decides
them against its state and turns them into events, or rejects them; a carried
out command answers with the index of its last event (see `ClusterView`)."""

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import InstanceRank, Relocation, Sharding


class CreateInstance(FrozenModel):
    """An instance on the given ranks, as the sender placed it."""

    kind: Literal["create_instance"] = "create_instance"
    instance_id: InstanceId
    model_id: ModelId
    ranks: tuple[InstanceRank, ...] = Field(min_length=1)
    sharding: Sharding = "pipeline"  # tensor: every rank holds [0, n_layers)
    # The model's card, for a model the cluster has no card of (e.g. from the hub).
    card: ModelCard | None = None


class PlaceInstance(FrozenModel):
    """An instance where the master's placement puts it."""

    kind: Literal["place_instance"] = "place_instance"
    instance_id: InstanceId
    model_id: ModelId
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)
    sharding: Sharding = "pipeline"
    # The model's card, for a model the cluster has no card of (e.g. from the hub).
    card: ModelCard | None = None
    # The master's re-placement after a failure: where from, and why.
    moved: Relocation | None = None
    # Ids of more instances of the model (replicas), each placed on nodes of its
    # own; all of them are placed or none.
    replica_ids: tuple[InstanceId, ...] = ()
    # Instances of the model the cluster keeps (`Instance.replicas`): at least
    # this command's; a re-placement of one replica keeps its placement's.
    replicas: int = Field(default=1, ge=1)


class DeleteInstance(FrozenModel):
    kind: Literal["delete_instance"] = "delete_instance"
    instance_id: InstanceId


class ForgetNode(FrozenModel):
    """Remove a node that timed out from the state (a user's cleanup)."""

    kind: Literal["forget_node"] = "forget_node"
    node_id: NodeId


Command = Annotated[
    CreateInstance | PlaceInstance | DeleteInstance | ForgetNode,
    Field(discriminator="kind"),
]
command_adapter: TypeAdapter[Command] = TypeAdapter(Command)


class CommandRejected(Exception):
    """The master refused a command; the message says why (shown to the user)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


class ClusterUnavailable(Exception):
    """No master could be reached to carry out a command."""
