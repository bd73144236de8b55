"""Placement: which nodes serve which layers of a model. Pure: no I/O.

Candidates are the nodes that have reported telemetry, do not serve the model
already (a node holds one rank of a model at most) and can hold at least one
layer; every subset of them (all nodes reach each other for now) with
`min_nodes`..`max_nodes` members is tried. A set is feasible when each node's
free RAM holds what its rank needs (`exo.models.memory.rank_memory`), and its
layers are split in proportion to the nodes' free RAM by the layers' own sizes
(a mixture-of-experts layer weighs more than a dense one). Feasible sets are
ranked by download progress, then free RAM, then size, then node ids;
`preview` returns all of them, best first, and `place` the best: what
`POST /place_instance` places is what the first preview shows.

A tensor placement (`sharding="tensor"`) gives every node of a set a slice of
every layer: the set needs at least `MIN_TENSOR_RANKS` nodes, an architecture
exo can split by tensors (`exo.shared.architectures.tensor_refusal`) and a set
size its heads and MLP widths split into (`exo.shared.tensor_split.card_split`:
unevenly where exo slices the family itself); each node must hold its share (`exo.models.memory.tensor_rank_weights`,
`tensor_rank_kv`). Candidates and ranking are the pipeline's.

"Free" RAM here is a node's available RAM minus a safety margin of its total RAM.
"""

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import accumulate, combinations, pairwise

from pydantic import Field

from exo.models.memory import (
    kv_reserve_tokens,
    layer_costs,
    layers_that_fit,
    rank_kv,
    rank_memory,
    rank_weights,
    tensor_rank_kv,
    tensor_rank_weights,
)
from exo.models.weight_files import shard_files
from exo.shared.architectures import loadable_whole, pipeline_refusal, tensor_refusal
from exo.shared.tensor_split import TensorSplit, card_split
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import InstanceRank, MlxBackend, NodeTelemetry, Sharding, State
from exo.shared.units import human_bytes

# RAM left to the OS and other programs: this share of a node's total RAM is
# never counted as free.
SAFETY_MARGIN_PERCENT = 10
# Only the nodes with the most free RAM are considered: 2^8 - 1 subsets at most.
MAX_CANDIDATE_NODES = 8
# A backend that keeps weights as stored and a float16 cache.
_AS_STORED: MlxBackend = "metal"
# One rank holding slices of every layer is the whole model with extra steps.
MIN_TENSOR_RANKS = 2


class PlacementError(ValueError):
    """No placement fits; the message says why, in units a user reads."""


class PlacementRequest(FrozenModel):
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)
    sharding: Sharding = "pipeline"


class Placement(FrozenModel):
    model_id: ModelId
    sharding: Sharding = "pipeline"
    # Pipeline: in pipeline order, the layer ranges cover [0, n_layers).
    # Tensor: in ring order, every rank [0, n_layers).
    ranks: tuple[InstanceRank, ...]
    # RAM each rank's node needs: `weight_bytes` + `kv_bytes`.
    memory_bytes: dict[NodeId, int]
    # Its layers (a tensor rank: its slice of each), embedding (first rank; every
    # tensor rank) and head (last; every tensor rank) as loaded on its backend.
    weight_bytes: dict[NodeId, int]
    # Its layers' cache reserve: KV (sliding windows capped), recurrent states.
    kv_bytes: dict[NodeId, int]
    download_progress: float  # sum over the ranks' nodes of their fractions (0..1)
    free_bytes: int  # the nodes' free RAM together

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return tuple(rank.node_id for rank in self.ranks)


def free_bytes(telemetry: NodeTelemetry) -> int:
    """Available RAM minus the safety margin."""
    margin = telemetry.ram_total * SAFETY_MARGIN_PERCENT // 100
    return max(0, telemetry.ram_available - margin)


# The most layers part `i` of a split holds when its layers begin at `start`.
CapFn = Callable[[int, int], int]


def _proportional(sizes: Sequence[int], weights: Sequence[int]) -> list[int]:
    """Consecutive layer counts whose summed `sizes` are in proportion to `weights`.

    Part i's share of the total size spans a fractional number of layers; each
    part gets that rounded down and the leftover layers go to the largest
    remainders, ties to the larger weight, then to the earlier part. With equal
    sizes this is the largest-remainder split of the layer count.
    """
    k = len(weights)
    if not sizes:
        return [0] * k
    if sum(weights) <= 0:
        weights = [1] * k
    sizes = [max(1, size) for size in sizes]
    bounds = list(accumulate(sizes, initial=0))

    def position(target: Fraction) -> Fraction:
        """How many layers (fractionally) it takes to reach `target` bytes."""
        j = min(bisect_right(bounds, target) - 1, len(sizes) - 1)
        return j + (target - bounds[j]) / sizes[j]

    whole = sum(weights)
    positions = [position(Fraction(bounds[-1] * c, whole)) for c in accumulate(weights, initial=0)]
    shares = [b - a for a, b in pairwise(positions)]
    counts = [math.floor(share) for share in shares]
    order = sorted(range(k), key=lambda i: (counts[i] - shares[i], -weights[i], i))
    for i in order[: len(sizes) - sum(counts)]:
        counts[i] += 1
    return counts


def _starts(counts: Sequence[int]) -> list[int]:
    return list(accumulate(counts, initial=0))[:-1]


def _fits(counts: Sequence[int], n_layers: int, cap: CapFn) -> bool:
    return sum(counts) == n_layers and all(
        1 <= count <= cap(i, start)
        for i, (count, start) in enumerate(zip(counts, _starts(counts), strict=True))
    )


def _closest_fit(n_layers: int, target: Sequence[int], cap: CapFn) -> list[int] | None:
    """The split that fits with each part's end nearest its end under the
    `target` counts (the earlier parts first); None when no split fits."""
    k = len(target)
    # finishes[i][s]: parts i.. can hold layers [s, n_layers) between them.
    finishes = [[False] * (n_layers + 1) for _ in range(k)] + [[False] * n_layers + [True]]
    most = [[min(cap(i, s), n_layers - s) for s in range(n_layers)] for i in range(k)]
    for i in reversed(range(k)):
        after = list(accumulate(finishes[i + 1], initial=0))  # after[e]: finishes before e
        for s in range(n_layers):
            finishes[i][s] = after[s + most[i][s] + 1] > after[s + 1]
    if not finishes[0][0]:
        return None
    counts: list[int] = []
    start = 0
    for i, goal in enumerate(accumulate(target)):
        ends = range(start + 1, start + most[i][start] + 1)
        end = min((e for e in ends if finishes[i + 1][e]), key=lambda e: (abs(e - goal), e))
        counts.append(end - start)
        start = end
    return counts


def split_layers(sizes: Sequence[int], weights: Sequence[int], cap: CapFn) -> list[int] | None:
    """Consecutive layer counts, one part per weight, each at least 1 layer and
    at most `cap(i, start)`, with the parts' summed layer `sizes` in proportion
    to `weights` (`_proportional`); None when no split fits.

    A part whose share exceeds its cap gets its cap and the other parts split
    the remaining layers again, so with caps that are not binding the result is
    the plain proportional split. A cap depends on where the part's layers
    start, which moves as the others' counts change, so the split is checked
    at the end; if it does not fit, the split that fits nearest the plain
    proportional one is taken (`_closest_fit`).
    """
    n_layers, k = len(sizes), len(weights)
    if k == 0 or n_layers < k:
        return None
    target = _proportional(sizes, weights)
    counts = list(target)
    fixed: set[int] = set()
    for _ in range(2 * k):
        over = [i for i, start in enumerate(_starts(counts)) if counts[i] > cap(i, start)]
        if not over:
            break
        for i, start in enumerate(_starts(counts)):
            if i in over:
                counts[i] = cap(i, start)
                fixed.add(i)
        active = [i for i in range(k) if i not in fixed]
        if not active:
            break
        held = {
            layer
            for i, start in enumerate(_starts(counts))
            if i in fixed
            for layer in range(start, start + counts[i])
        }
        shares = _proportional(
            [size for layer, size in enumerate(sizes) if layer not in held],
            [weights[i] for i in active],
        )
        for i, share in zip(active, shares, strict=True):
            counts[i] = share
    for i in range(k):
        if counts[i] == 0:
            # Take a layer from the part with the most (the later one on ties).
            donor = max(range(k), key=lambda j: (counts[j], j))
            counts[donor] -= 1
            counts[i] = 1
    return counts if _fits(counts, n_layers, cap) else _closest_fit(n_layers, target, cap)


def _order(nodes: Sequence[tuple[NodeId, NodeTelemetry]]) -> list[tuple[NodeId, NodeTelemetry]]:
    """Most free RAM first, then node id: the pipeline order of a set."""
    return sorted(nodes, key=lambda node: (-free_bytes(node[1]), node[0]))


# A node's downloaded fraction (0..1) of the files it needs for layers [start, end).
ProgressFn = Callable[[NodeId, int, int], float]


def _place_on(
    card: ModelCard,
    nodes: Sequence[tuple[NodeId, NodeTelemetry]],
    progress: ProgressFn,
) -> Placement | None:
    k = len(nodes)
    budgets = [free_bytes(t) for _, t in nodes]
    backends: list[MlxBackend] = [t.mlx_backend for _, t in nodes]
    costs = {backend: layer_costs(card, backend) for backend in dict.fromkeys(backends)}
    totals = {backend: list(accumulate(c, initial=0)) for backend, c in costs.items()}
    # Proportions by the layers' RAM on the set's backend; a set that mixes
    # backends weighs them as stored.
    sizes = costs[backends[0]] if len(costs) == 1 else layer_costs(card, _AS_STORED)

    def cap(i: int, start: int) -> int:
        backend = backends[i]
        first, last = i == 0, i == k - 1
        return layers_that_fit(
            card, backend, budgets[i], first=first, last=last, start=start, totals=totals[backend]
        )

    counts = split_layers(sizes, budgets, cap)
    if counts is None:
        return None
    ranks: list[InstanceRank] = []
    weights: dict[NodeId, int] = {}
    kv: dict[NodeId, int] = {}
    start = 0
    for (node_id, telemetry), count in zip(nodes, counts, strict=True):
        end = start + count
        ranks.append(InstanceRank(node_id=node_id, start_layer=start, end_layer=end))
        weights[node_id] = rank_weights(card, telemetry.mlx_backend, start, end)
        kv[node_id] = rank_kv(card, telemetry.mlx_backend, start, end)
        start = end
    return _placement(card, "pipeline", ranks, weights, kv, sum(budgets), progress)


def _place_tensor_on(
    card: ModelCard,
    nodes: Sequence[tuple[NodeId, NodeTelemetry]],
    progress: ProgressFn,
) -> Placement | None:
    """Every node a slice of every layer, when each holds its share (the first
    nodes the larger shares of an uneven split)."""
    split = card_split(card, len(nodes))
    if not isinstance(split, TensorSplit):
        return None
    weights = {
        node_id: tensor_rank_weights(card, t.mlx_backend, split.weight_share(rank))
        for rank, (node_id, t) in enumerate(nodes)
    }
    kv = {
        node_id: tensor_rank_kv(card, t.mlx_backend, split.kv_share(rank))
        for rank, (node_id, t) in enumerate(nodes)
    }
    if any(weights[node_id] + kv[node_id] > free_bytes(t) for node_id, t in nodes):
        return None
    ranks = [
        InstanceRank(
            node_id=node_id,
            start_layer=0,
            end_layer=card.n_layers,
            kv_heads=split.kv_heads[rank] if split.kv_heads is not None else None,
        )
        for rank, (node_id, _) in enumerate(nodes)
    ]
    return _placement(
        card, "tensor", ranks, weights, kv, sum(free_bytes(t) for _, t in nodes), progress
    )


def _placement(
    card: ModelCard,
    sharding: Sharding,
    ranks: Sequence[InstanceRank],
    weights: dict[NodeId, int],
    kv: dict[NodeId, int],
    free: int,
    progress: ProgressFn,
) -> Placement:
    return Placement(
        model_id=card.model_id,
        sharding=sharding,
        ranks=tuple(ranks),
        memory_bytes={node_id: weights[node_id] + kv[node_id] for node_id in weights},
        weight_bytes=weights,
        kv_bytes=kv,
        download_progress=sum(
            min(1.0, max(0.0, progress(r.node_id, r.start_layer, r.end_layer))) for r in ranks
        ),
        free_bytes=free,
    )


def _rank_key(placement: Placement) -> tuple[float, int, int, tuple[NodeId, ...]]:
    return (
        -round(placement.download_progress, 9),
        -placement.free_bytes,
        len(placement.ranks),
        tuple(sorted(placement.node_ids)),
    )


def _shortfall(
    card: ModelCard,
    request: PlacementRequest,
    nodes: Sequence[tuple[NodeId, NodeTelemetry]],
    eligible: Sequence[tuple[NodeId, NodeTelemetry]],
    candidates: Sequence[tuple[NodeId, NodeTelemetry]],
    sizes: Sequence[int],
) -> str:
    """Why no set of `sizes` nodes among `candidates` holds the model."""
    pool = list(candidates) or _order(nodes)[:1]
    size = max(sizes, default=min(request.max_nodes or len(pool), len(pool), card.n_layers))
    largest = pool[:size]
    backends: list[MlxBackend] = sorted({t.mlx_backend for _, t in largest})
    ids = ", ".join(n for n, _ in largest)
    how = (
        f"{ids}; weights as loaded on {'/'.join(backends)} plus a KV reserve of "
        f"{kv_reserve_tokens(card)} tokens; free RAM keeps {SAFETY_MARGIN_PERCENT}% of each "
        "node's RAM in reserve"
    )
    tensor = request.sharding == "tensor"
    split = card_split(card, len(largest)) if tensor else None
    if isinstance(split, TensorSplit):
        need = max(
            tensor_rank_weights(card, b, split.weight_share(0))
            + tensor_rank_kv(card, b, split.kv_share(0))
            for b in backends
        )
        have = min(free_bytes(t) for _, t in largest)
        last = len(largest) - 1
        even = (split.weight_share(0), split.kv_share(0)) == (
            split.weight_share(last),
            split.kv_share(last),
        )
        message = (
            f"{card.model_id} split by tensors needs {'' if even else 'up to '}"
            f"{human_bytes(need)} on each of "
            f"{len(largest)} nodes (a slice of every layer, the embedding and head whole), "
            f"the candidate set's smallest node has {human_bytes(have)} free ({how})"
        )
    else:
        need = max(rank_memory(card, b, 0, card.n_layers) for b in backends)
        have = sum(free_bytes(t) for _, t in largest)
        message = (
            f"{card.model_id} needs {human_bytes(need)}, the largest candidate set has "
            f"{human_bytes(have)} free ({how})"
        )
    eligible_ids = {n for n, _ in eligible}
    small = [n for n, _ in nodes if n not in eligible_ids]
    if small:
        message += f"; too small for even one layer: {', '.join(small)}"
    if len(candidates) < request.min_nodes:
        message += (
            f"; at least {_nodes(request.min_nodes)} were asked for, but only "
            f"{len(candidates)} can hold a layer"
        )
    elif need <= have and not tensor:
        message += (
            f"; its nodes together cannot hold all {card.n_layers} layers with the "
            "embedding and head on the first and last node"
        )
    return message


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def download_progress(card: ModelCard, state: State) -> ProgressFn:
    """From the state: the share of the bytes of its shard's files (weights by
    size, each other file as one byte) a node already has complete."""
    sizes = {f.name: f.size_bytes or 1 for f in card.weight_files}

    def fraction(node_id: NodeId, start: int, end: int) -> float:
        download = state.downloads.get(node_id, {}).get(card.model_id)
        if download is None:
            return 0.0
        needed = shard_files(card, start, end)
        have = needed & set(download.have_files)
        total = sum(sizes.get(name, 1) for name in needed)
        return sum(sizes.get(name, 1) for name in have) / total if total else 1.0

    return fraction


def _serving_nodes(model_id: ModelId, state: State) -> set[NodeId]:
    """The nodes that already serve `model_id` (they cannot take another rank of it)."""
    return {
        node_id
        for instance in state.instances.values()
        if instance.model_id == model_id
        for node_id in instance.node_ids
    }


def _tensor_request(card: ModelCard, request: PlacementRequest) -> PlacementRequest:
    """`request`, with at least `MIN_TENSOR_RANKS` nodes; raises `PlacementError`
    for an architecture exo cannot split by tensors or a request for one node."""
    refusal = tensor_refusal(card.architecture)
    if refusal is not None:
        raise PlacementError(f"cannot split {card.model_id} by tensors: {refusal}")
    if request.max_nodes is not None and request.max_nodes < MIN_TENSOR_RANKS:
        raise PlacementError(
            f"a tensor instance needs at least {MIN_TENSOR_RANKS} nodes (each holds a slice "
            f"of every layer), not at most {_nodes(request.max_nodes)}"
        )
    return request.model_copy(update={"min_nodes": max(MIN_TENSOR_RANKS, request.min_nodes)})


def _servable(card: ModelCard, request: PlacementRequest) -> PlacementRequest:
    """`request`, limited to one node for an architecture exo cannot split into
    a pipeline, or with enough nodes for a tensor split; raises `PlacementError`
    for one it cannot load at all, or cannot split as `request` needs."""
    arch = card.architecture
    if not loadable_whole(arch):
        raise PlacementError(
            f"cannot place {card.model_id}: exo cannot load its architecture {arch!r} "
            "(mlx-lm has no model for it)"
        )
    if request.sharding == "tensor":
        return _tensor_request(card, request)
    refusal = pipeline_refusal(arch)
    if refusal is None:
        return request
    if request.min_nodes > 1:
        raise PlacementError(
            f"cannot split {card.model_id} across {request.min_nodes} nodes: {refusal}; "
            "it can be served whole on one node"
        )
    return request.model_copy(update={"max_nodes": 1})


def preview(
    card: ModelCard,
    state: State,
    request: PlacementRequest | None = None,
    *,
    progress: ProgressFn | None = None,
) -> list[Placement]:
    """Every feasible placement of `card` on the cluster, best first.

    `progress` gives a node's downloaded fraction (0..1) of the files it would
    need for a range of layers; by default it is read from the state's
    downloads. Raises `PlacementError` when none is feasible.
    """
    request = _servable(card, request or PlacementRequest())
    if progress is None:
        progress = download_progress(card, state)
    reporting = [
        (n, info.telemetry)
        for n, info in sorted(state.nodes.items())
        if info.telemetry and info.telemetry.accepts_instances
    ]
    if not reporting:
        raise PlacementError(
            f"cannot place {card.model_id}: no node that runs models has reported its memory "
            "yet (nodes started with --no-worker run none)"
        )
    if request.max_nodes is not None and request.max_nodes < request.min_nodes:
        raise PlacementError(
            f"at most {_nodes(request.max_nodes)} and at least {_nodes(request.min_nodes)} "
            "were asked for: the most cannot be fewer than the least"
        )
    tensor = request.sharding == "tensor"
    if request.min_nodes > len(reporting):
        raise PlacementError(
            f"cannot place {card.model_id} on at least {_nodes(request.min_nodes)}: the "
            f"cluster has {_nodes(len(reporting))} that can run models"
            + (f" (a tensor instance needs at least {MIN_TENSOR_RANKS})" if tensor else "")
        )
    if not tensor and request.min_nodes > card.n_layers:
        raise PlacementError(
            f"{card.model_id} has {card.n_layers} layers: it cannot be split across "
            f"{request.min_nodes} nodes"
        )
    serving = _serving_nodes(card.model_id, state)
    nodes = [(n, t) for n, t in reporting if n not in serving]
    if len(nodes) < request.min_nodes:
        raise PlacementError(
            f"{card.model_id} already has an instance on {', '.join(sorted(serving))}; only "
            f"{len(nodes)} other node{'' if len(nodes) == 1 else 's'} can take one (at least "
            f"{_nodes(request.min_nodes)} "
            "were asked for); "
            "delete an instance first"
        )
    backends: set[MlxBackend] = {t.mlx_backend for _, t in nodes}
    smallest_layer = {b: min(layer_costs(card, b), default=0) for b in backends}
    eligible = [(n, t) for n, t in nodes if free_bytes(t) >= max(1, smallest_layer[t.mlx_backend])]
    candidates = _order(eligible)[:MAX_CANDIDATE_NODES]
    # A pipeline rank holds one layer at least; a tensor rank a slice of each.
    most = len(candidates) if tensor else min(len(candidates), card.n_layers)
    sizes = list(range(request.min_nodes, min(request.max_nodes or most, most) + 1))
    if tensor:
        splits = {size: card_split(card, size) for size in sizes}
        refused = {size: why for size, why in splits.items() if isinstance(why, str)}
        sizes = [size for size in sizes if size not in refused]
        if not sizes and refused:
            raise PlacementError(
                f"cannot split {card.model_id} by tensors: "
                + "; ".join(f"across {size} nodes, {why}" for size, why in refused.items())
            )
    place_on = _place_tensor_on if tensor else _place_on
    placements: list[Placement] = []
    for size in sizes:
        for subset in combinations(candidates, size):
            placement = place_on(card, _order(subset), progress)
            if placement is not None:
                placements.append(placement)
    if not placements:
        raise PlacementError(_shortfall(card, request, nodes, eligible, candidates, sizes))
    return sorted(placements, key=_rank_key)


def place(
    card: ModelCard,
    state: State,
    request: PlacementRequest | None = None,
    *,
    progress: ProgressFn | None = None,
) -> Placement:
    """The best placement (`preview`'s first); raises `PlacementError` if none fits."""
    return preview(card, state, request, progress=progress)[0]
