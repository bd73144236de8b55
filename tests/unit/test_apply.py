"""`apply` is pure and total: one table row per situation, every event kind."""

from functools import reduce

import pytest

from exo.shared.apply import apply
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.events import (
    DownloadProgressed,
    DownloadRemoved,
    Event,
    HistoryDiverged,
    IndexedEvent,
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
    indexed_event_adapter,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import (
    HistorySetAside,
    Instance,
    InstanceRank,
    InstanceStatus,
    NodeInfo,
    NodeTelemetry,
    RunnerInfo,
    State,
    UnplacedModel,
    UnreadableModelFolder,
)
from tests.unit.sharded_card import sharded_card

A, B, C = NodeId("node-a"), NodeId("node-b"), NodeId("node-c")
GHOST = NodeId("ghost")
I1, I2, I3 = InstanceId("inst-1"), InstanceId("inst-2"), InstanceId("inst-3")
MODEL = ModelId("SmolLM2-135M-Instruct")
BIG = ModelId("org/big")
TELEMETRY = NodeTelemetry(
    ram_total=24 << 30, ram_available=20 << 30, disk_free=50 << 30, cpu_count=2,
    platform="linux", mlx_backend="cpu",
)  # fmt: skip
CARD = sharded_card(MODEL)
BIG_CARD = sharded_card(BIG)
BROKEN = UnreadableModelFolder(path="/models/org--broken", reason="ModelCardError: 0 layers")


def node(
    node_id: NodeId, seen: int = 100, telemetry: NodeTelemetry | None = None, **more: object
) -> NodeInfo:
    return NodeInfo.model_validate(dict(
        node_id=node_id, grpc_address=f"{node_id}:52414", started_at_ms=1, telemetry=telemetry,
        last_seen_ms=seen, **more,
    ))  # fmt: skip


def inst(instance_id: InstanceId, *node_ids: NodeId, model_id: ModelId = MODEL) -> Instance:
    """An instance with one rank per node, 4 layers split evenly-ish in node order."""
    bounds = [i * 4 // len(node_ids) for i in range(len(node_ids) + 1)]
    ranks = tuple(
        InstanceRank(node_id=n, start_layer=bounds[i], end_layer=bounds[i + 1])
        for i, n in enumerate(node_ids)
    )
    return Instance(instance_id=instance_id, model_id=model_id, ranks=ranks)


def runner(
    instance_id: InstanceId,
    node_id: NodeId,
    status: RunnerStatus,
    error: str | None = None,
    served: bool | None = None,
) -> RunnerInfo:
    """A runner as `apply` records it; `served` defaults to what this status alone says."""
    return RunnerInfo(
        instance_id=instance_id,
        node_id=node_id,
        status=status,
        error=error,
        served=status in ("ready", "running") if served is None else served,
    )


def progress(
    model_id: ModelId, status: str = "complete", have: tuple[str, ...] = ()
) -> DownloadProgress:
    return DownloadProgress.model_validate(
        {"model_id": model_id, "status": status, "files_total": 5, "files_done": len(have),
         "bytes_total": 10, "bytes_done": 10 if status == "complete" else 1, "have_files": have}
    )  # fmt: skip


# I1 on A alone, I2 on B alone, I3 over A (layers 0-2) and B (layers 2-4).
BASE = State(
    nodes={A: node(A), B: node(B)},
    instances={I1: inst(I1, A), I2: inst(I2, B), I3: inst(I3, A, B, model_id=BIG)},
    runners={
        I1: {A: runner(I1, A, "ready")},
        I2: {B: runner(I2, B, "loading")},
        I3: {A: runner(I3, A, "ready"), B: runner(I3, B, "loading")},
    },
    downloads={
        A: {MODEL: progress(MODEL), BIG: progress(BIG, "downloading")},
        B: {BIG: progress(BIG)},
    },
    cards={MODEL: CARD},
    unreadable_models={B: (BROKEN,)},
    master_id=A,
    master_term=3,
    last_idx=9,
)
# BIG's instance I3 lost, and no node could take the model again.
UNPLACED_BIG = UnplacedModel(
    instance=inst(I3, A, B, model_id=BIG), since_ms=150, reason="no node has room for it"
)
# BASE's nodes once an event from A (at 200) was applied.
SEEN_A = {A: node(A, seen=200), B: node(B)}
# BASE with C timed out at 50, and with B lost by the master's link at 200.
GONE_C = BASE.model_copy(update={"gone_nodes": {C: node(C, timed_out_at_ms=50)}})
LOST_B = BASE.model_copy(
    update={"nodes": {**BASE.nodes, B: node(B, last_heartbeat_ms=150, unreachable_since_ms=200)}}
)


SET_ASIDE = HistorySetAside(at_ms=190, from_idx=7, events=3, kept_as="events.log.diverged-190")


def ev(event: Event, origin: NodeId = A, at_ms: int = 200) -> IndexedEvent:
    return IndexedEvent(idx=10, at_ms=at_ms, origin=origin, event=event)


def with_(state: State, **update: object) -> State:
    return state.model_copy(update={"last_idx": 10, **update})


# (name, event, expected, the state before when not BASE)
CASES: list[tuple[str, IndexedEvent, State] | tuple[str, IndexedEvent, State, State]] = [
    (
        "a new node joins",
        ev(NodeJoined(node_id=C, grpc_address="c:1", started_at_ms=5), C),
        with_(BASE, nodes={**BASE.nodes, C: NodeInfo(
            node_id=C, grpc_address="c:1", started_at_ms=5, last_seen_ms=200)}),
    ),
    (
        "a known node rejoins with a new address",
        ev(NodeJoined(node_id=B, grpc_address="b2:1", started_at_ms=7), A),
        with_(BASE, nodes={A: node(A, seen=200), B: NodeInfo(
            node_id=B, grpc_address="b2:1", started_at_ms=7, last_seen_ms=200)}),
    ),
    (
        "telemetry of a known node",
        ev(NodeTelemetryReported(node_id=B, telemetry=TELEMETRY), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200, telemetry=TELEMETRY)}),
    ),
    (
        "telemetry of an unknown node is ignored",
        ev(NodeTelemetryReported(node_id=GHOST, telemetry=TELEMETRY), GHOST),
        with_(BASE),
    ),
    (
        "a timed-out node leaves with every instance it has a rank of, their runners, "
        "its downloads and its unreadable folders",
        ev(NodeTimedOut(node_id=B)),
        with_(BASE, nodes={A: node(A, seen=200)}, gone_nodes={B: node(B, timed_out_at_ms=200)},
              instances={I1: inst(I1, A)},
              runners={I1: BASE.runners[I1]}, downloads={A: BASE.downloads[A]},
              unreadable_models={}),
    ),
    (
        "the master timing out clears the master and the multi-rank instance it was in",
        ev(NodeTimedOut(node_id=A), B),
        with_(BASE, nodes={B: node(B, seen=200)}, gone_nodes={A: node(A, timed_out_at_ms=200)},
              instances={I2: inst(I2, B)},
              runners={I2: BASE.runners[I2]}, downloads={B: BASE.downloads[B]}, master_id=None),
    ),
    (
        "a node that timed out joins again: it is no longer gone, its host name is kept",
        ev(NodeJoined(node_id=C, grpc_address="c:1", started_at_ms=5, hostname="studio"), C),
        with_(GONE_C, nodes={**BASE.nodes, C: NodeInfo(
            node_id=C, grpc_address="c:1", started_at_ms=5, hostname="studio",
            last_seen_ms=200)}, gone_nodes={}),
        GONE_C,
    ),
    (
        "the master's link lost a node: unreachable since now, its last heartbeat kept",
        ev(NodeUnreachable(node_id=B, last_heard_ms=150)),
        with_(BASE, nodes={A: node(A, seen=200),
                           B: node(B, last_heartbeat_ms=150, unreachable_since_ms=200)}),
    ),
    (
        "a node lost again keeps when it was first lost and its newest heartbeat",
        ev(NodeUnreachable(node_id=B, last_heard_ms=120), at_ms=300),
        with_(LOST_B, nodes={A: node(A, seen=300),
                             B: node(B, last_heartbeat_ms=150, unreachable_since_ms=200)}),
        LOST_B,
    ),
    (
        "a node lost without a heartbeat heard",
        ev(NodeUnreachable(node_id=B)),
        with_(BASE, nodes={A: node(A, seen=200), B: node(B, unreachable_since_ms=200)}),
    ),
    (
        "an unknown node lost changes nothing",
        ev(NodeUnreachable(node_id=GHOST, last_heard_ms=150)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a node heard again is reachable, heard when the master said so",
        ev(NodeReachable(node_id=B), at_ms=300),
        with_(LOST_B, nodes={A: node(A, seen=300), B: node(B, last_heartbeat_ms=300)}),
        LOST_B,
    ),
    (
        "a reachable node heard again changes nothing",
        ev(NodeReachable(node_id=B)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a node that rejoins while unreachable stays so until the master hears it",
        ev(NodeJoined(node_id=B, grpc_address="b2:1", started_at_ms=7), B, at_ms=300),
        with_(LOST_B, nodes={A: node(A), B: NodeInfo(
            node_id=B, grpc_address="b2:1", started_at_ms=7, last_seen_ms=300,
            last_heartbeat_ms=150, unreachable_since_ms=200)}),
        LOST_B,
    ),
    (
        "a user forgets a node that timed out",
        ev(NodeForgotten(node_id=C)),
        with_(GONE_C, nodes=SEEN_A, gone_nodes={}),
        GONE_C,
    ),
    (
        "forgetting a node that is not gone changes nothing",
        ev(NodeForgotten(node_id=B)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "timing out an unknown node changes nothing",
        ev(NodeTimedOut(node_id=GHOST)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a newer election",
        ev(MasterElected(master_id=B, term=4)),
        with_(BASE, nodes=SEEN_A, master_id=B, master_term=4),
    ),
    (
        "a stale election result is ignored",
        ev(MasterElected(master_id=B, term=2)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "an instance is created on a known node",
        ev(InstanceCreated(instance=inst(InstanceId("inst-4"), B))),
        with_(BASE, nodes=SEEN_A,
              instances={**BASE.instances, InstanceId("inst-4"): inst(InstanceId("inst-4"), B)}),
    ),
    (
        "a multi-rank instance is created on known nodes",
        ev(InstanceCreated(instance=inst(InstanceId("inst-4"), B, A))),
        with_(BASE, nodes=SEEN_A,
              instances={**BASE.instances,
                         InstanceId("inst-4"): inst(InstanceId("inst-4"), B, A)}),
    ),
    (
        "an instance on an unknown node is ignored",
        ev(InstanceCreated(instance=inst(InstanceId("inst-4"), GHOST))),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a multi-rank instance with one unknown node is ignored",
        ev(InstanceCreated(instance=inst(InstanceId("inst-4"), A, GHOST))),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "an instance is deleted with its runner",
        ev(InstanceDeleted(instance_id=I2)),
        with_(BASE, nodes=SEEN_A, instances={I1: BASE.instances[I1], I3: BASE.instances[I3]},
              runners={I1: BASE.runners[I1], I3: BASE.runners[I3]}),
    ),
    (
        "a multi-rank instance is deleted with the runners of all its ranks",
        ev(InstanceDeleted(instance_id=I3)),
        with_(BASE, nodes=SEEN_A, instances={I1: BASE.instances[I1], I2: BASE.instances[I2]},
              runners={I1: BASE.runners[I1], I2: BASE.runners[I2]}),
    ),
    (
        "deleting an unknown instance changes nothing",
        ev(InstanceDeleted(instance_id=InstanceId("nope"))),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a runner reports its status",
        ev(RunnerStatusChanged(instance_id=I2, node_id=B, status="failed", error="boom"), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200)}, runners={
            **BASE.runners, I2: {B: runner(I2, B, "failed", "boom")}}),
    ),
    (
        "one rank's runner changes, the other rank's is kept",
        ev(RunnerStatusChanged(instance_id=I3, node_id=B, status="ready"), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200)}, runners={
            **BASE.runners, I3: {A: runner(I3, A, "ready"), B: runner(I3, B, "ready")}}),
    ),
    (
        "the first runner of a rank is added next to the others",
        ev(RunnerStatusChanged(instance_id=I3, node_id=A, status="running")),
        with_(BASE, nodes=SEEN_A, runners={
            **BASE.runners, I3: {A: runner(I3, A, "running"), B: runner(I3, B, "loading")}}),
    ),
    (
        "a runner status from a node that is not a rank of the instance is ignored",
        ev(RunnerStatusChanged(instance_id=I2, node_id=A, status="ready")),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a runner status for an unknown instance is ignored",
        ev(RunnerStatusChanged(instance_id=InstanceId("nope"), node_id=A, status="ready")),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a runner that had served keeps the mark when it fails",
        ev(RunnerStatusChanged(instance_id=I1, node_id=A, status="failed", error="killed")),
        with_(BASE, nodes=SEEN_A, runners={
            **BASE.runners, I1: {A: runner(I1, A, "failed", "killed", served=True)}}),
    ),
    (
        "a model left unplaced is recorded",
        ev(ModelUnplaced(model_id=BIG, unplaced=UNPLACED_BIG)),
        with_(BASE, nodes=SEEN_A, unplaced={BIG: UNPLACED_BIG}),
    ),
    (
        "a model no longer waiting for a placement is dropped",
        ev(ModelUnplaced(model_id=BIG, unplaced=None)),
        with_(BASE, nodes=SEEN_A),
        BASE.model_copy(update={"unplaced": {BIG: UNPLACED_BIG}}),
    ),
    (
        "a new instance of an unplaced model ends its wait",
        ev(InstanceCreated(instance=inst(InstanceId("inst-4"), B, model_id=BIG))),
        with_(BASE, nodes=SEEN_A, instances={
            **BASE.instances, InstanceId("inst-4"): inst(InstanceId("inst-4"), B, model_id=BIG)}),
        BASE.model_copy(update={"unplaced": {BIG: UNPLACED_BIG}}),
    ),
    (
        "a card of a new model",
        ev(ModelCardPublished(card=BIG_CARD)),
        with_(BASE, nodes=SEEN_A, cards={MODEL: CARD, BIG: BIG_CARD}),
    ),
    (
        "a newer card replaces the model's card",
        ev(ModelCardPublished(card=sharded_card(MODEL, context_length=8192))),
        with_(BASE, nodes=SEEN_A, cards={MODEL: sharded_card(MODEL, context_length=8192)}),
    ),
    (
        "download progress of a new model on a node",
        ev(DownloadProgressed(node_id=B, progress=progress(MODEL, "downloading", ("config.json",))), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200)}, downloads={
            A: BASE.downloads[A],
            B: {BIG: progress(BIG), MODEL: progress(MODEL, "downloading", ("config.json",))}}),
    ),
    (
        "download progress replaces the node's earlier progress of the model",
        ev(DownloadProgressed(node_id=A, progress=progress(BIG, "failed"))),
        with_(BASE, nodes=SEEN_A, downloads={
            A: {MODEL: progress(MODEL), BIG: progress(BIG, "failed")}, B: BASE.downloads[B]}),
    ),
    (
        "download progress of an unknown node is ignored",
        ev(DownloadProgressed(node_id=GHOST, progress=progress(MODEL))),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a removed download leaves the node's other models",
        ev(DownloadRemoved(node_id=A, model_id=MODEL)),
        with_(BASE, nodes=SEEN_A, downloads={A: {BIG: BASE.downloads[A][BIG]},
                                             B: BASE.downloads[B]}),
    ),
    (
        "removing a node's last download drops the node from downloads",
        ev(DownloadRemoved(node_id=B, model_id=BIG)),
        with_(BASE, nodes=SEEN_A, downloads={A: BASE.downloads[A]}),
    ),
    (
        "removing a model the node does not have changes nothing",
        ev(DownloadRemoved(node_id=B, model_id=MODEL)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "removing a download of a node without downloads changes nothing",
        ev(DownloadRemoved(node_id=GHOST, model_id=MODEL)),
        with_(BASE, nodes=SEEN_A),
    ),
    (
        "a node's unreadable model folders",
        ev(ModelFoldersUnreadable(node_id=A, folders=(BROKEN,))),
        with_(BASE, nodes=SEEN_A, unreadable_models={B: (BROKEN,), A: (BROKEN,)}),
    ),
    (
        "a report of no unreadable folders clears the node's",
        ev(ModelFoldersUnreadable(node_id=B, folders=()), B),
        with_(BASE, nodes={A: node(A), B: node(B, seen=200)}, unreadable_models={}),
    ),
    (
        "unreadable folders of an unknown node are ignored",
        ev(ModelFoldersUnreadable(node_id=GHOST, folders=(BROKEN,)), GHOST),
        with_(BASE),
    ),
    (
        "a node reports the history it set aside (even one that timed out)",
        ev(HistoryDiverged(node_id=C, set_aside=SET_ASIDE), C),
        with_(BASE, set_aside={C: SET_ASIDE}),
    ),
    (
        "a later report replaces the node's earlier one",
        ev(HistoryDiverged(node_id=C, set_aside=SET_ASIDE), C),
        with_(BASE, set_aside={C: SET_ASIDE}),
        BASE.model_copy(update={"set_aside": {C: SET_ASIDE.model_copy(update={"at_ms": 1})}}),
    ),
    (
        "an event from an unknown origin only advances the index",
        ev(MasterElected(master_id=A, term=3), GHOST),
        with_(BASE),
    ),
    (
        "an older timestamp does not move last_seen back",
        ev(MasterElected(master_id=A, term=3), A, at_ms=50),
        with_(BASE),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "event", "expected", "start"),
    [(*c[:3], c[3] if len(c) == 4 else BASE) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_apply(name: str, event: IndexedEvent, expected: State, start: State) -> None:
    before = start.model_dump()
    assert apply(start, event) == expected
    assert start.model_dump() == before  # pure: the input state is untouched


def test_every_event_kind_has_a_case() -> None:
    kinds = {case[1].event.kind for case in CASES}
    all_kinds = {
        cls.model_fields["kind"].default
        for cls in (NodeJoined, NodeTelemetryReported, NodeTimedOut, NodeUnreachable,
                    NodeReachable, NodeForgotten, MasterElected,
                    InstanceCreated, InstanceDeleted, RunnerStatusChanged, ModelCardPublished,
                    DownloadProgressed, DownloadRemoved, ModelFoldersUnreadable, HistoryDiverged,
                    ModelUnplaced)
    }  # fmt: skip
    assert kinds == all_kinds


def test_first_download_progress_of_a_known_node_without_downloads() -> None:
    start = BASE.model_copy(update={"nodes": {**BASE.nodes, C: node(C)}})
    after = apply(start, ev(DownloadProgressed(node_id=C, progress=progress(MODEL)), C))
    assert after.downloads == {**BASE.downloads, C: {MODEL: progress(MODEL)}}


def test_a_timed_out_node_keeps_other_nodes_runners_of_surviving_instances() -> None:
    # C serves I4 alone; B timing out removes I2 and I3 (rank 1 on B) but not I4.
    i4 = inst(InstanceId("inst-4"), C)
    start = BASE.model_copy(
        update={
            "nodes": {**BASE.nodes, C: node(C)},
            "instances": {**BASE.instances, i4.instance_id: i4},
            "runners": {**BASE.runners, i4.instance_id: {C: runner(i4.instance_id, C, "ready")}},
        }
    )
    after = apply(start, ev(NodeTimedOut(node_id=B)))
    assert set(after.instances) == {I1, i4.instance_id}
    assert set(after.runners) == {I1, i4.instance_id}
    assert set(after.downloads) == {A}
    assert after.cards == BASE.cards  # cards describe models, not nodes: they stay


def test_fold_of_the_same_events_is_the_same_state_after_serialization() -> None:
    """Nodes rebuild state from events read off the wire: JSON round trips agree."""
    two = inst(I2, A, B, model_id=BIG)
    events = [
        IndexedEvent(idx=0, at_ms=1, origin=A, event=NodeJoined(node_id=A, grpc_address="a:1", started_at_ms=1)),
        IndexedEvent(idx=1, at_ms=2, origin=A, event=MasterElected(master_id=A, term=1)),
        IndexedEvent(idx=2, at_ms=3, origin=B, event=NodeJoined(node_id=B, grpc_address="b:1", started_at_ms=2)),
        IndexedEvent(idx=3, at_ms=4, origin=B, event=NodeTelemetryReported(node_id=B, telemetry=TELEMETRY)),
        IndexedEvent(idx=4, at_ms=5, origin=A, event=InstanceCreated(instance=inst(I1, B))),
        IndexedEvent(idx=5, at_ms=6, origin=B, event=RunnerStatusChanged(instance_id=I1, node_id=B, status="ready")),
        IndexedEvent(idx=6, at_ms=7, origin=A, event=ModelCardPublished(card=BIG_CARD)),
        IndexedEvent(idx=7, at_ms=8, origin=B, event=DownloadProgressed(node_id=B, progress=progress(BIG, have=("config.json",)))),
        IndexedEvent(idx=8, at_ms=9, origin=A, event=InstanceCreated(instance=two)),
        IndexedEvent(idx=9, at_ms=10, origin=A, event=RunnerStatusChanged(instance_id=I2, node_id=A, status="loading")),
        IndexedEvent(idx=10, at_ms=11, origin=B, event=RunnerStatusChanged(instance_id=I2, node_id=B, status="ready")),
        IndexedEvent(idx=11, at_ms=12, origin=A, event=DownloadRemoved(node_id=A, model_id=BIG)),
    ]  # fmt: skip
    direct = reduce(apply, events, State())
    wire = [indexed_event_adapter.validate_json(indexed_event_adapter.dump_json(e)) for e in events]
    assert reduce(apply, wire, State()) == direct
    assert direct.last_idx == 11
    assert direct.runners[I1] == {B: runner(I1, B, "ready")}
    assert direct.runners[I2] == {A: runner(I2, A, "loading"), B: runner(I2, B, "ready")}
    assert direct.nodes[B].telemetry == TELEMETRY
    assert direct.cards == {BIG: BIG_CARD}
    assert direct.downloads == {B: {BIG: progress(BIG, have=("config.json",))}}
    assert direct.instances[I2].ring_hosts == ()
    assert State.model_validate_json(direct.model_dump_json()) == direct


def test_a_rejoining_node_keeps_its_telemetry() -> None:
    start = BASE.model_copy(update={"nodes": {**BASE.nodes, B: node(B, telemetry=TELEMETRY)}})
    after = apply(start, ev(NodeJoined(node_id=B, grpc_address="b2:1", started_at_ms=7), B))
    assert after.nodes[B].telemetry == TELEMETRY
    assert after.nodes[B].grpc_address == "b2:1"


# --- State.instance_status -------------------------------------------------------

TWO = inst(I1, A, B)
THREE = inst(I1, A, B, C)


@pytest.mark.parametrize(
    ("instance", "statuses", "expected"),
    [
        (inst(I1, A), {}, "downloading"),
        (inst(I1, A), {A: "starting"}, "starting"),
        (inst(I1, A), {A: "loading"}, "loading"),
        (inst(I1, A), {A: "ready"}, "ready"),
        (inst(I1, A), {A: "running"}, "running"),
        (inst(I1, A), {A: "failed"}, "failed"),
        (inst(I1, A), {A: "stopped"}, "failed"),
        # A rank whose node has no runner yet is still fetching its files.
        (TWO, {A: "ready"}, "downloading"),
        (TWO, {B: "running"}, "downloading"),
        (THREE, {A: "ready", B: "ready"}, "downloading"),
        # Any failed or stopped rank fails the instance, whatever the others do.
        (TWO, {A: "ready", B: "failed"}, "failed"),
        (TWO, {A: "stopped", B: "running"}, "failed"),
        (TWO, {A: "failed"}, "failed"),
        # The least advanced rank decides.
        (TWO, {A: "starting", B: "ready"}, "starting"),
        (TWO, {A: "loading", B: "starting"}, "starting"),
        (TWO, {A: "ready", B: "loading"}, "loading"),
        (THREE, {A: "ready", B: "ready", C: "loading"}, "loading"),
        (TWO, {A: "running", B: "loading"}, "loading"),
        # Ready only when every rank is; running when one serves and the rest are ready.
        (TWO, {A: "ready", B: "ready"}, "ready"),
        (THREE, {A: "ready", B: "ready", C: "ready"}, "ready"),
        (TWO, {A: "running", B: "ready"}, "running"),
        (TWO, {A: "running", B: "running"}, "running"),
    ],
)
def test_instance_status(
    instance: Instance, statuses: dict[NodeId, RunnerStatus], expected: InstanceStatus
) -> None:
    state = State(
        instances={instance.instance_id: instance},
        runners={
            instance.instance_id: {
                n: runner(instance.instance_id, n, s) for n, s in statuses.items()
            }
        },
    )
    assert state.instance_status(instance) == expected


def test_instance_status_ignores_runners_of_nodes_without_a_rank() -> None:
    # A runner entry for a node that is not a rank cannot stand in for a missing rank.
    state = State(
        instances={TWO.instance_id: TWO},
        runners={TWO.instance_id: {A: runner(I1, A, "ready"), C: runner(I1, C, "ready")}},
    )
    assert state.instance_status(TWO) == "downloading"
