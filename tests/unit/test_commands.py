"""`decide`: rank checks, ring ports, placement through PlaceInstance."""

import re

import pytest

from exo.master.commands import RING_BASE_PORT, RING_PORT_SPAN, decide
from exo.master.placement import PlacementError, PlacementRequest, place
from exo.shared.types.commands import (
    Command,
    CommandRejected,
    CreateInstance,
    DeleteInstance,
    PlaceInstance,
)
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.events import InstanceCreated, InstanceDeleted, ModelCardPublished
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, InstanceRank, NodeInfo, NodeTelemetry, State
from tests.unit.sharded_card import GB, SIZES, sharded_card

# A and C run on the same machine (10.0.0.1); D has no cluster link.
A, B, C, D, E = NodeId("a"), NodeId("b"), NodeId("c"), NodeId("d"), NodeId("e")
V6 = NodeId("v6")
ADDRESSES: dict[NodeId, str | None] = {
    A: "10.0.0.1:52414",
    B: "10.0.0.2:52414",
    C: "10.0.0.1:52415",
    D: None,
    E: "10.0.0.3:52414",
    V6: "[fd00::1]:52414",
}
M = ModelId("org/m")  # has a card: 4 layers
OTHER = ModelId("org/other")  # has a card: 4 layers
NO_CARD = ModelId("org/no-card")
CARD = sharded_card(M)


def rank(node_id: NodeId, start: int, end: int) -> InstanceRank:
    return InstanceRank(node_id=node_id, start_layer=start, end_layer=end)


def node(node_id: NodeId, ram_gb: float | None = None) -> NodeInfo:
    telemetry = (
        None
        if ram_gb is None
        else NodeTelemetry(
            ram_total=int(ram_gb * GB), ram_available=int(ram_gb * GB), disk_free=100 * GB,
            cpu_count=8, platform="darwin", mlx_backend="metal",
        )
    )  # fmt: skip
    return NodeInfo(
        node_id=node_id, grpc_address=ADDRESSES.get(node_id, f"{node_id}:52414"),
        started_at_ms=0, telemetry=telemetry, last_seen_ms=0,
    )  # fmt: skip


# M is served by A alone; OTHER by A and B over a ring (port 52500 on both hosts).
EXISTING = Instance(instance_id=InstanceId("i1"), model_id=M, ranks=(rank(A, 0, 4),))
RING = Instance(
    instance_id=InstanceId("i2"),
    model_id=OTHER,
    ranks=(rank(A, 0, 2), rank(B, 2, 4)),
    ring_hosts=(f"10.0.0.1:{RING_BASE_PORT}", f"10.0.0.2:{RING_BASE_PORT}"),
)
STATE = State(
    nodes={n: node(n) for n in ADDRESSES},
    instances={EXISTING.instance_id: EXISTING, RING.instance_id: RING},
    cards={M: CARD, OTHER: sharded_card(OTHER)},
)


def create(model_id: ModelId, *ranks: InstanceRank, instance_id: str = "new") -> CreateInstance:
    return CreateInstance(instance_id=InstanceId(instance_id), model_id=model_id, ranks=ranks)


def tensor(model_id: ModelId, *ranks: InstanceRank) -> CreateInstance:
    return create(model_id, *ranks).model_copy(update={"sharding": "tensor"})


def test_create_on_a_known_node() -> None:
    [event] = decide(STATE, create(M, rank(B, 0, 4)))
    assert event == InstanceCreated(
        instance=Instance(instance_id=InstanceId("new"), model_id=M, ranks=(rank(B, 0, 4),))
    )


@pytest.mark.parametrize(
    "command",
    [
        create(M, rank(A, 0, 4), instance_id="i1"),
        create(M, rank(B, 0, 4), instance_id="i1"),  # even with other ranks
        create(OTHER, rank(A, 0, 2), rank(B, 2, 4), instance_id="i2"),
        PlaceInstance(instance_id=InstanceId("i1"), model_id=M),
    ],
)
def test_a_retried_command_is_a_no_op(command: Command) -> None:
    assert decide(STATE, command) == []


@pytest.mark.parametrize(
    ("command", "message", "not_found"),
    [
        (create(M, rank(NodeId("ghost"), 0, 4)), "no node 'ghost'", True),
        (create(M, rank(B, 0, 2), rank(NodeId("ghost"), 2, 4)), "no node 'ghost'", True),
        (create(M, rank(B, 0, 2), rank(B, 2, 4)), "only one rank of an instance", False),
        (create(M, rank(B, 0, 1), rank(E, 1, 3), rank(B, 3, 4)), "only one rank", False),
        # gaps, overlaps, out of order, empty ranges
        (create(M, rank(B, 0, 2), rank(E, 3, 4)), "without gaps: b[0,2), e[3,4)", False),
        (create(M, rank(B, 0, 3), rank(E, 2, 4)), "without gaps: b[0,3), e[2,4)", False),
        (create(M, rank(B, 1, 4)), "without gaps", False),
        (create(M, rank(B, 2, 4), rank(E, 0, 2)), "without gaps", False),
        (create(M, rank(B, 0, 0), rank(E, 0, 4)), "without gaps", False),
        (create(NO_CARD, rank(B, 0, 2), rank(E, 1, 4)), "without gaps", False),
        # the card's layer count
        (create(M, rank(B, 0, 3)), "org/m has 4 layers, the ranks cover 3", False),
        (create(M, rank(B, 0, 2), rank(E, 2, 5)), "org/m has 4 layers, the ranks cover 5", False),
        # one instance of a model per node
        (create(M, rank(A, 0, 4)), "org/m already has an instance on a (instance i1)", False),
        (create(M, rank(B, 0, 2), rank(A, 2, 4)), "org/m already has an instance on a", False),
        (create(OTHER, rank(B, 0, 4)), "org/other already has an instance on a, b", False),
        # a ring needs every rank's address
        (create(M, rank(B, 0, 2), rank(D, 2, 4)), "node d has no cluster address", False),
        (DeleteInstance(instance_id=InstanceId("nope")), "no instance 'nope'", True),
        # every tensor rank holds all layers; two ranks at least; heads that divide
        (tensor(M, rank(B, 0, 4)), "a tensor instance needs at least 2 ranks, not 1", False),
        (
            tensor(M, rank(B, 0, 2), rank(E, 2, 4)),
            "every rank of a tensor instance holds all 4 layers of org/m, [0,4): b[0,2), e[2,4)",
            False,
        ),
        (tensor(M, rank(B, 0, 4), rank(E, 0, 3)), "holds all 4 layers of org/m", False),
        (tensor(NO_CARD, rank(B, 0, 4), rank(E, 0, 5)), "holds all 4 layers", False),
        (
            tensor(M, rank(B, 0, 4), rank(E, 0, 4)),  # the card's one KV head
            "cannot split org/m by tensors: 2 ranks need 2 KV heads at least, it has 1",
            False,
        ),
    ],
)
def test_rejections(command: Command, message: str, not_found: bool) -> None:
    with pytest.raises(CommandRejected, match=re.escape(message)) as info:
        decide(STATE, command)
    assert info.value.not_found is not_found


def test_a_model_without_a_card_is_not_checked_against_a_layer_count() -> None:
    [event] = decide(STATE, create(NO_CARD, rank(B, 0, 7)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.n_layers == 7


def test_a_single_rank_on_a_node_without_an_address_needs_no_ring() -> None:
    [event] = decide(STATE, create(M, rank(D, 0, 4)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ring_hosts == ()


P0, P1, P2 = (f"{RING_BASE_PORT + i}" for i in range(3))


@pytest.mark.parametrize(
    ("ranks", "ring_hosts"),
    [
        # Free hosts get the base port.
        ((rank(E, 0, 2), rank(V6, 2, 4)), (f"10.0.0.3:{P0}", f"[fd00::1]:{P0}")),
        # The ring on A and B holds the base port on 10.0.0.1 and 10.0.0.2.
        ((rank(B, 0, 2), rank(E, 2, 4)), (f"10.0.0.2:{P1}", f"10.0.0.3:{P0}")),
        ((rank(E, 0, 1), rank(C, 1, 4)), (f"10.0.0.3:{P0}", f"10.0.0.1:{P1}")),
        # Two ranks on one host (A and C) get distinct ports.
        ((rank(A, 0, 2), rank(C, 2, 4)), (f"10.0.0.1:{P1}", f"10.0.0.1:{P2}")),
        (
            (rank(C, 0, 1), rank(B, 1, 2), rank(A, 2, 4)),
            (f"10.0.0.1:{P1}", f"10.0.0.2:{P1}", f"10.0.0.1:{P2}"),
        ),
    ],
)
def test_ring_hosts_from_the_grpc_hosts(
    ranks: tuple[InstanceRank, ...], ring_hosts: tuple[str, ...]
) -> None:
    [event] = decide(STATE, create(NO_CARD, *ranks))
    assert event == InstanceCreated(
        instance=Instance(
            instance_id=InstanceId("new"), model_id=NO_CARD, ranks=ranks, ring_hosts=ring_hosts
        )
    )


def test_a_two_rank_instance_of_a_carded_model() -> None:
    [event] = decide(STATE, create(M, rank(B, 0, 1), rank(E, 1, 4)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ranks == (rank(B, 0, 1), rank(E, 1, 4))
    assert event.instance.ring_hosts == (f"10.0.0.2:{P1}", f"10.0.0.3:{P0}")


def test_a_tensor_instance_on_explicit_ranks() -> None:
    even = STATE.model_copy(update={"cards": {M: sharded_card(M, n_kv_heads=2)}})
    [event] = decide(even, tensor(M, rank(B, 0, 4), rank(E, 0, 4)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.sharding == "tensor"
    # Each rank's KV heads, as the runners split them.
    heads = tuple(r.model_copy(update={"kv_heads": 1}) for r in (rank(B, 0, 4), rank(E, 0, 4)))
    assert event.instance.ranks == heads
    assert event.instance.ring_hosts == (f"10.0.0.2:{P1}", f"10.0.0.3:{P0}")


def test_ranks_kv_heads_must_be_the_split_the_runners_make() -> None:
    """A preview's ranks carry their KV heads; other values are refused, not
    silently replaced (the runners split as the card says)."""
    card = sharded_card(M, n_heads=6, n_kv_heads=3)
    state = STATE.model_copy(update={"cards": {M: card}})
    ranks = [rank(B, 0, 4), rank(E, 0, 4)]
    preview = [r.model_copy(update={"kv_heads": k}) for r, k in zip(ranks, (2, 1), strict=True)]
    [event] = decide(state, tensor(M, *preview))
    assert isinstance(event, InstanceCreated)
    assert [r.kv_heads for r in event.instance.ranks] == [2, 1]
    swapped = [r.model_copy(update={"kv_heads": k}) for r, k in zip(ranks, (1, 2), strict=True)]
    with pytest.raises(CommandRejected) as refused:
        decide(state, tensor(M, *swapped))
    assert str(refused.value) == (
        "2 tensor ranks split org/m's 3 KV heads 2/1 in this order, not as the ranks give them "
        "(1/2); leave kv_heads out"
    )
    with pytest.raises(CommandRejected, match="kv_heads is for tensor ranks"):
        decide(state, create(M, preview[0].model_copy(update={"end_layer": 2}), rank(E, 2, 4)))


def test_ports_of_a_deleted_ring_are_free_again() -> None:
    state = STATE.model_copy(update={"instances": {EXISTING.instance_id: EXISTING}})
    [event] = decide(state, create(OTHER, rank(B, 0, 2), rank(A, 2, 4)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ring_hosts == (f"10.0.0.2:{P0}", f"10.0.0.1:{P0}")


def test_delete() -> None:
    assert decide(STATE, DeleteInstance(instance_id=InstanceId("i1"))) == [
        InstanceDeleted(instance_id=InstanceId("i1"))
    ]


# --- PlaceInstance ----------------------------------------------------------------

# Only nodes with telemetry are placed on: x has 2 GB, y 8 GB, z 4 GB.
X, Y, Z = NodeId("x"), NodeId("y"), NodeId("z")
CLUSTER = State(nodes={X: node(X, 2), Y: node(Y, 8), Z: node(Z, 4)}, cards={M: CARD})


def place_cmd(min_nodes: int = 1, max_nodes: int | None = None) -> PlaceInstance:
    return PlaceInstance(
        instance_id=InstanceId("p"), model_id=M, min_nodes=min_nodes, max_nodes=max_nodes
    )


def test_place_an_unknown_model_is_not_found() -> None:
    command = PlaceInstance(instance_id=InstanceId("p"), model_id=NO_CARD)
    with pytest.raises(CommandRejected, match="no node knows model 'org/no-card'") as info:
        decide(CLUSTER, command)
    assert info.value.not_found is True


@pytest.mark.parametrize(
    ("state", "command"),
    [
        # 0.55 GB of weights on 0.1 GB nodes
        (State(nodes={X: node(X, 0.1), Y: node(Y, 0.1)}, cards={M: CARD}), place_cmd()),
        (State(nodes={X: node(X, 0.1)}, cards={M: CARD}), place_cmd(min_nodes=1)),
        (State(nodes={X: node(X)}, cards={M: CARD}), place_cmd()),  # no telemetry
        (CLUSTER, place_cmd(min_nodes=4)),
        (CLUSTER, place_cmd(min_nodes=3, max_nodes=2)),
    ],
)
def test_an_infeasible_placement_is_rejected_with_the_shortfall(
    state: State, command: PlaceInstance
) -> None:
    request = PlacementRequest(min_nodes=command.min_nodes, max_nodes=command.max_nodes)
    with pytest.raises(PlacementError) as placement_error:
        place(CARD, state, request=request)
    with pytest.raises(CommandRejected) as info:
        decide(state, command)
    assert str(info.value) == str(placement_error.value)
    assert info.value.not_found is False


@pytest.mark.parametrize(
    "command",
    [place_cmd(), place_cmd(min_nodes=2), place_cmd(min_nodes=3), place_cmd(max_nodes=1)],
)
def test_a_feasible_placement_creates_the_placed_instance(command: PlaceInstance) -> None:
    request = PlacementRequest(min_nodes=command.min_nodes, max_nodes=command.max_nodes)
    expected = place(CARD, CLUSTER, request=request)
    [event] = decide(CLUSTER, command)
    assert isinstance(event, InstanceCreated)
    instance = event.instance
    assert instance.instance_id == "p"
    assert instance.model_id == M
    assert [(r.node_id, r.start_layer, r.end_layer) for r in instance.ranks] == [
        (r.node_id, r.start_layer, r.end_layer) for r in expected.ranks
    ]
    assert len(instance.ranks) >= command.min_nodes
    assert instance.n_layers == CARD.n_layers
    # a ring of several ranks gets one address per rank, a single rank none
    assert len(instance.ring_hosts) == (len(instance.ranks) if len(instance.ranks) > 1 else 0)


def test_a_tensor_placement_keeps_its_sharding_and_every_layer_on_every_rank() -> None:
    cluster = CLUSTER.model_copy(update={"cards": {M: sharded_card(M, n_kv_heads=2)}})
    command = place_cmd().model_copy(update={"sharding": "tensor"})
    [event] = decide(cluster, command)
    assert isinstance(event, InstanceCreated)
    assert event.instance.sharding == "tensor"
    heads = tuple(r.model_copy(update={"kv_heads": 1}) for r in (rank(Y, 0, 4), rank(Z, 0, 4)))
    assert event.instance.ranks == heads
    assert event.instance.min_nodes == 1  # the request as it was asked
    with pytest.raises(CommandRejected, match="2 ranks need 2 KV heads at least"):
        decide(CLUSTER, command)  # CARD has one KV head


def test_placement_without_downloads_takes_the_node_with_the_most_ram() -> None:
    [event] = decide(CLUSTER, place_cmd(max_nodes=1))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ranks == (rank(Y, 0, 4),)


def progress(have: tuple[str, ...]) -> DownloadProgress:
    return DownloadProgress(
        model_id=M, status="complete", files_total=len(have), files_done=len(have),
        bytes_total=0, bytes_done=0, have_files=have,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("downloads", "node_id"),
    [
        ({}, Y),
        # z has every file: it is preferred over y's larger free RAM.
        ({Z: progress(tuple(CARD.files))}, Z),
        # z has the big first weight file, x only the metadata: z wins.
        ({Z: progress(("model-1.safetensors",)), X: progress(("config.json", "tokenizer.json"))}, Z),
        # what y has counts too, and more bytes beat more files
        ({Y: progress(("model-2.safetensors",)),
          Z: progress(("model-3.safetensors", "config.json", "tokenizer.json"))}, Z),
        ({X: progress(("model-1.safetensors",)),
          Z: progress(("model-3.safetensors", "model-2.safetensors", "config.json"))}, X),
    ],
)  # fmt: skip
def test_download_progress_in_the_state_steers_placement(
    downloads: dict[NodeId, DownloadProgress], node_id: NodeId
) -> None:
    state = CLUSTER.model_copy(update={"downloads": {n: {M: p} for n, p in downloads.items()}})
    assert (
        SIZES["model-1.safetensors"] > SIZES["model-3.safetensors"] + SIZES["model-2.safetensors"]
    )
    [event] = decide(state, place_cmd(max_nodes=1))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ranks == (rank(node_id, 0, 4),)


def test_placing_a_served_model_again_uses_a_node_that_does_not_serve_it() -> None:
    # y serves the model and so has its files: placement ranks it first.
    served = Instance(instance_id=InstanceId("i1"), model_id=M, ranks=(rank(Y, 0, 4),))
    state = CLUSTER.model_copy(
        update={
            "instances": {served.instance_id: served},
            "downloads": {Y: {M: progress(tuple(CARD.files))}},
        }
    )
    [event] = decide(state, place_cmd(max_nodes=1))
    assert isinstance(event, InstanceCreated)
    assert Y not in event.instance.node_ids


def test_ring_ports_move_with_the_log_index() -> None:
    """A ring placed again right after its predecessor's deletion gets other
    ports than the old runners may still hold."""
    later = STATE.model_copy(update={"last_idx": 41})
    [event] = decide(later, create(OTHER, rank(E, 0, 2), rank(V6, 2, 4)))
    assert isinstance(event, InstanceCreated)
    port = RING_BASE_PORT + 42
    assert event.instance.ring_hosts == (f"10.0.0.3:{port}", f"[fd00::1]:{port}")
    wrapped = STATE.model_copy(update={"last_idx": RING_PORT_SPAN - 1})
    [event] = decide(wrapped, create(OTHER, rank(E, 0, 2), rank(V6, 2, 4)))
    assert isinstance(event, InstanceCreated)
    assert event.instance.ring_hosts[0] == f"10.0.0.3:{RING_BASE_PORT}"


# --- cards carried by commands -------------------------------------------------------


def test_a_placement_of_a_model_without_a_card_publishes_the_commands_card_first() -> None:
    card = sharded_card(NO_CARD)
    command = PlaceInstance(instance_id=InstanceId("p"), model_id=NO_CARD, max_nodes=1, card=card)
    card_event, created = decide(CLUSTER.model_copy(update={"cards": {}}), command)
    assert card_event == ModelCardPublished(card=card)
    assert isinstance(created, InstanceCreated)
    assert created.instance.ranks == (rank(Y, 0, 4),)


def test_the_states_card_wins_over_the_commands() -> None:
    """A node that has the model measured it: a hub estimate neither replaces
    nor overrides it (here it would claim 8 layers)."""
    estimate = sharded_card(M, n_layers=8)
    [event] = decide(STATE, create(M, rank(B, 0, 4)).model_copy(update={"card": estimate}))
    assert isinstance(event, InstanceCreated)
    with pytest.raises(CommandRejected, match="org/m has 4 layers, the ranks cover 8"):
        decide(STATE, create(M, rank(B, 0, 8)).model_copy(update={"card": estimate}))


def test_a_created_instance_is_checked_against_the_commands_card() -> None:
    card = sharded_card(NO_CARD)
    command = create(NO_CARD, rank(B, 0, 3)).model_copy(update={"card": card})
    with pytest.raises(CommandRejected, match="org/no-card has 4 layers, the ranks cover 3"):
        decide(STATE, command)
    card_event, created = decide(
        STATE, create(NO_CARD, rank(B, 0, 4)).model_copy(update={"card": card})
    )
    assert card_event == ModelCardPublished(card=card)
    assert isinstance(created, InstanceCreated)


def test_a_card_of_another_model_is_rejected() -> None:
    command = create(M, rank(B, 0, 4)).model_copy(update={"card": sharded_card(OTHER)})
    with pytest.raises(CommandRejected, match="the card sent describes org/other, not org/m"):
        decide(STATE, command)


# --- replicas ------------------------------------------------------------------------


def test_replicas_are_placed_on_nodes_of_their_own() -> None:
    command = place_cmd(max_nodes=1).model_copy(
        update={"replica_ids": (InstanceId("p2"), InstanceId("p3"))}
    )
    events = decide(CLUSTER, command)
    created = [e.instance for e in events if isinstance(e, InstanceCreated)]
    assert [i.instance_id for i in created] == ["p", "p2", "p3"]
    assert sorted(i.ranks[0].node_id for i in created) == [X, Y, Z]
    assert all(len(i.ranks) == 1 for i in created)
    # Each records how many its placement asked for: a lost one is placed again.
    assert [i.replicas for i in created] == [3, 3, 3]
    [single] = [e.instance for e in decide(CLUSTER, place_cmd()) if isinstance(e, InstanceCreated)]
    assert single.replicas == 1


def test_replicas_that_do_not_all_fit_place_none() -> None:
    # Two nodes of 2 GB: the 0.55 GB model fits twice (one per node), not three times.
    state = State(nodes={X: node(X, 2), Z: node(Z, 2)}, cards={M: CARD})
    two = place_cmd(max_nodes=1).model_copy(update={"replica_ids": (InstanceId("p2"),)})
    assert len([e for e in decide(state, two) if isinstance(e, InstanceCreated)]) == 2
    three = two.model_copy(update={"replica_ids": (InstanceId("p2"), InstanceId("p3"))})
    with pytest.raises(CommandRejected, match="cannot place 3 replicas of org/m: replica 3"):
        decide(state, three)
