"""A batch cache realigned after a verify step by moving the fewest tokens.

After a verify step the rows keep different numbers of the tokens they fed:
row i's last r_i slots hold draft tokens it refused. mlx-lm's
`BatchKVCache.finalize` rolls each row right by r_i, which copies every key
and value the batch holds, every such step (at agent context lengths, more
than any draft saves). Attention does not care where in a row's span a key
sits: each key carries its position in its rotation, and the mask only says
which slots are the row's (those from its left padding on). So here the
row's first min(r_i, L_i) tokens (of its L_i kept) move into its refused
slots and its left padding grows by r_i: a copy of at most a draft's length.

The row's tokens are then out of their order in the cache. Each row keeps
where its tokens sit (`RowOrder`: offsets in its span, in the reply's order;
None while in order), and `extract` reads them back in order: the prefix
cache stores a reply's KV in its tokens' order. A cache read by position (the
M-RoPE deltas, read at a row's last slot) is marked `read_by_position` and
rolled as before: one number per token.
"""

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# Offsets of a row's tokens in its span of the batch cache (the slots from its
# left padding on), in the reply's order, for the first len(...) tokens; those
# after sit in order. None: every token sits in order.
RowOrder = np.ndarray | None

_READ_BY_POSITION = "exo_read_by_position"


def mark_read_by_position(cache: object) -> None:
    """`cache` is read at its rows' last slots: a realignment keeps its order."""
    setattr(cache, _READ_BY_POSITION, True)


def _in_order(cache: object) -> bool:
    return bool(getattr(cache, _READ_BY_POSITION, False))


def realign(
    layers: Sequence[BatchKVCache], refused: Sequence[int], orders: Sequence[RowOrder]
) -> list[RowOrder]:
    """Drop each row's last `refused[i]` slots (right after the step that wrote
    them) from its span, moving its first tokens into them; the rows' orders
    after it."""
    if not any(refused):
        return list(orders)
    if all(_in_order(layer) for layer in layers):
        _roll(layers, refused)
        return list(orders)
    layer = next(layer for layer in layers if not _in_order(layer))
    end = layer._idx  # pyright: ignore[reportPrivateUsage]
    starts = cast(list[int], layer.left_padding.tolist())
    moves: list[tuple[int, int, int]] = []  # (row, from, count): to the row's last slots
    new_orders: list[RowOrder] = []
    for row, (r, start, order) in enumerate(zip(refused, starts, orders, strict=True)):
        kept = end - start - r
        if r == 0:
            new_orders.append(order)
            continue
        moved = min(r, kept)
        moves.append((row, start, moved))
        offsets = _offsets(order, kept)
        new_orders.append(np.where(offsets >= moved, offsets - r, offsets + (kept - moved)))
    reordered = [cache for cache in layers if not _in_order(cache)]
    # What moves, copied out first: then nothing but the cache holds its arrays,
    # and MLX writes each row's slots in place (else it copies the arrays whole).
    sources = [
        [
            mx.contiguous(getattr(cache, name)[row : row + 1, :, start : start + moved, :])
            for row, start, moved in moves
        ]
        for cache in reordered
        for name in ("keys", "values")
    ]
    mx.eval(sources)
    for cache in layers:
        if _in_order(cache):
            _roll([cache], refused)
    for index, cache in enumerate(reordered):
        for which, name in enumerate(("keys", "values")):
            held: mx.array = getattr(cache, name)
            for (row, _, moved), source in zip(moves, sources[2 * index + which], strict=True):
                held[row : row + 1, :, end - moved : end, :] = source
        shift = mx.array(list(refused))
        cache.left_padding = cache.left_padding + shift
        cache.offset = cache.offset - shift
    return new_orders


def _roll(layers: Sequence[BatchKVCache], refused: Sequence[int]) -> None:
    for cache in layers:
        cache.prepare(right_padding=list(refused))
        cache.finalize()


def _offsets(order: RowOrder, tokens: int) -> np.ndarray:
    """The offsets of a row's first `tokens` tokens."""
    if order is None:
        return np.arange(tokens)
    return np.concatenate([order[:tokens], np.arange(len(order), tokens)])


def extract(layer: BatchKVCache, row: int, order: RowOrder) -> KVCache:
    """Row `row` of `layer` as a one-row cache, its tokens in order."""
    if order is None or _in_order(layer):
        return layer.extract(row)
    start = cast(list[int], layer.left_padding.tolist())[row]
    end = layer._idx  # pyright: ignore[reportPrivateUsage]
    positions = mx.array(_offsets(order, end - start) + start)
    assert layer.keys is not None and layer.values is not None  # it holds the row's tokens
    cache = KVCache()
    cache.keys = mx.contiguous(mx.take(layer.keys[row : row + 1], positions, axis=2))
    cache.values = mx.contiguous(mx.take(layer.values[row : row + 1], positions, axis=2))
    cache.offset = end - start
    return cache
