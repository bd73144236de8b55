import re
from itertools import pairwise
from typing import Any

import pytest

from exo.master.placement import (
    KV_RESERVE_TOKENS,
    MAX_CANDIDATE_NODES,
    Placement,
    PlacementError,
    PlacementRequest,
    free_bytes,
    human_bytes,
    kv_reserve_per_layer,
    layer_cost,
    place,
    preview,
    split_layers,
)
from exo.models.cards import ModelCard, Quantization
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import MlxBackend, NodeInfo, NodeTelemetry, State

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


def progress_of(**fractions: float) -> dict[NodeId, float]:
    return {NodeId(n): f for n, f in fractions.items()}


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
    assert split_layers(n_layers, weights, caps) == expected


def test_layers_split_in_proportion_to_free_ram() -> None:
    model = card()
    state = cluster(node("c", 10), node("a", 30), node("b", 20))
    placement = place(model, state)
    assert layout(placement) == [("a", 0, 15), ("b", 15, 25), ("c", 25, 30)]
    cost = model.layer_bytes + kv_reserve_per_layer(model, "metal")
    assert [r.memory_bytes for r in placement.ranks] == [
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
        ({}, PlacementRequest(max_nodes=1), ["a"]),
        ({}, PlacementRequest(), ["a", "b", "c"]),
        ({}, PlacementRequest(min_nodes=2, max_nodes=2), ["a", "b"]),
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
    progress: dict[NodeId, float], request_: PlacementRequest, nodes: list[str]
) -> None:
    placement = place(card(), STATE, progress, request_)
    assert list(placement.node_ids) == nodes


def test_preview_ranks_progress_then_ram_then_fewer_nodes_then_ids() -> None:
    state = cluster(node("a", 20), node("b", 10), node("c", 10))
    placements = preview(card(), state, progress_of(a=0.5, b=0.25, c=0.25))
    assert [(p.node_ids, p.download_progress, p.free_bytes // GB) for p in placements] == [
        (("a", "b", "c"), 1.0, 36),
        (("a", "b"), 0.75, 27),
        (("a", "c"), 0.75, 27),
        (("a",), 0.5, 18),  # same progress and RAM as (b, c): fewer nodes first
        (("b", "c"), 0.5, 18),
        (("b",), 0.25, 9),
        (("c",), 0.25, 9),
    ]
    assert place(card(), state, progress_of(a=0.5, b=0.25, c=0.25)) == placements[0]


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
        assert all(r.n_layers >= 1 for r in ranks)
        for rank in ranks:
            telemetry = state.nodes[rank.node_id].telemetry
            assert telemetry is not None
            assert rank.memory_bytes <= free_bytes(telemetry)


def test_a_node_too_small_for_one_layer_is_excluded() -> None:
    model = card(layer_bytes=1 * GB, embedding_bytes=0, head_bytes=0, n_layers=4)
    # 0.9 GB free after the margin: less than one layer.
    state = cluster(node("big", 10), node("big2", 10), node("tiny", 1))
    placements = preview(model, state)
    assert placements
    assert all(NodeId("tiny") not in p.node_ids for p in placements)
    # Its download progress does not help it.
    best = place(model, state, progress_of(tiny=1.0), PlacementRequest(max_nodes=1))
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
        (STATE, PlacementRequest(min_nodes=4), "min_nodes=4 but only 3 node(s) have reported"),
        (STATE, PlacementRequest(min_nodes=3, max_nodes=2), "max_nodes=2 is less than min_nodes=3"),
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
    assert layer_cost(model, "cpu") - kv_reserve_per_layer(model, "cpu") == 640 * MB
    # 10 GB (9 GB free): 3 GB of 4-bit weights fit on Metal, 19.2 GB of float32 not.
    assert layout(place(model, cluster(node("mac", 10)))) == [("mac", 0, 30)]
    with pytest.raises(PlacementError, match=r"needs 19\.9 GB.*has 9\.0 GB free.*cpu"):
        place(model, cluster(node("linux", 10, backend="cpu")))
    # Mixed: the proportional 15/15 split would overfill the CPU node; it gets what it holds.
    mixed = cluster(node("mac", 10), node("linux", 10, backend="cpu"))
    placement = place(model, mixed, request=PlacementRequest(min_nodes=2))
    assert layout(placement) == [("linux", 0, 13), ("mac", 13, 30)]
    assert all(r.memory_bytes <= 9 * GB for r in placement.ranks)


def test_kv_reserve() -> None:
    model = card(n_layers=30)
    per_token = 2 * 1 * 8 * 30  # kv heads x head dim x layers, keys and values
    assert kv_reserve_per_layer(model, "metal") == per_token * 2 * KV_RESERVE_TOKENS // 30
    assert kv_reserve_per_layer(model, "cpu") == per_token * 4 * KV_RESERVE_TOKENS // 30
    short = card(n_layers=30, context_length=1024)
    assert kv_reserve_per_layer(short, "metal") == per_token * 2 * 1024 // 30


def test_only_the_nodes_with_the_most_free_ram_are_candidates() -> None:
    nodes = [node(f"n{i:02d}", 10 + i) for i in range(MAX_CANDIDATE_NODES + 2)]
    placements = preview(card(), cluster(*nodes), progress_of(n00=1.0, n01=1.0))
    used = {n for p in placements for n in p.node_ids}
    assert used == {NodeId(f"n{i:02d}") for i in range(2, MAX_CANDIDATE_NODES + 2)}
    assert len(placements) == 2**MAX_CANDIDATE_NODES - 1


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1500, "1.5 KB"),
        (140 * MB, "140.0 MB"),
        (2_100_000_000, "2.1 GB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text
