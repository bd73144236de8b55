"""The master: commands carried out (decide -> index -> apply) with their index,
retries indexed once, office, and its duties (node timeouts, re-placement)."""

import time
from pathlib import Path

import pytest
from loguru import logger

from exo.master import master as master_module
from exo.master.master import (
    Master,
    NotMaster,
    may_originate,
    reachability_changes,
    timed_out_nodes,
)
from exo.master.recovery import GAVE_UP_SHOWN_SECONDS, MAX_REPLACEMENTS, WINDOW_SECONDS
from exo.shared.event_log import EventLog
from exo.shared.event_store import EventStore, now_ms
from exo.shared.types.commands import CommandRejected, DeleteInstance, PlaceInstance
from exo.shared.types.downloads import DownloadProgress
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
    RunnerStatusChanged,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import (
    HistorySetAside,
    Instance,
    InstanceRank,
    NodeInfo,
    NodeTelemetry,
    Relocation,
    State,
)
from tests.unit.sharded_card import GB, sharded_card

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")
M = ModelId("org/m")
CARD = sharded_card(M)


def telemetry(ram_gb: float) -> NodeTelemetry:
    return NodeTelemetry(
        ram_total=int(ram_gb * GB), ram_available=int(ram_gb * GB), disk_free=100 * GB,
        cpu_count=8, platform="darwin", mlx_backend="metal",
    )  # fmt: skip


PROGRESS = DownloadProgress(
    model_id=M, status="downloading", files_total=1, files_done=0, bytes_total=10, bytes_done=5
)
SET_ASIDE = HistorySetAside(at_ms=1, from_idx=4, events=2, kept_as="events.log.diverged-1")


def cluster(
    tmp_path: Path, node_timeout_seconds: float = 60.0, heard: dict[NodeId, int] | None = None
) -> tuple[EventStore, Master]:
    """A store with nodes a (the master), b and c, 8 GB each; a in office.
    `heard`: the peers the link hears (None: no link, every node counts)."""
    store = EventStore(A, EventLog.open(tmp_path / "events.log"))
    for n in (A, B, C):
        store.index(
            n,
            [
                (f"join-{n}", NodeJoined(node_id=n, grpc_address=f"{n}:52414", started_at_ms=0)),
                (f"tel-{n}", NodeTelemetryReported(node_id=n, telemetry=telemetry(8))),
            ],
        )
    master = Master(
        store,
        node_timeout_seconds=node_timeout_seconds,
        duty_interval_seconds=1,
        heard_ms=None if heard is None else lambda: heard,
    )
    master.take_office()
    return store, master


def events_from(store: EventStore, idx: int) -> list[Event]:
    found = []
    while (indexed := store.event_at(idx)) is not None:
        found.append(indexed.event)
        idx += 1
    return found


def place(instance_id: str = "p", card: bool = True) -> PlaceInstance:
    return PlaceInstance(
        instance_id=InstanceId(instance_id), model_id=M, max_nodes=1, card=CARD if card else None
    )


def test_out_of_office_it_refuses_commands_and_events(tmp_path: Path) -> None:
    store = EventStore(A, EventLog.open(tmp_path / "events.log"))
    master = Master(store, node_timeout_seconds=60, duty_interval_seconds=1)
    with pytest.raises(NotMaster):
        master.execute("c1", A, place())
    with pytest.raises(NotMaster):
        master.accept(B, [("e1", NodeJoined(node_id=B, grpc_address=None, started_at_ms=0))])
    assert store.next_idx == 0


def test_taking_office_starts_the_next_term(tmp_path: Path) -> None:
    store, master = cluster(tmp_path)
    assert master.in_office
    assert events_from(store, store.next_idx - 1) == [MasterElected(master_id=A, term=1)]
    master.leave_office()
    master.take_office()
    assert store.state.master_term == 2
    assert store.state.master_id == A


def test_a_placement_brings_its_card_and_returns_the_index_of_its_last_event(
    tmp_path: Path,
) -> None:
    store, master = cluster(tmp_path)
    first = store.next_idx
    last_idx = master.execute("c1", B, place())
    new = events_from(store, first)
    assert [type(e) for e in new] == [ModelCardPublished, InstanceCreated]
    assert new[0] == ModelCardPublished(card=CARD)
    assert last_idx == first + 1 == store.state.last_idx
    indexed = store.event_at(last_idx)
    assert indexed is not None and indexed.origin == B
    assert store.state.cards[M] == CARD
    assert InstanceId("p") in store.state.instances


def test_a_known_card_is_not_published_again(tmp_path: Path) -> None:
    store, master = cluster(tmp_path)
    master.execute("c1", B, place("p1"))
    first = store.next_idx
    master.execute("c2", B, place("p2", card=False))
    assert [type(e) for e in events_from(store, first)] == [InstanceCreated]


def test_a_retried_command_is_indexed_once_and_answers_the_current_index(
    tmp_path: Path,
) -> None:
    store, master = cluster(tmp_path)
    last_idx = master.execute("c1", B, place())
    assert master.execute("c1", B, place()) == last_idx
    master.accept(C, [("e1", NodeTelemetryReported(node_id=C, telemetry=telemetry(4)))])
    assert master.execute("c1", B, place()) == store.state.last_idx == last_idx + 1
    assert len(store.state.instances) == 1


def test_a_rejected_command_indexes_nothing(tmp_path: Path) -> None:
    store, master = cluster(tmp_path)
    before = store.next_idx
    with pytest.raises(CommandRejected, match="no instance 'nope'") as info:
        master.execute("c1", B, DeleteInstance(instance_id=InstanceId("nope")))
    assert info.value.not_found
    with pytest.raises(CommandRejected, match="describes org/other"):
        master.execute("c2", B, place().model_copy(update={"card": sharded_card("org/other")}))
    assert store.next_idx == before


def test_accepted_events_are_deduplicated_by_id(tmp_path: Path) -> None:
    store, master = cluster(tmp_path)
    before = store.next_idx
    joined = NodeJoined(node_id=B, grpc_address=None, started_at_ms=1)
    assert master.accept(B, [("x:0", joined)]) == []
    assert master.accept(B, [("x:0", joined)]) == []
    assert store.next_idx == before + 1


RING = Instance(
    instance_id=InstanceId("ring"),
    model_id=M,
    ranks=(
        InstanceRank(node_id=B, start_layer=0, end_layer=2),
        InstanceRank(node_id=C, start_layer=2, end_layer=4),
    ),
    ring_hosts=("b:52500", "c:52500"),
)
ALONE = Instance(
    instance_id=InstanceId("alone"),
    model_id=M,
    ranks=(InstanceRank(node_id=B, start_layer=0, end_layer=4),),
)
MINE = {RING.instance_id: RING, ALONE.instance_id: ALONE}


@pytest.mark.parametrize(
    ("origin", "event", "allowed"),
    [
        (B, NodeJoined(node_id=B, grpc_address="b:1", started_at_ms=0), True),
        (B, NodeJoined(node_id=C, grpc_address="c:1", started_at_ms=0), False),
        (B, NodeTelemetryReported(node_id=B, telemetry=telemetry(8)), True),
        (B, NodeTelemetryReported(node_id=C, telemetry=telemetry(8)), False),
        (B, RunnerStatusChanged(instance_id=RING.instance_id, node_id=B, status="ready"), True),
        (B, RunnerStatusChanged(instance_id=RING.instance_id, node_id=C, status="failed"), False),
        (B, DownloadProgressed(node_id=B, progress=PROGRESS), True),
        (B, DownloadProgressed(node_id=C, progress=PROGRESS), False),
        (B, DownloadRemoved(node_id=B, model_id=M), True),
        (B, DownloadRemoved(node_id=C, model_id=M), False),
        (B, ModelFoldersUnreadable(node_id=B, folders=()), True),
        (B, ModelFoldersUnreadable(node_id=C, folders=()), False),
        (B, ModelCardPublished(card=CARD), True),
        (B, HistoryDiverged(node_id=B, set_aside=SET_ASIDE), True),
        (B, HistoryDiverged(node_id=C, set_aside=SET_ASIDE), False),
        (B, InstanceDeleted(instance_id=ALONE.instance_id), True),  # only B serves it
        (C, InstanceDeleted(instance_id=ALONE.instance_id), False),
        (B, InstanceDeleted(instance_id=RING.instance_id), False),  # C serves it too
        (B, InstanceDeleted(instance_id=InstanceId("gone")), True),  # nothing to delete
        (B, InstanceCreated(instance=ALONE), False),  # a command, decided by the master
        (B, NodeTimedOut(node_id=C), False),
        (B, NodeTimedOut(node_id=B), False),
        (B, MasterElected(master_id=B, term=9), False),
        (B, NodeUnreachable(node_id=C), False),  # the master's link says who it hears
        (B, NodeReachable(node_id=B), False),
        (B, NodeForgotten(node_id=C), False),  # a user's command
        (B, ModelUnplaced(model_id=M, unplaced=None), False),  # the master's duty
    ],
)
def test_what_a_node_may_originate(origin: NodeId, event: Event, allowed: bool) -> None:
    assert may_originate(State(instances=MINE), origin, event) is allowed


def test_events_a_node_may_not_originate_are_refused_returned_and_logged(tmp_path: Path) -> None:
    store, master = cluster(tmp_path)
    before = store.next_idx
    logged: list[str] = []
    sink = logger.add(logged.append, level="WARNING", format="{message}")
    try:
        refused = master.accept(
            B,
            [
                ("x:0", MasterElected(master_id=B, term=99)),
                ("x:1", NodeTelemetryReported(node_id=B, telemetry=telemetry(4))),
                ("x:2", NodeTimedOut(node_id=C)),
            ],
        )
    finally:
        logger.remove(sink)
    assert refused == [MasterElected(master_id=B, term=99), NodeTimedOut(node_id=C)]
    assert events_from(store, before) == [NodeTelemetryReported(node_id=B, telemetry=telemetry(4))]
    assert store.state.master_term == 1 and C in store.state.nodes
    assert len(logged) == 1
    assert "refused 2 event(s) from node b" in logged[0]
    assert "master_elected, node_timed_out" in logged[0]


@pytest.mark.parametrize(
    ("seen", "heard", "now", "expected"),
    [
        ({A: 0, B: 1000, C: 5000}, {}, 6000, [B]),
        ({A: 0, B: 1000, C: 5000}, {}, 20_000, [B, C]),
        ({A: 0, B: 1000}, {}, 3000, []),
        ({A: 0}, {}, 1_000_000, []),  # the master never times itself out
        # the link heard B lately: no events needed to stay
        ({A: 0, B: 1000, C: 5000}, {B: 5500}, 6000, []),
        ({A: 0, B: 1000, C: 5000}, {B: 5500}, 20_000, [B, C]),
    ],
)
def test_timed_out_nodes(
    seen: dict[NodeId, int], heard: dict[NodeId, int], now: int, expected: list[NodeId]
) -> None:
    state = State(
        nodes={
            n: NodeInfo(node_id=n, grpc_address=None, started_at_ms=0, last_seen_ms=t)
            for n, t in seen.items()
        }
    )
    assert timed_out_nodes(state, now, 4000, A, heard) == expected


def test_tend_times_out_silent_nodes_and_places_their_rings_again(tmp_path: Path) -> None:
    store, master = cluster(tmp_path, node_timeout_seconds=-1)  # everyone else is silent
    store.index(
        A, [("card", ModelCardPublished(card=CARD)), ("ring", InstanceCreated(instance=RING))]
    )
    master.tend()
    state = store.state
    assert set(state.nodes) == {A}
    [replaced] = state.instances.values()
    assert replaced.model_id == M and replaced.instance_id != "ring"
    assert replaced.node_ids == (A,)
    # The facts are in the log: a restarted master folds the same state.
    assert EventStore(A, EventLog.open(tmp_path / "events.log")).state == state


def test_it_places_only_on_the_nodes_the_link_hears(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    del heard[C]
    with pytest.raises(CommandRejected):
        master.execute(
            "c1", B, PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=3, card=CARD)
        )
    master.execute(
        "c2", B, PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, card=CARD)
    )
    assert set(store.state.instances[InstanceId("p")].node_ids) == {A, B}
    heard[C] = 0  # heard again: back in placement
    master.execute("c3", B, DeleteInstance(instance_id=InstanceId("p")))
    master.execute("c4", B, PlaceInstance(instance_id=InstanceId("q"), model_id=M, min_nodes=3))
    assert set(store.state.instances[InstanceId("q")].node_ids) == {A, B, C}


def test_a_node_the_link_lost_takes_its_rings_down_at_once(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)  # a node timeout of a minute
    master.execute(
        "c1",
        B,
        PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, max_nodes=2, card=CARD),
    )
    placed = store.state.instances[InstanceId("p")]
    lost = placed.node_ids[-1]
    master.tend()
    assert list(store.state.instances) == [InstanceId("p")]  # all heard: nothing to do
    del heard[lost]
    master.tend()
    state = store.state
    assert lost in state.nodes  # not timed out: only out of placement
    [again] = state.instances.values()
    assert again.instance_id != placed.instance_id
    assert lost not in again.node_ids
    assert len(again.ranks) == 2 and (again.min_nodes, again.max_nodes) == (2, 2)


def test_a_failed_rank_is_placed_again_after_a_grace_that_lets_the_link_drop_a_dead_node(
    tmp_path: Path,
) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    master.execute(
        "c1",
        B,
        PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, max_nodes=2, card=CARD),
    )
    placed = store.state.instances[InstanceId("p")]
    dead = placed.node_ids[-1]
    survivor = placed.node_ids[0]
    # The survivor's runner fails first: the ring lost its peer.
    failed = RunnerStatusChanged(instance_id=placed.instance_id, node_id=survivor, status="failed")
    master.accept(survivor, [("f", failed)])
    master._broken_grace_seconds = 60.0  # pyright: ignore[reportPrivateUsage]
    master.tend()
    assert list(store.state.instances) == [placed.instance_id]  # not yet: within the grace
    assert 0 < master._next_duty_seconds() <= 1  # pyright: ignore[reportPrivateUsage]
    # The link drops the dead node meanwhile: placed again without it, at once.
    del heard[dead]
    master.tend()
    [again] = store.state.instances.values()
    assert dead not in again.node_ids and len(again.ranks) == 2


def test_a_failed_rank_on_live_nodes_is_placed_again_once_the_grace_is_over(
    tmp_path: Path,
) -> None:
    store, master = cluster(tmp_path, heard={B: 0, C: 0})
    master.execute(
        "c1", B, PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, card=CARD)
    )
    placed = store.state.instances[InstanceId("p")]
    node = placed.node_ids[0]
    failed = RunnerStatusChanged(instance_id=placed.instance_id, node_id=node, status="failed")
    master.accept(node, [("f", failed)])
    master._broken_grace_seconds = 0.0  # pyright: ignore[reportPrivateUsage]
    master.tend()
    [again] = store.state.instances.values()
    assert again.instance_id != placed.instance_id and again.min_nodes == 2


def test_a_lone_rank_on_a_node_the_link_lost_is_placed_on_the_survivors(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    store.index(
        B, [("card", ModelCardPublished(card=CARD)), ("alone", InstanceCreated(instance=ALONE))]
    )
    master.tend()
    assert list(store.state.instances) == [ALONE.instance_id]  # all heard: nothing to do
    del heard[B]
    master.tend()
    [again] = store.state.instances.values()
    assert again.instance_id != ALONE.instance_id
    assert B not in again.node_ids and again.model_id == M


def test_a_lost_instance_whose_model_another_instance_serves_is_only_deleted(
    tmp_path: Path,
) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    on_c = Instance(
        instance_id=InstanceId("on-c"),
        model_id=M,
        ranks=(InstanceRank(node_id=C, start_layer=0, end_layer=4),),
    )
    store.index(
        B,
        [
            ("card", ModelCardPublished(card=CARD)),
            ("alone", InstanceCreated(instance=ALONE)),
            ("on-c", InstanceCreated(instance=on_c)),
        ],
    )
    del heard[B]
    master.tend()
    assert list(store.state.instances) == [on_c.instance_id]


def serve_alone_on_b(store: EventStore) -> None:
    """The model served by B alone, and no other node runs a worker: lost with
    B, it has nowhere to go until B is back."""
    no_worker = telemetry(8).model_copy(update={"accepts_instances": False})
    store.index(
        B,
        [
            ("card", ModelCardPublished(card=CARD)),
            ("alone", InstanceCreated(instance=ALONE)),
            ("no-worker-a", NodeTelemetryReported(node_id=A, telemetry=no_worker)),
            ("no-worker-c", NodeTelemetryReported(node_id=C, telemetry=no_worker)),
        ],
    )


def test_a_model_no_survivor_can_take_comes_back_with_its_node(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    serve_alone_on_b(store)
    del heard[B]  # B is frozen: no other node runs a worker
    master.tend()
    assert not store.state.instances  # deleted, and the placement again refused
    # The state says so, for every node to answer it as coming back.
    waiting = store.state.unplaced[M]
    assert waiting.instance == ALONE and not waiting.given_up
    assert "no node" in waiting.reason or "worker" in waiting.reason, waiting.reason
    master.tend()
    assert not store.state.instances
    assert store.state.unplaced[M].since_ms == waiting.since_ms  # one wait, not a new one
    heard[B] = 0  # heard again: the model is placed on it
    master.tend()
    [again] = store.state.instances.values()
    assert again.node_ids == (B,) and again.instance_id != ALONE.instance_id
    assert not store.state.unplaced
    master.tend()
    assert list(store.state.instances) == [again.instance_id]  # placed once


def test_another_master_places_a_model_the_last_one_left_unplaced(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    serve_alone_on_b(store)
    del heard[B]
    master.tend()
    assert M in store.state.unplaced
    master.leave_office()  # it dies; the next master has only the state
    successor = Master(store, node_timeout_seconds=60.0, duty_interval_seconds=1,
                       heard_ms=lambda: heard)  # fmt: skip
    successor.take_office()
    heard[B] = 0
    successor.tend()
    [again] = store.state.instances.values()
    assert again.node_ids == (B,) and not store.state.unplaced


def test_a_model_is_placed_again_after_every_node_loss(tmp_path: Path) -> None:
    """Lost nodes say nothing about the model: no limit on how often."""
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    master.execute(
        "c1", B, PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, card=CARD)
    )
    for _ in range(MAX_REPLACEMENTS + 2):
        [placed] = store.state.instances.values()
        for node in placed.node_ids:  # its runners served
            ready = RunnerStatusChanged(
                instance_id=placed.instance_id, node_id=node, status="ready"
            )
            store.index(node, [(f"ready-{placed.instance_id}-{node}", ready)])
        lost = next(n for n in placed.node_ids if n != A)
        del heard[lost]
        master.tend()
        [again] = store.state.instances.values()
        assert again.instance_id != placed.instance_id and lost not in again.node_ids
        heard[lost] = 0
    assert not store.state.unplaced


def test_a_model_whose_runners_fail_before_serving_is_given_up_on_after_the_limit(
    tmp_path: Path,
) -> None:
    store, master = cluster(tmp_path, heard={B: 0, C: 0})
    master._broken_grace_seconds = 0.0  # pyright: ignore[reportPrivateUsage]
    master.execute(
        "c1", B, PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, card=CARD)
    )
    for attempt in range(MAX_REPLACEMENTS + 1):
        [placed] = store.state.instances.values()
        node = placed.node_ids[0]
        failed = RunnerStatusChanged(
            instance_id=placed.instance_id, node_id=node, status="failed", error="out of memory"
        )
        master.accept(node, [(f"f{attempt}", failed)])
        master.tend()
    assert not store.state.instances
    stopped = store.state.unplaced[M]
    assert stopped.given_up
    assert f"failed before serving {MAX_REPLACEMENTS} times" in stopped.reason
    assert "out of memory" in stopped.reason
    master.tend()
    assert not store.state.instances  # not tried again
    # A placement by hand is the user's call: it ends the record.
    master.execute("c2", B, PlaceInstance(instance_id=InstanceId("q"), model_id=M, card=CARD))
    assert not store.state.unplaced


def test_a_model_no_node_can_take_is_given_up_on_after_the_window_and_forgotten_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [now_ms()]
    monkeypatch.setattr(master_module, "now_ms", lambda: clock[0])
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    serve_alone_on_b(store)
    del heard[B]
    master.tend()
    assert not store.state.unplaced[M].given_up
    clock[0] += int(WINDOW_SECONDS * 1000)
    master.tend()
    stopped = store.state.unplaced[M]
    assert stopped.given_up and "no node could take it for 10 minutes" in stopped.reason
    heard[B] = 0
    master.tend()
    assert not store.state.instances  # given up: not placed, though a node could take it now
    clock[0] += int(GAVE_UP_SHOWN_SECONDS * 1000)
    master.tend()
    assert not store.state.unplaced


def _marked(**unreachable: int | None) -> State:
    return State(
        nodes={
            NodeId(n): NodeInfo(
                node_id=NodeId(n), grpc_address=None, started_at_ms=0, last_seen_ms=0,
                unreachable_since_ms=since,
            )
            for n, since in unreachable.items()
        }
    )  # fmt: skip


@pytest.mark.parametrize(
    ("state", "reachable", "expected"),
    [
        (_marked(a=None, b=None), {A, B}, []),
        (_marked(a=None, b=None), {A}, [NodeUnreachable(node_id=B, last_heard_ms=40)]),
        (_marked(a=None, c=None), {A}, [NodeUnreachable(node_id=C, last_heard_ms=None)]),
        (_marked(a=None, b=7), {A}, []),  # already marked: not again
        (_marked(a=None, b=7), {A, B}, [NodeReachable(node_id=B)]),
        (
            _marked(a=None, b=7, c=None),
            {A, B},
            [NodeReachable(node_id=B), NodeUnreachable(node_id=C, last_heard_ms=None)],
        ),
    ],
)
def test_reachability_changes(state: State, reachable: set[NodeId], expected: list[Event]) -> None:
    assert reachability_changes(state, reachable, {B: 40}) == expected


def test_a_node_the_link_loses_is_unreachable_in_the_state_at_once_and_reachable_again(
    tmp_path: Path,
) -> None:
    heard = {B: 1_000, C: 1_000}
    store, master = cluster(tmp_path, heard=heard)
    master.tend()
    assert all(n.unreachable_since_ms is None for n in store.state.nodes.values())
    del heard[C]
    master.tend()
    lost = store.state.nodes[C]
    assert lost.unreachable_since_ms is not None and lost.last_heartbeat_ms == 1_000
    master.tend()  # told once
    kinds = [e.kind for e in events_from(store, 0)]
    assert kinds.count("node_unreachable") == 1
    heard[C] = 2_000
    master.tend()
    assert store.state.nodes[C].unreachable_since_ms is None
    assert [e.kind for e in events_from(store, 0)].count("node_reachable") == 1


def test_an_instance_placed_again_says_where_from_and_why(tmp_path: Path) -> None:
    heard = {B: 0, C: 0}
    store, master = cluster(tmp_path, heard=heard)
    master.execute(
        "c1",
        B,
        PlaceInstance(instance_id=InstanceId("p"), model_id=M, min_nodes=2, max_nodes=2, card=CARD),
    )
    placed = store.state.instances[InstanceId("p")]
    lost = placed.node_ids[-1]
    del heard[lost]
    master.tend()
    [again] = store.state.instances.values()
    assert again.moved == Relocation(from_nodes=(lost,), reason="node_lost")


def test_a_node_the_link_just_dropped_is_timed_out_from_its_last_heartbeat(
    tmp_path: Path,
) -> None:
    """Its events may be old (an idle node publishes none): the link's last word
    on it counts, though the link no longer lists it."""
    later = now_ms() + 60_000  # heard "later" than its last event, by far
    heard = {B: later, C: later}
    store, master = cluster(tmp_path, node_timeout_seconds=0.05, heard=heard)
    master.tend()
    del heard[C]
    time.sleep(0.1)  # its last event is older than the node timeout now
    master.tend()
    assert C in store.state.nodes, "timed out by its old events"
    assert store.state.nodes[C].unreachable_since_ms is not None
    assert store.state.nodes[C].last_heartbeat_ms == later


def test_timed_out_nodes_counts_the_heartbeat_the_state_recorded() -> None:
    lost = NodeInfo(
        node_id=B, grpc_address=None, started_at_ms=0, last_seen_ms=0, last_heartbeat_ms=9_000
    )
    state = State(nodes={B: lost})
    assert timed_out_nodes(state, 10_000, 4_000, A, {}) == []
    assert timed_out_nodes(state, 14_000, 4_000, A, {}) == [B]
