"""Placement: which nodes serve which layers of a model. Pure: no I/O.

Candidates are the nodes that have reported telemetry, do not serve the model
already (a node holds one rank of a model at most) and can hold at least one
layer; every subset of them (all nodes reach each other for now) with
`min_nodes`..`max_nodes` members is tried. A set is feasible when each node's
free RAM holds what its rank needs (`exo.models.memory.rank_memory`). Feasible
sets are ranked by download progress, then free RAM, then size, then node ids;
`preview` returns all of them, best first, and `place` the best: what
`POST /place_instance` places is what the first preview shows.

"Free" RAM here is a node's available RAM minus a safety margin of its total RAM.
"""

from collections.abc import Callable, Sequence
from itertools import combinations

from pydantic import Field

from exo.models.memory import kv_reserve_tokens, layer_cost, layers_that_fit, rank_memory
from exo.models.weight_files import shard_files
from exo.shared.architectures import SHARDABLE_ARCHITECTURES, loadable_whole, shardable
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import InstanceRank, MlxBackend, NodeTelemetry, State
from exo.shared.units import human_bytes

# RAM left to the OS and other programs: this share of a node's total RAM is
# never counted as free.
SAFETY_MARGIN_PERCENT = 10
# Only the nodes with the most free RAM are considered: 2^8 - 1 subsets at most.
MAX_CANDIDATE_NODES = 8


class PlacementError(ValueError):
    """No placement fits; the message says why, in units a user reads."""


class PlacementRequest(FrozenModel):
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)


class Placement(FrozenModel):
    model_id: ModelId
    ranks: tuple[InstanceRank, ...]  # in pipeline order; layer ranges cover [0, n_layers)
    # RAM each rank's node needs: weights as loaded on its backend plus the KV reserve.
    memory_bytes: dict[NodeId, int]
    download_progress: float  # sum over the ranks' nodes of their fractions (0..1)
    free_bytes: int  # the nodes' free RAM together

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return tuple(rank.node_id for rank in self.ranks)


def free_bytes(telemetry: NodeTelemetry) -> int:
    """Available RAM minus the safety margin."""
    margin = telemetry.ram_total * SAFETY_MARGIN_PERCENT // 100
    return max(0, telemetry.ram_available - margin)


def _largest_remainder(n: int, weights: Sequence[int]) -> list[int]:
    """`n` split in proportion to `weights`; leftover units go to the largest
    remainders, ties to the larger weight, then to the earlier position."""
    total = sum(weights)
    if total <= 0:
        weights, total = [1] * len(weights), len(weights)
    counts = [n * w // total for w in weights]
    remainders = [n * w % total for w in weights]
    order = sorted(range(len(weights)), key=lambda i: (-remainders[i], -weights[i], i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def split_layers(n_layers: int, weights: Sequence[int], caps: Sequence[int]) -> list[int] | None:
    """Layer counts in proportion to `weights` (largest remainder), each at least 1
    and at most its cap; None when impossible (fewer layers than parts, or caps
    too small).

    A part whose proportional share exceeds its cap gets its cap and the rest is
    split again among the others, so with caps that are not binding the result
    is the plain proportional split.
    """
    k = len(weights)
    limits = list(caps)
    if (
        k == 0
        or n_layers < k
        or min(limits) < 1
        or sum(min(c, n_layers) for c in limits) < n_layers
    ):
        return None
    counts = [0] * k
    active = list(range(k))
    left = n_layers
    while True:
        shares = _largest_remainder(left, [weights[i] for i in active])
        over = [i for i, share in zip(active, shares, strict=True) if share > limits[i]]
        if not over:
            for i, share in zip(active, shares, strict=True):
                counts[i] = share
            break
        for i in over:
            counts[i] = limits[i]
            left -= limits[i]
        active = [i for i in active if i not in over]
        if not active:
            return None
    for i in range(k):
        if counts[i] == 0:
            # Take a layer from the part with the most (the later one on ties).
            donor = max(range(k), key=lambda j: (counts[j], j))
            counts[donor] -= 1
            counts[i] = 1
    return counts


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
    caps = [
        layers_that_fit(card, t.mlx_backend, budget, first=i == 0, last=i == k - 1)
        for i, ((_, t), budget) in enumerate(zip(nodes, budgets, strict=True))
    ]
    counts = split_layers(card.n_layers, budgets, caps)
    if counts is None:
        return None
    ranks: list[InstanceRank] = []
    memory: dict[NodeId, int] = {}
    start = 0
    for (node_id, telemetry), count in zip(nodes, counts, strict=True):
        end = start + count
        ranks.append(InstanceRank(node_id=node_id, start_layer=start, end_layer=end))
        memory[node_id] = rank_memory(card, telemetry.mlx_backend, start, end)
        start = end
    return Placement(
        model_id=card.model_id,
        ranks=tuple(ranks),
        memory_bytes=memory,
        download_progress=sum(
            min(1.0, max(0.0, progress(r.node_id, r.start_layer, r.end_layer))) for r in ranks
        ),
        free_bytes=sum(budgets),
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
) -> str:
    pool = list(candidates) or _order(nodes)[:1]
    size = min(request.max_nodes or len(pool), len(pool), card.n_layers)
    largest = pool[:size]
    backends: list[MlxBackend] = sorted({t.mlx_backend for _, t in largest})
    need = max(rank_memory(card, b, 0, card.n_layers) for b in backends)
    have = sum(free_bytes(t) for _, t in largest)
    ids = ", ".join(n for n, _ in largest)
    message = (
        f"{card.model_id} needs {human_bytes(need)}, the largest candidate set has "
        f"{human_bytes(have)} free ({ids}; weights as loaded on {'/'.join(backends)} plus "
        f"a KV reserve of {kv_reserve_tokens(card)} tokens; free RAM "
        f"keeps {SAFETY_MARGIN_PERCENT}% of each node's RAM in reserve)"
    )
    eligible_ids = {n for n, _ in eligible}
    small = [n for n, _ in nodes if n not in eligible_ids]
    if small:
        message += f"; too small for even one layer: {', '.join(small)}"
    if len(candidates) < request.min_nodes:
        message += (
            f"; min_nodes={request.min_nodes} but only {len(candidates)} node(s) can hold a layer"
        )
    elif need <= have:
        message += (
            f"; its nodes together cannot hold all {card.n_layers} layers with the "
            "embedding and head on the first and last node"
        )
    return message


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


def _servable(card: ModelCard, request: PlacementRequest) -> PlacementRequest:
    """`request`, limited to one node for an architecture exo cannot split;
    raises `PlacementError` for one it cannot load at all, or cannot split
    when `request` needs several nodes."""
    arch = card.architecture
    split = ", ".join(sorted(SHARDABLE_ARCHITECTURES))
    if not loadable_whole(arch):
        raise PlacementError(
            f"cannot place {card.model_id}: exo cannot load its architecture {arch!r} "
            f"(mlx-lm has no model for it); supported across nodes: {split}"
        )
    if shardable(arch):
        return request
    if request.min_nodes > 1:
        raise PlacementError(
            f"cannot split {card.model_id} across {request.min_nodes} nodes: its architecture "
            f"{arch!r} can only be served whole on one node; supported across nodes: {split}"
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
            f"max_nodes={request.max_nodes} is less than min_nodes={request.min_nodes}"
        )
    if request.min_nodes > len(reporting):
        raise PlacementError(
            f"min_nodes={request.min_nodes} but only {len(reporting)} node(s) have reported "
            "telemetry"
        )
    if request.min_nodes > card.n_layers:
        raise PlacementError(
            f"{card.model_id} has {card.n_layers} layers: it cannot be split across "
            f"{request.min_nodes} nodes"
        )
    serving = _serving_nodes(card.model_id, state)
    nodes = [(n, t) for n, t in reporting if n not in serving]
    if len(nodes) < request.min_nodes:
        raise PlacementError(
            f"{card.model_id} already has an instance on {', '.join(sorted(serving))}; only "
            f"{len(nodes)} other node(s) can take one (min_nodes={request.min_nodes}); "
            "delete an instance first"
        )
    eligible = [
        (n, t) for n, t in nodes if free_bytes(t) >= max(1, layer_cost(card, t.mlx_backend))
    ]
    candidates = _order(eligible)[:MAX_CANDIDATE_NODES]
    max_nodes = min(request.max_nodes or len(candidates), len(candidates), card.n_layers)
    placements: list[Placement] = []
    for size in range(request.min_nodes, max_nodes + 1):
        for subset in combinations(candidates, size):
            placement = _place_on(card, _order(subset), progress)
            if placement is not None:
                placements.append(placement)
    if not placements:
        raise PlacementError(_shortfall(card, request, nodes, eligible, candidates))
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
