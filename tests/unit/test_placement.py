import re
from fractions import Fraction
from itertools import pairwise
from typing import Any

import pytest

from exo.master.commands import decide
from exo.master.placement import (
    MAX_CANDIDATE_NODES,
    MIN_TENSOR_RANKS,
    CapFn,
    Placement,
    PlacementError,
    PlacementRequest,
    ProgressFn,
    free_bytes,
    place,
    preview,
    split_layers,
)
from exo.models.cards import card_from_config
from exo.models.memory import (
    KV_RESERVE_TOKENS,
    layer_costs,
    layer_kv,
    layer_weights,
    layers_that_fit,
    rank_kv,
    rank_memory,
    rank_weights,
    tensor_rank_kv,
    tensor_rank_weights,
)
from exo.shared.architectures import tensor_refusal
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.events import InstanceCreated
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.model_card import LayerCache, ModelCard, Quantization
from exo.shared.types.state import (
    Instance,
    InstanceRank,
    MlxBackend,
    NodeInfo,
    NodeTelemetry,
    State,
)
from tests.unit.test_cards_per_layer import DEEPSEEK_V3, QWEN3_235B

GB = 10**9
MB = 10**6


def card(
    n_layers: int = 30,
    layer_bytes: int = 100 * MB,
    embedding_bytes: int = 50 * MB,
    head_bytes: int = 50 * MB,
    **overrides: Any,
) -> ModelCard:
    """A 4-bit (group 32) model: 0.625 stored bytes per parameter."""
    fields: dict[str, Any] = {
        "model_id": ModelId("m"),
        "architecture": "llama",
        "n_layers": n_layers,
        "hidden_size": 64,
        "n_heads": 4,
        "n_kv_heads": 1,
        "head_dim": 8,
        "context_length": 32768,
        "vocab_size": 100,
        "tie_word_embeddings": False,
        "files": ("model.safetensors", "config.json"),
        "weight_files": (),
        "total_bytes": n_layers * layer_bytes + embedding_bytes + head_bytes,
        "layer_bytes": layer_bytes,
        "embedding_bytes": embedding_bytes,
        "head_bytes": head_bytes,
        "layer_params": layer_bytes * 8 // 5,
        "embedding_params": embedding_bytes * 8 // 5,
        "head_params": head_bytes * 8 // 5,
        "quantization": Quantization(bits=4, group_size=32),
        "dtype_bytes": 2,
        "size_source": "config_estimate",
    }
    return ModelCard(**(fields | overrides))


def node(
    node_id: str, available: float, total: float | None = None, backend: MlxBackend = "metal"
) -> NodeInfo:
    """A node with `available` GB of RAM free out of `total` GB (default: all of it)."""
    telemetry = NodeTelemetry(
        ram_total=int((total or available) * GB),
        ram_available=int(available * GB),
        disk_free=100 * GB,
        cpu_count=8,
        platform="darwin",
        mlx_backend=backend,
    )
    return NodeInfo(
        node_id=NodeId(node_id),
        grpc_address=None,
        started_at_ms=0,
        telemetry=telemetry,
        last_seen_ms=0,
    )


def cluster(*nodes: NodeInfo) -> State:
    return State(nodes={n.node_id: n for n in nodes})


def layout(placement: Placement) -> list[tuple[str, int, int]]:
    return [(r.node_id, r.start_layer, r.end_layer) for r in placement.ranks]


def progress_of(**fractions: float) -> ProgressFn:
    """Each node's downloaded fraction, whatever layers it would serve (0 if not given)."""
    return lambda node_id, start, end: fractions.get(node_id, 0.0)


@pytest.mark.parametrize(
    ("n_layers", "weights", "caps", "expected"),
    [
        (30, [3, 2, 1], None, [15, 10, 5]),
        (10, [1, 1, 1], None, [4, 3, 3]),  # one left over: tie goes to the first
        (10, [1, 1, 2], None, [3, 2, 5]),
        (7, [5, 1], None, [6, 1]),
        (6, [1, 2, 3], None, [1, 2, 3]),
        # Every part gets at least one layer, taken from the largest.
        (3, [100, 1, 1], None, [1, 1, 1]),
        (5, [100, 1, 1], None, [3, 1, 1]),
        (1, [7], None, [1]),
        # Fewer layers than parts.
        (2, [1, 1, 1], None, None),
        # A part over its cap keeps its cap; the rest is split among the others.
        (30, [3, 2, 1], [10, 30, 30], [10, 13, 7]),
        (30, [3, 2, 1], [30, 30, 30], [15, 10, 5]),
        (10, [1, 1], [4, 5], None),
        (10, [1, 1], [0, 10], None),
    ],
)
def test_split_layers(
    n_layers: int, weights: list[int], caps: list[int] | None, expected: list[int] | None
) -> None:
    """Equal layer sizes; `caps` None: every part may take all layers."""
    limits = [n_layers] * len(weights) if caps is None else caps
    assert split_layers([1] * n_layers, weights, lambda i, start: limits[i]) == expected


def test_layers_split_in_proportion_to_free_ram() -> None:
    model = card()
    state = cluster(node("c", 10), node("a", 30), node("b", 20))
    placement = place(model, state)
    assert layout(placement) == [("a", 0, 15), ("b", 15, 25), ("c", 25, 30)]
    cost = model.layer_bytes + layer_kv(model, "metal")[0]
    assert [placement.memory_bytes[r.node_id] for r in placement.ranks] == [
        15 * cost + model.embedding_bytes,
        10 * cost,
        5 * cost + model.head_bytes,
    ]
    assert placement.free_bytes == 54 * GB  # 90% of 60 GB
    assert placement.download_progress == 0


def test_ten_layers_over_equal_nodes_give_the_remainder_to_the_first_id() -> None:
    placement = place(card(n_layers=10), cluster(node("z", 8), node("y", 8), node("x", 8)))
    assert layout(placement) == [("x", 0, 4), ("y", 4, 7), ("z", 7, 10)]


STATE = cluster(node("a", 32), node("b", 16), node("c", 8))


@pytest.mark.parametrize(
    ("progress", "request_", "nodes"),
    [
        # Nothing downloaded: the most free RAM wins.
        (progress_of(), PlacementRequest(max_nodes=1), ["a"]),
        (progress_of(), PlacementRequest(), ["a", "b", "c"]),
        (progress_of(), PlacementRequest(min_nodes=2, max_nodes=2), ["a", "b"]),
        # Download progress beats RAM.
        (progress_of(c=1.0), PlacementRequest(max_nodes=1), ["c"]),
        (progress_of(b=0.5, c=0.4), PlacementRequest(max_nodes=1), ["b"]),
        (progress_of(a=0.2, c=0.3), PlacementRequest(max_nodes=1), ["c"]),
        (progress_of(b=1.0, c=1.0), PlacementRequest(max_nodes=2), ["b", "c"]),
        (progress_of(b=1.0, c=1.0), PlacementRequest(), ["a", "b", "c"]),
        # Equal progress: RAM breaks the tie.
        (progress_of(a=0.5, b=0.5), PlacementRequest(max_nodes=1), ["a"]),
        (progress_of(b=0.5, c=0.5), PlacementRequest(max_nodes=1), ["b"]),
        (progress_of(a=0.5, b=0.5, c=0.5), PlacementRequest(min_nodes=2, max_nodes=2), ["a", "b"]),
        # Fractions are clamped to 0..1.
        (progress_of(c=7.0, b=1.0), PlacementRequest(max_nodes=1), ["b"]),
    ],
)
def test_download_progress_then_ram(
    progress: ProgressFn, request_: PlacementRequest, nodes: list[str]
) -> None:
    placement = place(card(), STATE, request_, progress=progress)
    assert list(placement.node_ids) == nodes


def test_preview_ranks_progress_then_ram_then_fewer_nodes_then_ids() -> None:
    state = cluster(node("a", 20), node("b", 10), node("c", 10))
    placements = preview(card(), state, progress=progress_of(a=0.5, b=0.25, c=0.25))
    assert [(p.node_ids, p.download_progress, p.free_bytes // GB) for p in placements] == [
        (("a", "b", "c"), 1.0, 36),
        (("a", "b"), 0.75, 27),
        (("a", "c"), 0.75, 27),
        (("a",), 0.5, 18),  # same progress and RAM as (b, c): fewer nodes first
        (("b", "c"), 0.5, 18),
        (("b",), 0.25, 9),
        (("c",), 0.25, 9),
    ]
    assert place(card(), state, progress=progress_of(a=0.5, b=0.25, c=0.25)) == placements[0]


def test_every_placement_covers_all_layers_each_node_at_least_one() -> None:
    model = card(n_layers=7)
    state = cluster(node("a", 64), node("b", 1.5), node("c", 3), node("d", 2), node("e", 40))
    placements = preview(model, state, request=PlacementRequest(min_nodes=1))
    assert len(placements) == 2**5 - 1
    for placement in placements:
        ranks = placement.ranks
        assert ranks[0].start_layer == 0
        assert ranks[-1].end_layer == model.n_layers
        for prev, rank in pairwise(ranks):
            assert prev.end_layer == rank.start_layer
        assert all(r.end_layer - r.start_layer >= 1 for r in ranks)
        for rank in ranks:
            telemetry = state.nodes[rank.node_id].telemetry
            assert telemetry is not None
            assert placement.memory_bytes[rank.node_id] <= free_bytes(telemetry)


def test_a_node_too_small_for_one_layer_is_excluded() -> None:
    model = card(layer_bytes=1 * GB, embedding_bytes=0, head_bytes=0, n_layers=4)
    # 0.9 GB free after the margin: less than one layer.
    state = cluster(node("big", 10), node("big2", 10), node("tiny", 1))
    placements = preview(model, state)
    assert placements
    assert all(NodeId("tiny") not in p.node_ids for p in placements)
    # Its download progress does not help it.
    best = place(model, state, PlacementRequest(max_nodes=1), progress=progress_of(tiny=1.0))
    assert best.node_ids == ("big",)
    with pytest.raises(PlacementError, match="too small for even one layer: tiny"):
        place(model, state, request=PlacementRequest(min_nodes=3))


def test_the_error_names_the_shortfall() -> None:
    # 10 layers x 200 MB + 100 MB embedding/head (+ a small KV reserve) = 2.1 GB;
    # two nodes with 0.8 GB, 0.72 GB free each after the 10% margin = 1.4 GB.
    model = card(n_layers=10, layer_bytes=200 * MB)
    state = cluster(node("x", 0.8), node("y", 0.8))
    with pytest.raises(PlacementError) as error:
        place(model, state)
    message = str(error.value)
    assert message.startswith("m needs 2.1 GB, the largest candidate set has 1.4 GB free (x, y;")
    with pytest.raises(PlacementError, match=re.escape("has 720.0 MB free (x;")):
        place(model, state, request=PlacementRequest(max_nodes=1))


def test_the_error_says_when_ram_suffices_but_no_split_fits() -> None:
    # 3.6 GB free in all, enough for 3.2 GB, but each node holds only one 1 GB layer
    # next to the 0.1 GB embedding or head, and the model has 3 layers.
    model = card(n_layers=3, layer_bytes=1 * GB, embedding_bytes=100 * MB, head_bytes=100 * MB)
    state = cluster(node("x", 2), node("y", 2))
    with pytest.raises(PlacementError, match="cannot hold all 3 layers"):
        place(model, state)


@pytest.mark.parametrize(
    ("state", "request_", "message"),
    [
        (State(), PlacementRequest(), "no node that runs models has reported its memory yet"),
        (
            State(nodes={NodeId("a"): node("a", 8).model_copy(update={"telemetry": None})}),
            PlacementRequest(),
            "no node that runs models has reported its memory yet",
        ),
        (
            STATE,
            PlacementRequest(min_nodes=4),
            "on at least 4 nodes: the cluster has 3 nodes that can run models",
        ),
        (
            STATE,
            PlacementRequest(min_nodes=3, max_nodes=2),
            "at most 2 nodes and at least 3 nodes were asked for",
        ),
    ],
)
def test_request_errors(state: State, request_: PlacementRequest, message: str) -> None:
    with pytest.raises(PlacementError, match=re.escape(message)):
        place(card(), state, request=request_)


def test_more_nodes_than_layers() -> None:
    with pytest.raises(PlacementError, match="has 2 layers: it cannot be split across 3 nodes"):
        place(card(n_layers=2), STATE, request=PlacementRequest(min_nodes=3))
    # Without min_nodes, sets larger than the layer count are simply not tried.
    assert len(place(card(n_layers=2), STATE).ranks) == 2


def test_cpu_nodes_count_float32_weights() -> None:
    model = card(n_layers=30, layer_bytes=100 * MB)  # 160M params per layer: 640 MB in float32
    assert layer_weights(model, "cpu") == (640 * MB,) * 30
    # 10 GB (9 GB free): 3 GB of 4-bit weights fit on Metal, 19.2 GB of float32 not.
    assert layout(place(model, cluster(node("mac", 10)))) == [("mac", 0, 30)]
    with pytest.raises(PlacementError, match=r"needs 19\.9 GB.*has 9\.0 GB free.*cpu"):
        place(model, cluster(node("linux", 10, backend="cpu")))
    # Mixed: the proportional 15/15 split would overfill the CPU node; it gets what it holds.
    mixed = cluster(node("mac", 10), node("linux", 10, backend="cpu"))
    placement = place(model, mixed, request=PlacementRequest(min_nodes=2))
    assert layout(placement) == [("linux", 0, 13), ("mac", 13, 30)]
    assert all(memory <= 9 * GB for memory in placement.memory_bytes.values())


def test_kv_reserve() -> None:
    model = card(n_layers=30)
    per_token = 2 * 1 * 8 * 30  # kv heads x head dim x layers, keys and values
    assert layer_kv(model, "metal") == (per_token * 2 * KV_RESERVE_TOKENS // 30,) * 30
    assert layer_kv(model, "cpu") == (per_token * 4 * KV_RESERVE_TOKENS // 30,) * 30
    short = card(n_layers=30, context_length=1024)
    assert layer_kv(short, "metal") == (per_token * 2 * 1024 // 30,) * 30


@pytest.mark.parametrize(
    ("free_layers", "extra", "first", "last", "expected"),
    [
        (3, 0, True, False, 3),  # the embedding and three layers
        (3, -1, True, False, 2),
        (3, 0, False, False, 3),  # a middle rank holds layers only
        (3, -1, False, False, 2),
        (0, 0, True, True, 0),  # embedding and head, no layer
        (0, -1, True, True, 0),  # not even the embedding and head
        (40, 0, False, True, 30),  # never more than the model has
    ],
)
def test_layers_that_fit(
    free_layers: int, extra: int, first: bool, last: bool, expected: int
) -> None:
    """`free` = the rank's embedding/head + `free_layers` layers + `extra` bytes."""
    model = card(layer_bytes=100 * MB, embedding_bytes=50 * MB, head_bytes=50 * MB)
    cost = layer_costs(model, "metal")[0]
    fixed = (50 * MB if first else 0) + (50 * MB if last else 0)
    free = fixed + free_layers * cost + extra
    assert layers_that_fit(model, "metal", free, first=first, last=last) == expected


def test_only_the_nodes_with_the_most_free_ram_are_candidates() -> None:
    nodes = [node(f"n{i:02d}", 10 + i) for i in range(MAX_CANDIDATE_NODES + 2)]
    placements = preview(card(), cluster(*nodes), progress=progress_of(n00=1.0, n01=1.0))
    used = {n for p in placements for n in p.node_ids}
    assert used == {NodeId(f"n{i:02d}") for i in range(2, MAX_CANDIDATE_NODES + 2)}
    assert len(placements) == 2**MAX_CANDIDATE_NODES - 1


def served(state: State, model: ModelCard, *nodes: str) -> State:
    """`state` with an instance of `model` over `nodes` (one layer each, then the rest)."""
    bounds = [*range(len(nodes)), model.n_layers]
    instance = Instance(
        instance_id=InstanceId(f"{model.model_id}-on-{'-'.join(nodes)}"),
        model_id=model.model_id,
        ranks=tuple(
            InstanceRank(node_id=NodeId(n), start_layer=bounds[i], end_layer=bounds[i + 1])
            for i, n in enumerate(nodes)
        ),
    )
    return state.model_copy(
        update={"instances": {**state.instances, instance.instance_id: instance}}
    )


def test_nodes_that_serve_the_model_are_not_candidates() -> None:
    model, other = card(), card(model_id=ModelId("other"))
    state = served(served(STATE, model, "a"), other, "b", "c")
    placements = preview(model, state)
    assert {p.node_ids for p in placements} == {("b", "c"), ("b",), ("c",)}
    # Another model's instance does not count.
    assert place(other, state).node_ids == ("a",)
    with pytest.raises(
        PlacementError,
        match=re.escape(
            "m already has an instance on a; only 2 other nodes can take one (at least 3 nodes were asked for)"
        ),
    ):
        place(model, state, PlacementRequest(min_nodes=3))
    with pytest.raises(PlacementError, match="m already has an instance on a, b, c; only 0"):
        place(model, served(state, model, "b", "c"))


def with_addresses(state: State) -> State:
    """Every node with a cluster address, as nodes that joined have (rings need one)."""
    return state.model_copy(
        update={
            "nodes": {
                n: info.model_copy(update={"grpc_address": f"10.0.0.{i}:5000"})
                for i, (n, info) in enumerate(sorted(state.nodes.items()))
            }
        }
    )


@pytest.mark.parametrize(
    ("state", "request_"),
    [
        (STATE, PlacementRequest()),
        (STATE, PlacementRequest(max_nodes=1)),
        (served(STATE, card(), "a"), PlacementRequest()),  # the best node serves it already
        (served(STATE, card(), "a"), PlacementRequest(max_nodes=1)),
        (served(STATE, card(model_id=ModelId("other")), "a", "b"), PlacementRequest()),
    ],
)
def test_placing_places_what_the_first_preview_shows(
    state: State, request_: PlacementRequest
) -> None:
    model = card()
    state = with_addresses(state).model_copy(update={"cards": {model.model_id: model}})
    [first, *_] = preview(model, state, request_)
    command = PlaceInstance(
        instance_id=InstanceId("new"),
        model_id=model.model_id,
        min_nodes=request_.min_nodes,
        max_nodes=request_.max_nodes,
    )
    [created] = [e for e in decide(state, command) if isinstance(e, InstanceCreated)]
    assert created.instance.ranks == first.ranks


# --- architectures exo can load and split ------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "min_nodes", "nodes", "refusal"),
    [
        ("llama", 2, 2, None),  # splits across nodes
        ("qwen3", 1, 2, None),
        ("gemma3", 2, 2, None),  # any mlx-lm model whose blocks form one list
        ("rwkv7", 1, 1, None),  # mlx-lm loads it whole; one node only
        (
            "rwkv7",
            2,
            1,
            "cannot split m across 2 nodes: mlx-lm's 'rwkv7' layers hand on more than their "
            "hidden states from one layer to the next; it can be served whole on one node",
        ),
        ("not_a_model", 1, 1, "cannot place m: exo cannot load its architecture 'not_a_model'"),
        ("../llama", 1, 1, "exo cannot load its architecture '../llama'"),
    ],
)
def test_placement_refuses_an_architecture_exo_cannot_serve(
    architecture: str, min_nodes: int, nodes: int, refusal: str | None
) -> None:
    state = cluster(node("a", 4), node("b", 4))  # the model fits on one or on both
    request = PlacementRequest(min_nodes=min_nodes)
    if refusal is None:
        placement = place(card(architecture=architecture), state, request)
        assert len(placement.ranks) == nodes
        return
    with pytest.raises(PlacementError) as refused:
        preview(card(architecture=architecture), state, request)
    assert refusal in str(refused.value)


def test_a_model_that_cannot_be_split_is_placed_whole_even_when_a_split_would_rank_first() -> None:
    # Too big for one 2 GB node but fits split: a llama goes to both nodes, an
    # rwkv7 (whole only) to none, with the reason.
    big = {"n_layers": 30, "layer_bytes": 100 * MB}
    state = cluster(node("a", 2.5), node("b", 2.5))
    assert len(place(card(**big), state).ranks) == 2
    with pytest.raises(PlacementError):
        place(card(architecture="rwkv7", **big), state)


# --- layers of different sizes ------------------------------------------------------


def byte_caps(sizes: list[int], rooms: list[int]) -> CapFn:
    """Each part holds the consecutive layers whose sizes fit in its room."""

    def cap(part: int, start: int) -> int:
        used = held = 0
        for size in sizes[start:]:
            if used + size > rooms[part]:
                break
            used, held = used + size, held + 1
        return held

    return cap


@pytest.mark.parametrize(
    ("sizes", "weights", "rooms", "expected"),
    [
        # Equal sizes: the layer count in proportion, as for a dense model.
        ([5] * 6, [1, 1], None, [3, 3]),
        # Three light layers then three heavy ones (33 in all): the first part's
        # half (16.5) reaches 1.35 into the heavy ones.
        ([1, 1, 1, 10, 10, 10], [1, 1], None, [4, 2]),
        ([10, 10, 10, 1, 1, 1], [1, 1], None, [2, 4]),
        ([1, 1, 1, 10, 10, 10], [2, 1], None, [5, 1]),
        # A part that cannot hold its share keeps what it holds from its start.
        ([1, 1, 1, 10, 10, 10], [1, 1], [12, 100], [3, 3]),
        ([1, 1, 1, 10, 10, 10], [1, 1], [100, 10], [5, 1]),
        ([1, 1, 1, 10, 10, 10], [1, 1], [12, 20], None),  # 32 of room for 33
        # The proportional split [2, 0, 2] leaves the middle part the heavy layer
        # it cannot hold once it takes one: the nearest split that fits instead.
        ([1, 1, 2, 1], [7, 1, 10], [7, 1, 10], [1, 1, 2]),
    ],
)
def test_split_layers_by_layer_sizes(
    sizes: list[int], weights: list[int], rooms: list[int] | None, expected: list[int] | None
) -> None:
    cap = byte_caps(sizes, rooms or [sum(sizes)] * len(weights))
    assert split_layers(sizes, weights, cap) == expected


def moe_card(**overrides: Any) -> ModelCard:
    """8 layers: 2 dense of 100 MB, then 6 mixture-of-experts ones of 1 GB."""
    per_layer = (100 * MB,) * 2 + (1 * GB,) * 6
    return card(
        n_layers=8,
        layer_bytes=-(-sum(per_layer) // 8),
        per_layer_bytes=per_layer,
        per_layer_params=tuple(b * 8 // 5 for b in per_layer),
        **overrides,
    )


def test_moe_layers_split_by_their_bytes_not_their_count() -> None:
    model = moe_card()
    state = cluster(node("a", 3.7), node("b", 3.7))  # 3.33 GB free each
    placement = place(model, state)
    # Half the bytes each: the dense layers and three MoE layers, then three.
    assert layout(placement) == [("a", 0, 5), ("b", 5, 8)]
    for rank in placement.ranks:
        assert placement.memory_bytes[rank.node_id] <= free_of(state, rank.node_id)
    # Four layers each, as for equal layers, would give b four 1 GB layers.
    assert split_layers([1] * 8, [1, 1], lambda i, start: 8) == [4, 4]
    assert rank_memory(model, "metal", 4, 8) > free_of(state, "b")


def free_of(state: State, node_id: str) -> int:
    telemetry = state.nodes[NodeId(node_id)].telemetry
    assert telemetry is not None
    return free_bytes(telemetry)


def test_a_deepseek_v3_card_fits_every_node_it_uses() -> None:
    model = card_from_config(ModelId("deepseek-v3-4bit"), DEEPSEEK_V3)
    need = rank_memory(model, "metal", 0, model.n_layers)  # about 378 GB
    state = cluster(node("a", 192), node("b", 128), node("c", 128))
    placement = place(model, state)
    assert len(placement.ranks) == 3
    shares = []
    for rank in placement.ranks:
        assert placement.memory_bytes[rank.node_id] <= free_of(state, rank.node_id)
        shares.append(placement.memory_bytes[rank.node_id] / need)
    # a, with the three dense layers, holds more layers than its RAM share of 61.
    [a, *_] = placement.ranks
    assert a.end_layer - a.start_layer > round(61 * 192 / 448)
    assert shares[0] == pytest.approx(192 / 448, abs=0.02)


def test_previews_split_each_nodes_memory_into_weights_and_kv() -> None:
    # Two nodes: a holds the sliding-window layers, b the full-attention ones.
    sliding = LayerCache(kind="sliding", token_elements=16, window=128)
    full = LayerCache(kind="attention", token_elements=16)
    model = card(n_layers=4, layer_caches=(sliding, sliding, full, full))
    [placement, *_] = preview(model, cluster(node("a", 0.3), node("b", 0.3)))
    assert layout(placement) == [("a", 0, 2), ("b", 2, 4)]
    assert placement.kv_bytes == {"a": 2 * 128 * 16 * 2, "b": 2 * KV_RESERVE_TOKENS * 16 * 2}
    assert placement.weight_bytes == {
        "a": 2 * model.layer_bytes + model.embedding_bytes,
        "b": 2 * model.layer_bytes + model.head_bytes,
    }
    for n in (NodeId("a"), NodeId("b")):
        assert placement.memory_bytes[n] == placement.weight_bytes[n] + placement.kv_bytes[n]
        rank = next(r for r in placement.ranks if r.node_id == n)
        assert placement.kv_bytes[n] == rank_kv(model, "metal", rank.start_layer, rank.end_layer)
        weights = rank_weights(model, "metal", rank.start_layer, rank.end_layer)
        assert placement.weight_bytes[n] == weights


# --- tensor placement: every node a slice of every layer ------------------------------

TENSOR = PlacementRequest(sharding="tensor")


def tensor_card(**overrides: Any) -> ModelCard:
    """`card()` with heads and MLP widths that 2 and 4 divide, 3 does not."""
    return card(n_heads=8, n_kv_heads=4, intermediate_size=256, **overrides)


def test_a_tensor_placement_gives_every_node_a_slice_of_every_layer() -> None:
    model = tensor_card()  # 30 layers of 100 MB, 50 MB of embedding, 50 MB of head
    placement = place(model, cluster(node("a", 4), node("b", 3)), TENSOR)
    assert placement.sharding == "tensor"
    assert layout(placement) == [("a", 0, 30), ("b", 0, 30)]
    # Half of each layer's weights and KV; the embedding and head whole on each.
    kv_per_layer = KV_RESERVE_TOKENS * 2 * 4 * 8 * 2  # tokens x (k, v) x kv heads x dim x fp16
    assert layer_kv(model, "metal") == (kv_per_layer,) * 30
    assert placement.weight_bytes == {"a": 1500 * MB + 100 * MB, "b": 1500 * MB + 100 * MB}
    assert placement.kv_bytes == {"a": 30 * kv_per_layer // 2, "b": 30 * kv_per_layer // 2}
    a = NodeId("a")
    assert placement.memory_bytes[a] == placement.weight_bytes[a] + placement.kv_bytes[a]
    assert placement.free_bytes == int(6.3 * GB)


def test_a_tensor_node_holds_one_nth_of_the_layers_and_all_of_the_rest() -> None:
    model = tensor_card()
    layers = sum(layer_weights(model, "metal"))
    other = model.embedding_bytes + model.head_bytes
    for n in (1, 2, 4):
        share = Fraction(1, n)
        assert tensor_rank_weights(model, "metal", share) == -(-layers // n) + other
        assert tensor_rank_kv(model, "metal", share) == -(-rank_kv(model, "metal", 0, 30) // n)
    # On the CPU backend: float32 weights, split the same way.
    cpu_layers = sum(layer_weights(model, "cpu"))
    assert tensor_rank_weights(model, "cpu", Fraction(1, 4)) == cpu_layers // 4 + other * 8 // 5 * 4
    # Four nodes: each needs a quarter of the layers, which no pipeline rank would.
    quarters = tensor_card(head_dim=32)  # a KV head's query heads: whole quantization groups
    placement = place(quarters, cluster(*(node(n, 1.1) for n in "abcd")), TENSOR)
    assert len(placement.ranks) == 4
    assert set(placement.weight_bytes.values()) == {750 * MB + 100 * MB}


def test_a_latent_cache_stays_whole_on_every_tensor_rank() -> None:
    """MLA's latent is read by every head: mlx-lm's shard() splits the heads after it."""
    model = card_from_config(ModelId("deepseek-v3-4bit"), DEEPSEEK_V3)
    assert {c.kind for c in model.layer_caches} == {"latent"}
    whole = rank_kv(model, "metal", 0, model.n_layers)
    assert tensor_rank_kv(model, "metal", Fraction(1, 4)) == whole
    # Keys and values of split heads are split.
    latent, split = (LayerCache(kind=kind, token_elements=64) for kind in ("latent", "attention"))
    mixed = tensor_card(n_layers=2, layer_caches=(latent, split))
    latent_bytes, split_bytes = layer_kv(mixed, "metal")
    assert latent_bytes == split_bytes == KV_RESERVE_TOKENS * 64 * 2
    assert tensor_rank_kv(mixed, "metal", Fraction(1, 2)) == latent_bytes + split_bytes // 2


def test_every_node_of_a_tensor_set_must_hold_its_share() -> None:
    # a holds its 1.6 GB share, b (0.9 GB free) does not: no tensor set fits.
    state = cluster(node("a", 4), node("b", 1))
    with pytest.raises(PlacementError) as refused:
        place(tensor_card(), state, TENSOR)
    assert str(refused.value).startswith(
        "m split by tensors needs 1.6 GB on each of 2 nodes (a slice of every layer, the "
        "embedding and head whole), the candidate set's smallest node has 900.0 MB free (a, b;"
    )
    # A pipeline puts on b the layers it holds.
    assert len(place(tensor_card(), state, PlacementRequest(min_nodes=2)).ranks) == 2


def test_a_qwen3_moe_card_splits_by_tensors_unevenly_across_three_nodes() -> None:
    model = card_from_config(ModelId("qwen3-235b-4bit"), QWEN3_235B)
    assert (model.n_heads, model.n_kv_heads) == (64, 4)
    assert (model.intermediate_size, model.moe_intermediate_size) == (12288, 1536)
    state = cluster(node("a", 96), node("b", 96), node("c", 96))
    placements = preview(model, state, TENSOR)
    assert {len(p.ranks) for p in placements} == {2, 3}
    assert {p.sharding for p in placements} == {"tensor"}
    whole = rank_memory(model, "metal", 0, model.n_layers)
    pairs = [p for p in placements if len(p.ranks) == 2]
    for placement in pairs:  # each node half of the ~132 GB
        for memory in placement.memory_bytes.values():
            assert 0.5 * whole < memory < 0.52 * whole
    # Three nodes: 4 KV heads go 2/1/1 (with their 32/16/16 query heads), the
    # experts' widths in thirds: the first node holds half of the heads' weights.
    (three,) = (p for p in placements if len(p.ranks) == 3)
    first, second, third = (three.memory_bytes[r.node_id] for r in three.ranks)
    assert 0.5 * whole < first < 0.52 * whole
    assert second == third and 0.33 * whole < second < 0.35 * whole
    assert three.kv_bytes[three.ranks[0].node_id] == 2 * three.kv_bytes[three.ranks[1].node_id]
    five = cluster(*(node(n, 96) for n in "abcde"))
    with pytest.raises(PlacementError) as refused:
        place(model, five, PlacementRequest(min_nodes=5, sharding="tensor"))
    assert str(refused.value) == (
        "cannot split qwen3-235b-4bit by tensors: across 5 nodes, 5 ranks need 5 KV heads at "
        "least, it has 4"
    )


@pytest.mark.parametrize(
    ("overrides", "nodes", "message"),
    [
        (
            {"architecture": "gpt_oss", "n_heads": 32, "n_kv_heads": 8, "intermediate_size": 14336},
            3,
            "cannot split m by tensors: across 3 nodes, 3 does not divide its attention heads "
            "(32), KV heads (8), MLP intermediate size (14336)",
        ),
        (
            {"n_heads": 8, "n_kv_heads": 1},
            2,
            "cannot split m by tensors: across 2 nodes, 2 ranks need 2 KV heads at least, it has 1",
        ),
        (
            {"n_heads": 4, "n_kv_heads": 4, "head_dim": 32, "moe_intermediate_size": 6},
            4,
            "across 4 nodes, its MoE expert intermediate size (6) does not split into 4 parts "
            "of whole quantization groups (32)",
        ),
        (
            {"n_heads": 6, "n_kv_heads": 3, "head_dim": 64},
            3,  # 2 and 3 ranks take whole KV heads, 4 do not: the set sizes 2..4 leave 2 and 3
            None,
        ),
    ],
)
def test_a_tensor_split_needs_whole_heads_and_groups_for_each_rank(
    overrides: dict[str, Any], nodes: int, message: str | None
) -> None:
    state = cluster(*(node(n, 8) for n in "abcd"[: max(nodes, 3)]))
    request = PlacementRequest(min_nodes=nodes, max_nodes=nodes, sharding="tensor")
    if message is None:
        sizes = {len(p.ranks) for p in preview(card(**overrides), state, TENSOR)}
        assert sizes == {2, 3}
        return
    with pytest.raises(PlacementError) as refused:
        preview(card(**overrides), state, request)
    assert message in str(refused.value)


def test_a_card_without_mlp_widths_is_not_refused() -> None:
    """Unknown widths (a card from an older node) are left to the runner's load."""
    model = card(n_heads=4, n_kv_heads=2, head_dim=16)
    assert (model.intermediate_size, model.moe_intermediate_size) == (None, None)
    assert len(place(model, cluster(node("a", 8), node("b", 8)), TENSOR).ranks) == 2


@pytest.mark.parametrize(
    ("state", "request_", "message"),
    [
        (
            cluster(node("a", 8)),
            TENSOR,
            "on at least 2 nodes: the cluster has 1 node that can run models (a tensor "
            "instance needs at least 2)",
        ),
        (
            STATE,
            PlacementRequest(max_nodes=1, sharding="tensor"),
            "a tensor instance needs at least 2 nodes (each holds a slice of every layer), "
            "not at most 1 node",
        ),
    ],
)
def test_a_tensor_instance_needs_two_nodes(
    state: State, request_: PlacementRequest, message: str
) -> None:
    assert MIN_TENSOR_RANKS == 2
    with pytest.raises(PlacementError, match=re.escape(message)):
        place(tensor_card(), state, request_)


def test_min_nodes_one_is_taken_as_two_for_a_tensor_instance() -> None:
    # One node holds the whole model; a tensor placement still takes two.
    placements = preview(tensor_card(), STATE, PlacementRequest(min_nodes=1, sharding="tensor"))
    # 3 ranks would cut its KV heads' quantization groups (head_dim 8, groups of 32)
    assert {len(p.ranks) for p in placements} == {2}
    assert placements[0].node_ids == ("a", "b")


def test_tensor_placement_refuses_an_architecture_with_no_strategy() -> None:
    refusal = tensor_refusal("rwkv7")
    assert refusal is not None and "no shard()" in refusal
    with pytest.raises(PlacementError) as refused:
        place(tensor_card(architecture="rwkv7"), STATE, TENSOR)
    assert str(refused.value) == f"cannot split m by tensors: {refusal}"
    # A pipeline placement of it is the whole model on one node.
    assert len(place(tensor_card(architecture="rwkv7"), STATE).ranks) == 1


def test_download_progress_steers_a_tensor_placement() -> None:
    state = cluster(node("a", 32), node("b", 16), node("c", 8))
    best = place(tensor_card(), state, TENSOR, progress=progress_of(b=1.0, c=1.0))
    assert best.node_ids == ("b", "c") and best.download_progress == 2.0


def test_placing_by_tensors_places_what_the_first_preview_shows() -> None:
    model = tensor_card()
    state = with_addresses(STATE).model_copy(update={"cards": {model.model_id: model}})
    [first, *_] = preview(model, state, TENSOR)
    command = PlaceInstance(
        instance_id=InstanceId("new"), model_id=model.model_id, sharding="tensor"
    )
    [created] = [e for e in decide(state, command) if isinstance(e, InstanceCreated)]
    assert created.instance.sharding == "tensor"
    assert created.instance.ranks == first.ranks
    assert created.instance.n_layers == model.n_layers
    assert len(created.instance.ring_hosts) == 2
