"""Commands: what a node asks the master to do (imperative). The master decides
them against its state and turns them into events, or rejects them."""

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import InstanceId, ModelId, NodeId


class CreateInstance(FrozenModel):
    kind: Literal["create_instance"] = "create_instance"
    instance_id: InstanceId
    model_id: ModelId
    node_id: NodeId


class DeleteInstance(FrozenModel):
    kind: Literal["delete_instance"] = "delete_instance"
    instance_id: InstanceId


Command = Annotated[CreateInstance | DeleteInstance, Field(discriminator="kind")]
command_adapter: TypeAdapter[Command] = TypeAdapter(Command)
