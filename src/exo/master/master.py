"""The master: the only writer of the cluster's history.

While this node is master ("in office"), `Master` carries out commands
(`decide` -> index -> fsync -> apply), indexes the events nodes publish (only
those a node may originate, `may_originate`), and does the master's duties: it
times out silent nodes and places again the instances that lost a rank. The
cluster link says when this node takes or leaves office, hands the master what
arrives, and tells it which nodes it hears and when (`heard_ms`): the master
places only on those, a node the link lost takes its instances down with it at
once, and a node is timed out when neither its events nor the link were heard
from it for the node timeout. The decisions are pure functions (`decide`, `may_originate`,
`placeable`, `timed_out_nodes`, `broken_instances`, `instances_on`).
"""

import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence

import anyio
from loguru import logger

from exo.master.commands import decide
from exo.master.recovery import (
    GAVE_UP_SHOWN_SECONDS,
    WINDOW_SECONDS,
    Recovery,
    broken_instances,
    failed_before_serving,
    gave_up,
    instances_on,
    replacement,
    still_served,
    waited_too_long,
)
from exo.shared.event_store import EventLogUnavailable, EventStore, now_ms, with_ids
from exo.shared.types.commands import Command, CommandRejected, DeleteInstance
from exo.shared.types.events import (
    DownloadProgressed,
    DownloadRemoved,
    Event,
    HistoryDiverged,
    InstanceCreated,
    InstanceDeleted,
    MasterElected,
    ModelCardPublished,
    ModelFoldersUnreadable,
    ModelUnplaced,
    NodeForgotten,
    NodeJoined,
    NodeReachable,
    NodeTelemetryReported,
    NodeTimedOut,
    NodeUnreachable,
    ReplicaReported,
    RunnerStatusChanged,
)
from exo.shared.types.ids import InstanceId, NodeId
from exo.shared.types.state import Instance, NodeInfo, Relocation, State, UnplacedModel

# A ring's runners fail as soon as one of its nodes dies, often a moment before
# the link notices that node is gone: an instance with a failed rank is placed
# again once it has been failed this long (a lost node's instances at once), so
# that the placement leaves the dead node out.
BROKEN_GRACE_SECONDS = 1.0


class NotMaster(Exception):
    """This node is not (or not yet) the master."""


def timed_out_nodes(
    state: State, now: int, timeout_ms: int, keep: NodeId, heard_ms: Mapping[NodeId, int]
) -> list[NodeId]:
    """Nodes whose last event and last word on the link (`heard_ms`, or the
    heartbeat the state last recorded) are all older than `timeout_ms` (never
    `keep`, the master itself)."""

    def last(node: NodeInfo) -> int:
        return max(node.last_seen_ms, node.last_heartbeat_ms or 0, heard_ms.get(node.node_id, 0))

    return sorted(
        node_id
        for node_id, node in state.nodes.items()
        if node_id != keep and now - last(node) > timeout_ms
    )


def may_originate(state: State, origin: NodeId, event: Event) -> bool:
    """Whether node `origin` may publish `event`: facts about itself (joining,
    telemetry, its runners, its downloads), the cards of models it describes,
    and the deletion of an instance only it serves (its own, after a restart).
    What only the master decides (elections, timeouts, new instances) never."""
    match event:
        case (
            NodeJoined()
            | NodeTelemetryReported()
            | RunnerStatusChanged()
            | DownloadProgressed()
            | DownloadRemoved()
            | ModelFoldersUnreadable()
            | HistoryDiverged()
        ):
            return event.node_id == origin
        case ModelCardPublished():
            return True
        case ReplicaReported():
            instance = state.instances.get(event.instance_id)
            return event.node_id == origin and (
                instance is None or instance.ranks[0].node_id == origin
            )
        case InstanceDeleted():
            instance = state.instances.get(event.instance_id)
            return instance is None or set(instance.node_ids) == {origin}
        case (
            NodeTimedOut()
            | NodeUnreachable()
            | NodeReachable()
            | NodeForgotten()
            | MasterElected()
            | InstanceCreated()
            | ModelUnplaced()
        ):
            return False


def reachability_changes(
    state: State, reachable: Collection[NodeId], last_heard_ms: Mapping[NodeId, int]
) -> list[NodeUnreachable | NodeReachable]:
    """The events that bring the state's marks in line with what the link hears:
    `NodeUnreachable` for a node it lost (with its last heartbeat), and
    `NodeReachable` for a marked one it hears again."""
    changes: list[NodeUnreachable | NodeReachable] = []
    for node_id, node in sorted(state.nodes.items()):
        if node_id not in reachable and node.unreachable_since_ms is None:
            changes.append(
                NodeUnreachable(node_id=node_id, last_heard_ms=last_heard_ms.get(node_id))
            )
        elif node_id in reachable and node.unreachable_since_ms is not None:
            changes.append(NodeReachable(node_id=node_id))
    return changes


def placeable(state: State, reachable: Collection[NodeId]) -> State:
    """`state` as placement sees it: only the nodes in `reachable`."""
    return state.model_copy(
        update={"nodes": {n: info for n, info in state.nodes.items() if n in reachable}}
    )


class Master:
    def __init__(
        self,
        store: EventStore,
        node_timeout_seconds: float,
        duty_interval_seconds: float,
        heard_ms: Callable[[], Mapping[NodeId, int]] | None = None,
        broken_grace_seconds: float = BROKEN_GRACE_SECONDS,
    ) -> None:
        """`heard_ms`: when the link last heard each live peer (wall-clock ms);
        None: no link, every node of the state counts as reachable."""
        self.node_id = store.node_id
        self._store = store
        self._node_timeout_ms = int(node_timeout_seconds * 1000)
        self._duty_interval_seconds = duty_interval_seconds
        self._recovery = Recovery()
        self._in_office = False
        self._election_recorded = False
        self._heard_ms = heard_ms
        self._unreachable: set[NodeId] = set()
        self._last_heard_ms: dict[NodeId, int] = {}  # every peer's latest, lost ones' too
        self._woken = anyio.Event()
        self._broken_grace_seconds = broken_grace_seconds
        self._broken_since: dict[InstanceId, float] = {}  # monotonic time first seen failed

    @property
    def in_office(self) -> bool:
        return self._in_office

    def take_office(self) -> None:
        """Continue the history as master, in the next term (the caller caught
        this node's log up first)."""
        self._in_office = True
        self._record_election()

    def _record_election(self) -> None:
        """Index MasterElected; on a full disk the duties try again."""
        term = self._store.state.master_term + 1
        try:
            self._index([MasterElected(master_id=self.node_id, term=term)])
        except EventLogUnavailable as error:
            self._election_recorded = False
            logger.error(f"cannot record this node's election yet: {error}")
            return
        self._election_recorded = True
        logger.info(f"node {self.node_id} is master (term {term}) at index {self._store.next_idx}")

    def leave_office(self) -> None:
        self._in_office = False

    def execute(self, command_id: str, origin: NodeId, command: Command) -> int:
        """Carry out `command`: decide (on the nodes the link hears), index,
        persist, apply. Returns the index of its last event; a command that
        changes nothing (a retry) returns the current last index, which its
        earlier effect precedes. Raises `CommandRejected` with the reason,
        `NotMaster` out of office."""
        if not self._in_office:
            raise NotMaster(f"node {self.node_id} is not the master")
        events = decide(self._placeable_state(), command)
        self._store.index(origin, with_ids(command_id, events))
        return self._store.state.last_idx

    def accept(self, origin: NodeId, events: Sequence[tuple[str, Event]]) -> list[Event]:
        """Index the events a node published, `(event_id, event)` each (ids seen
        before are skipped), but those `origin` may not originate: these are
        returned (and logged), for the caller to report."""
        if not self._in_office:
            raise NotMaster(f"node {self.node_id} is not the master")
        state = self._store.state
        allowed = [(i, e) for i, e in events if may_originate(state, origin, e)]
        refused = [e for _, e in events if not may_originate(state, origin, e)]
        if refused:
            logger.warning(
                f"refused {len(refused)} event(s) from node {origin} that only another node "
                f"or the master may publish: {', '.join(sorted({e.kind for e in refused}))}"
            )
        self._store.index(origin, allowed)
        return refused

    def wake(self) -> None:
        """Do the duties now rather than at the next interval (the link lost a
        node, or this node took office)."""
        self._woken.set()

    async def run(self) -> None:
        """The master's duties, every interval (or when woken) while in office."""
        while True:
            with anyio.move_on_after(self._next_duty_seconds()):
                await self._woken.wait()
            self._woken = anyio.Event()
            if self._in_office:
                try:
                    if not self._election_recorded:
                        self._record_election()
                    self.tend()
                except EventLogUnavailable as error:
                    logger.warning(f"master duties put off: {error}")

    def tend(self) -> None:
        """One round of duties: time out silent nodes, then delete every instance
        that lost a rank (to a timeout, a node the link lost, or a failed runner)
        and place its model again unless the instances left serve it as placed; a
        model no node could take is tried again each round (for the recovery
        window), so it comes back with the first node that can hold it."""
        before = self._store.state
        # The last word of every peer, those the link has just dropped too.
        self._last_heard_ms.update(self._heard_ms() if self._heard_ms else {})
        gone = timed_out_nodes(
            before, now_ms(), self._node_timeout_ms, self.node_id, self._last_heard_ms
        )
        for node_id in gone:
            logger.warning(f"node {node_id} timed out; its instances are removed")
        self._index([NodeTimedOut(node_id=n) for n in gone])
        state = self._store.state
        lost = self._note_unreachable(state)
        damaged: dict[str, tuple[Instance, bool, Relocation]] = {}
        for instance in self._broken_long_enough(state):
            failed = _failed_ranks(state, instance)
            damaged[instance.instance_id] = (
                instance, True, Relocation(from_nodes=failed, reason="runner_failed")
            )  # fmt: skip
        for instance, listed, dead in [
            *((i, False, set(gone)) for i in instances_on(before, gone)),
            *((i, True, lost) for i in instances_on(state, lost)),
        ]:
            from_nodes = tuple(n for n in instance.node_ids if n in dead)
            damaged[instance.instance_id] = (
                instance, listed, Relocation(from_nodes=from_nodes, reason="node_lost")
            )  # fmt: skip
        available = _accepting_nodes(self._placeable_state())
        for instance, listed, moved in damaged.values():
            served = still_served(state, instance, damaged)
            logger.warning(
                f"instance {instance.instance_id} of {instance.model_id} lost a rank; "
                + ("the instances left serve it as placed" if served else "placing it again")
            )
            if listed:
                delete = DeleteInstance(instance_id=instance.instance_id)
                try:
                    self.execute(uuid.uuid4().hex, self.node_id, delete)
                except CommandRejected as error:  # deleted meanwhile: nothing to do
                    logger.debug(f"instance {instance.instance_id} not deleted: {error}")
            if not served:
                self._place_again(state, instance, available, moved)
        self._retry_unplaced(available)

    def _place_again(
        self, state: State, instance: Instance, available: int, moved: Relocation
    ) -> None:
        """Place a lost instance's model again, unless it keeps failing before
        it serves; what cannot be placed now is recorded for the next rounds
        (and the next master)."""
        failed = failed_before_serving(state, instance)
        if not self._recovery.may_place_again(instance.model_id, failed is not None):
            assert failed is not None
            logger.error(f"{instance.model_id} is not placed again: {gave_up(failed)}")
            self._unplaced(instance, gave_up(failed), given_up=True)
            return
        try:
            self.execute(uuid.uuid4().hex, self.node_id, replacement(instance, available, moved))
        except CommandRejected as error:
            logger.warning(f"cannot place {instance.model_id} again yet: {error}")
            self._unplaced(instance, str(error))

    def _retry_unplaced(self, available: int) -> None:
        """Each round, the models recorded as unplaced: placed again when a node
        can take them, dropped when others serve them as placed, given up on
        after the window (and forgotten an hour later)."""
        for model_id, unplaced in sorted(self._store.state.unplaced.items()):
            age = (now_ms() - unplaced.since_ms) / 1000
            if unplaced.given_up:
                if age >= GAVE_UP_SHOWN_SECONDS:
                    self._index([ModelUnplaced(model_id=model_id, unplaced=None)])
            elif still_served(self._store.state, unplaced.instance, ()):
                self._index([ModelUnplaced(model_id=model_id, unplaced=None)])
            elif age >= WINDOW_SECONDS:
                logger.error(f"{model_id} is not placed again: {waited_too_long(unplaced)}")
                self._unplaced(unplaced.instance, waited_too_long(unplaced), given_up=True)
            else:
                try:
                    self.execute(
                        uuid.uuid4().hex, self.node_id, replacement(unplaced.instance, available)
                    )
                except CommandRejected:
                    continue  # still no room: the next round tries again
                logger.info(f"{model_id} placed again, now that a node can take it")

    def _unplaced(self, instance: Instance, reason: str, given_up: bool = False) -> None:
        """Record (in the state) that `instance`'s model is not placed, and why."""
        known = self._store.state.unplaced.get(instance.model_id)
        record = UnplacedModel(
            instance=instance,
            since_ms=known.since_ms if known is not None else now_ms(),
            reason=reason,
            given_up=given_up,
        )
        self._index([ModelUnplaced(model_id=instance.model_id, unplaced=record)])

    def _broken_long_enough(self, state: State) -> list[Instance]:
        """The instances with a failed rank that have been so for the grace."""
        now = time.monotonic()
        broken = broken_instances(state)
        self._broken_since = {
            i.instance_id: self._broken_since.get(i.instance_id, now) for i in broken
        }
        return [
            i
            for i in broken
            if now - self._broken_since[i.instance_id] >= self._broken_grace_seconds
        ]

    def _next_duty_seconds(self) -> float:
        """Until the next round of duties: the interval, or sooner when a failed
        instance's grace ends."""
        now = time.monotonic()
        ends = (since + self._broken_grace_seconds for since in self._broken_since.values())
        due = [end - now for end in ends if end > now]
        return max(0.0, min([self._duty_interval_seconds, *due]))

    def _reachable(self) -> Collection[NodeId] | None:
        """The nodes the link hears now, this one included (None: no link)."""
        return None if self._heard_ms is None else {self.node_id, *self._heard_ms()}

    def _note_unreachable(self, state: State) -> set[NodeId]:
        """The nodes of the state the link does not hear; changes are logged,
        and indexed (`NodeUnreachable`, `NodeReachable`) for every node to see."""
        reachable = self._reachable()
        if reachable is None:
            return set()
        self._index(reachability_changes(state, reachable, self._last_heard_ms))
        unreachable = {n for n in state.nodes if n not in reachable}
        for node_id in sorted(unreachable - self._unreachable):
            logger.warning(f"node {node_id}: the link lost it; out of placement")
        for node_id in sorted(self._unreachable - unreachable):
            logger.info(f"node {node_id}: heard again; back in placement")
        self._unreachable = unreachable
        return unreachable

    def _placeable_state(self) -> State:
        state, reachable = self._store.state, self._reachable()
        return state if reachable is None else placeable(state, reachable)

    def _index(self, events: Sequence[Event]) -> None:
        self._store.index(self.node_id, with_ids(uuid.uuid4().hex, events))


def _failed_ranks(state: State, instance: Instance) -> tuple[NodeId, ...]:
    runners = state.runners.get(instance.instance_id, {})
    return tuple(
        n for n in instance.node_ids if n in runners and runners[n].status in ("failed", "stopped")
    )


def _accepting_nodes(state: State) -> int:
    return sum(
        1 for info in state.nodes.values() if info.telemetry and info.telemetry.accepts_instances
    )
