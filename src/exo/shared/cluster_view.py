"""What the API needs of the cluster: this node's id, the state, the event stream."""

from collections.abc import AsyncIterator
from typing import Protocol

from exo.shared.types.commands import Command
from exo.shared.types.events import Event, IndexedEvent
from exo.shared.types.ids import NodeId
from exo.shared.types.state import State


class ClusterView(Protocol):
    node_id: NodeId
    master_id: NodeId | None
    address: str
    resumed_from_idx: int

    @property
    def state(self) -> State: ...

    def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]: ...

    async def send_command(self, command: Command) -> None: ...

    def publish(self, *events: Event) -> None: ...
