"""A batch cache realigned after verify steps by moving the fewest tokens
(`batch_order.realign`) attends as mlx-lm's roll does (`BatchKVCache.finalize`)
and gives each row's tokens back in their order; a cache read by position is
rolled. Checked over many steps of random rows, drafts and refusals."""

import random
from typing import cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from exo.engine.mlx.batch_order import RowOrder, extract, mark_read_by_position, realign

HEADS, DIM = 2, 4


def one_row(tokens: list[float]) -> KVCache:
    """A row's cache whose every key and value holds its token's number."""
    cache = KVCache()
    if tokens:
        held = mx.array(tokens)[None, None, :, None] * mx.ones((1, HEADS, 1, DIM))
        cache.update_and_fetch(held, held)
    return cache


def feed(cache: BatchKVCache, tokens: list[list[float]]) -> None:
    held = mx.array(tokens)[:, None, :, None] * mx.ones((1, HEADS, 1, DIM))
    cache.update_and_fetch(held, held)


def attend(cache: BatchKVCache, queries: mx.array) -> mx.array:
    """A step's attention of `queries` (rows, heads, 1, dim) over the cache."""
    keys, values = cache.keys_and_values()  # pyright: ignore[reportAttributeAccessIssue]
    # A step's mask also covers its own token's key, which is left out here.
    mask = cache.make_mask(1, return_array=True)[..., :-1]  # pyright: ignore[reportAttributeAccessIssue]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=DIM**-0.5, mask=mask)


def row_tokens(cache: BatchKVCache, row: int, order: RowOrder) -> list[float]:
    keys = extract(cache, row, order).keys
    assert keys is not None
    return cast(list[float], keys[0, 0, :, 0].tolist())


@pytest.mark.parametrize("seed", range(6))
def test_realigned_rows_attend_as_rolled_ones_and_keep_their_tokens_in_order(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[float(rng.randint(1, 99)) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    moved = BatchKVCache.merge([one_row(p) for p in prompts])  # pyright: ignore[reportAttributeAccessIssue]
    rolled = BatchKVCache.merge([one_row(p) for p in prompts])  # pyright: ignore[reportAttributeAccessIssue]
    replies = [list(p) for p in prompts]
    orders: list[RowOrder] = [None] * 4
    for _ in range(25):
        width = rng.randint(1, 6)
        fed = [[float(rng.randint(100, 999)) for _ in range(width)] for _ in replies]
        feed(moved, fed)
        feed(rolled, fed)
        kept = [rng.randint(1, width) for _ in replies]  # each row keeps a prefix of its feed
        refused = [width - k for k in kept]
        fewest = min(refused)
        for cache in (moved, rolled):
            cache.trim(fewest)
        extra = [r - fewest for r in refused]
        orders = realign([moved], extra, orders)
        if any(extra):
            rolled.prepare(right_padding=extra)
            rolled.finalize()
        for reply, tokens, k in zip(replies, fed, kept, strict=True):
            reply.extend(tokens[:k])
        assert moved.offset.tolist() == rolled.offset.tolist()
        queries = mx.random.normal((4, HEADS, 1, DIM), key=mx.random.key(rng.randint(0, 10**6)))
        assert mx.allclose(attend(moved, queries), attend(rolled, queries), atol=1e-4)
        for row, reply in enumerate(replies):
            assert row_tokens(moved, row, orders[row]) == reply
            assert row_tokens(rolled, row, None) == reply
    # Only the refused slots were rewritten: some row is out of order by now.
    assert any(order is not None for order in orders)


def test_a_cache_read_by_position_is_rolled_and_stays_in_order() -> None:
    deltas = BatchKVCache.merge([one_row([1.0, 2.0]), one_row([5.0])])  # pyright: ignore[reportAttributeAccessIssue]
    keys = BatchKVCache.merge([one_row([1.0, 2.0]), one_row([5.0])])  # pyright: ignore[reportAttributeAccessIssue]
    mark_read_by_position(deltas)
    for cache in (deltas, keys):
        feed(cache, [[3.0, 4.0, 9.0], [6.0, 9.0, 9.0]])
        cache.trim(1)  # both refused the last token; row 1 one more
    orders = realign([deltas, keys], [0, 1], [None, None])
    # The last slot of each row holds its last token (what `_last_delta` reads).
    held = deltas.keys_and_values()[0][:, 0, -1, 0].tolist()  # pyright: ignore[reportAttributeAccessIssue]
    assert held == [4.0, 6.0]
    assert row_tokens(deltas, 1, orders[1]) == [5.0, 6.0]
    assert row_tokens(keys, 1, orders[1]) == [5.0, 6.0]
    assert orders[0] is None and orders[1] is not None
