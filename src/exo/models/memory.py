"""RAM a model takes on a node, from its card.

Memory depends on the node's MLX backend: the CPU runner dequantizes quantized
weights and casts every weight to float32 at load (`exo.engine.mlx.load`),
Metal and CUDA keep the weights as stored. Layers differ (dense and
mixture-of-experts layers, attention and recurrent ones), so every sum here
goes layer by layer. A rank also needs room for the cache of its layers: the KV
of a reserve of `KV_RESERVE_TOKENS` tokens (or the model's context, if shorter;
a sliding-window layer keeps at most its window) and each recurrent layer's
constant-size state. The cache is float32 on the CPU backend, float16
otherwise, except recurrent states the models keep in float32 everywhere. The
prefix cache budget is separate. A tensor rank holds a slice of every layer
instead of a range of layers (`tensor_rank_weights`, `tensor_rank_kv`).
"""

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from fractions import Fraction

from exo.shared.types.model_card import LayerCache, ModelCard
from exo.shared.types.state import MlxBackend

KV_RESERVE_TOKENS = 8192
_FLOAT32_BYTES = 4
_FLOAT16_BYTES = 2


def _loaded_bytes(stored_bytes: int, params: int, backend: MlxBackend) -> int:
    return params * _FLOAT32_BYTES if backend == "cpu" else stored_bytes


def _cache_dtype_bytes(backend: MlxBackend) -> int:
    return _FLOAT32_BYTES if backend == "cpu" else _FLOAT16_BYTES


def layer_weights(card: ModelCard, backend: MlxBackend) -> tuple[int, ...]:
    """Bytes each layer's weights take in RAM once loaded on `backend`."""
    return tuple(
        _loaded_bytes(stored, params, backend)
        for stored, params in zip(card.per_layer_bytes, card.per_layer_params, strict=True)
    )


def _cache_reserve(cache: LayerCache, tokens: int, dtype_bytes: int) -> int:
    kept = tokens if cache.window is None else min(tokens, cache.window)
    return (
        kept * cache.token_elements * dtype_bytes
        + cache.state_elements * dtype_bytes
        + cache.float32_state_elements * _FLOAT32_BYTES
    )


def layer_kv(card: ModelCard, backend: MlxBackend) -> tuple[int, ...]:
    """Bytes each layer's cache reserve takes on `backend`."""
    tokens, dtype_bytes = kv_reserve_tokens(card), _cache_dtype_bytes(backend)
    return tuple(_cache_reserve(cache, tokens, dtype_bytes) for cache in card.layer_caches)


def layer_costs(card: ModelCard, backend: MlxBackend) -> tuple[int, ...]:
    """RAM each layer needs on `backend`: its weights and its cache reserve."""
    return tuple(
        w + kv for w, kv in zip(layer_weights(card, backend), layer_kv(card, backend), strict=True)
    )


def memory_other(
    card: ModelCard, backend: MlxBackend, *, first: bool = True, last: bool = True
) -> int:
    """Bytes of the non-layer weights a rank holds once loaded on `backend`.

    The first rank holds the embedding, the last the final norm and head; with
    tied embeddings the head is the embedding, so a last rank that is not also
    the first holds the embedding too. The defaults describe a single rank.
    """
    total = 0
    if first or (last and card.tie_word_embeddings):
        total += _loaded_bytes(card.embedding_bytes, card.embedding_params, backend)
    if last:
        total += _loaded_bytes(card.head_bytes, card.head_params, backend)
    return total


def kv_bytes_per_token(card: ModelCard, backend: MlxBackend) -> int:
    """Cache bytes one more token adds over all layers while the context is
    shorter than every sliding window (recurrent states do not grow)."""
    return sum(cache.token_elements for cache in card.layer_caches) * _cache_dtype_bytes(backend)


def sequence_kv(
    card: ModelCard,
    backend: MlxBackend,
    tokens: int,
    start: int = 0,
    end: int | None = None,
    kv_share: Fraction = Fraction(1),
) -> int:
    """Cache bytes one sequence of `tokens` tokens takes in layers [start, end)
    (all of them by default) on `backend`: a sliding-window layer keeps at most
    its window, a recurrent layer its constant state. With `kv_share`, a tensor
    rank's share (its KV heads': see `tensor_rank_kv`)."""
    dtype_bytes = _cache_dtype_bytes(backend)
    return sum(
        _kv_part(_cache_reserve(cache, tokens, dtype_bytes), cache, kv_share)
        for cache in card.layer_caches[start:end]
    )


def _kv_part(kv: int, cache: LayerCache, share: Fraction) -> int:
    """A tensor rank's bytes of a layer's `kv`: its heads' share, except
    multi-head latent attention's latent, which every head reads, so every rank
    keeps it whole."""
    return kv if cache.kind == "latent" else math.ceil(kv * share)


def kv_reserve_tokens(card: ModelCard) -> int:
    """Tokens of KV cache a rank reserves room for."""
    return min(card.context_length, KV_RESERVE_TOKENS)


def rank_weights(card: ModelCard, backend: MlxBackend, start: int, end: int) -> int:
    """Weights a rank serving layers [start, end) loads on `backend`: its layers,
    plus the embedding (first rank) and head (last)."""
    first, last = start == 0, end == card.n_layers
    layers = sum(layer_weights(card, backend)[start:end])
    return layers + memory_other(card, backend, first=first, last=last)


def rank_kv(card: ModelCard, backend: MlxBackend, start: int, end: int) -> int:
    """The cache reserve of layers [start, end) on `backend`."""
    return sum(layer_kv(card, backend)[start:end])


def rank_memory(card: ModelCard, backend: MlxBackend, start: int, end: int) -> int:
    """RAM a rank serving layers [start, end) needs on `backend`: weights and cache reserve."""
    return rank_weights(card, backend, start, end) + rank_kv(card, backend, start, end)


def tensor_rank_weights(card: ModelCard, backend: MlxBackend, share: Fraction) -> int:
    """Weights a tensor rank holding `share` of every layer (at most: its largest
    part, `TensorSplit.weight_share`) loads on `backend`, with the embedding and
    head whole."""
    return math.ceil(sum(layer_weights(card, backend)) * share) + memory_other(card, backend)


def tensor_rank_kv(card: ModelCard, backend: MlxBackend, kv_share: Fraction) -> int:
    """The cache reserve of a tensor rank holding `kv_share` of the KV heads."""
    return sum(
        _kv_part(kv, cache, kv_share)
        for kv, cache in zip(layer_kv(card, backend), card.layer_caches, strict=True)
    )


def layers_that_fit(
    card: ModelCard,
    backend: MlxBackend,
    free: int,
    *,
    first: bool,
    last: bool,
    start: int = 0,
    totals: Sequence[int] | None = None,
) -> int:
    """How many consecutive layers from `start` a rank with `free` bytes of RAM on
    `backend` holds next to its non-layer weights (the embedding when `first`,
    the head when `last`). `totals`: the running totals of
    `layer_costs(card, backend)` from 0, when the caller has them already."""
    room = free - memory_other(card, backend, first=first, last=last)
    if room < 0:
        return 0
    if totals is None:
        totals = list(itertools.accumulate(layer_costs(card, backend), initial=0))
    return bisect_right(totals, totals[start] + room) - 1 - start
