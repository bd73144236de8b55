"""`decide(state, command) -> events`: pure; a command that cannot be carried
out raises `CommandRejected` with a message for the user."""

from exo.shared.types.commands import Command, CreateInstance, DeleteInstance
from exo.shared.types.events import Event, InstanceCreated, InstanceDeleted
from exo.shared.types.state import Instance, State


class CommandRejected(Exception):
    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def decide(state: State, command: Command) -> list[Event]:
    match command:
        case CreateInstance():
            if command.node_id not in state.nodes:
                raise CommandRejected(f"no node {command.node_id!r} in the cluster", not_found=True)
            if command.instance_id in state.instances:
                return []  # a retried command
            for instance in state.instances.values():
                if instance.node_id == command.node_id and instance.model_id == command.model_id:
                    raise CommandRejected(
                        f"node {command.node_id} already serves {command.model_id} "
                        f"(instance {instance.instance_id})"
                    )
            instance = Instance(
                instance_id=command.instance_id, model_id=command.model_id, node_id=command.node_id
            )
            return [InstanceCreated(instance=instance)]
        case DeleteInstance():
            if command.instance_id not in state.instances:
                raise CommandRejected(f"no instance {command.instance_id!r}", not_found=True)
            return [InstanceDeleted(instance_id=command.instance_id)]
