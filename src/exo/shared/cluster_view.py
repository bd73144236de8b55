"""What the API needs of the cluster: this node's id, the state, the event stream,
commands and a way to wait for their effect."""

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from exo.shared.types.commands import Command
from exo.shared.types.events import Event, IndexedEvent
from exo.shared.types.ids import NodeId
from exo.shared.types.state import State


class ClusterView(Protocol):
    node_id: NodeId
    address: str
    resumed_from_idx: int

    @property
    def master_id(self) -> NodeId | None: ...

    @property
    def state(self) -> State: ...

    @property
    def event_log_error(self) -> str | None:
        """Why this node cannot write its event log now (a full disk); None when it can."""
        ...

    def events_behind(self) -> int:
        """How many events the master last said it holds that this node has not
        applied: above 0 while it catches up (after a start, or once its own
        history was set aside), when its state may lack what the cluster has."""
        ...

    def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]: ...

    def heard_ms(self) -> Mapping[NodeId, int]:
        """When this node's link last heard each peer it hears now (wall-clock
        ms): heartbeats, which are not events (they would grow the log)."""
        ...

    async def send_command(self, command: Command) -> int:
        """The index of the command's last event (`wait_until` it to see the effect)."""
        ...

    async def wait_until(self, idx: int, timeout: float) -> bool:
        """Until this node applied the event `idx` (True), or `timeout` passed."""
        ...

    def publish(self, *events: Event) -> None: ...
