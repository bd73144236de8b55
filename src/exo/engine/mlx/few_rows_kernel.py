"""The numba kernels behind `cpu_few_rows` and `cpu_attention`: `out = rows @
weight.T` for a few rows, reading the weight matrix from memory once, and the
attention of a few query tokens over a KV cache read in place.

The output features are taken in blocks of weight rows (split over the cores);
a block stays in L1 while every input row's dot products with it are summed.
Blocks of 4 weight rows take the input rows two at a time (8 sums in
registers: each weight and input value loaded serves 2 or 4 multiply-adds,
where one dot product at a time loads both for one); a lone row takes
blocks of 8 weight rows (8 sums again). Over all the matrices of a
135M-parameter float32 model, on a 2-core x86 VM: 11 / 16 / 19 / 27 / 34 /
55 ms for 1 / 2 / 4 / 8 / 12 / 16 rows, where one dot product at a time took
12 / 16 / 23 / 46 / 58 / 86 ms and MLX's `sgemm` 54-130 ms (its best at 16 rows).

A row's result does not depend on the other rows: every sum is one chain of
multiply-adds over the depth, vectorized the same way whichever block or
pair it is in (an odd last row is paired with itself; the features past the
last block of 8 are summed one at a time in both cases). So a row alone and in
a batch get the same bits (`test_cpu_few_rows` checks it: the lone row's loop
is compiled apart from the pairs', and only the vectorizer keeps them alike). The sums may be reordered into SIMD lanes
(`reassoc`, `contract`, `nsz`); NaN and infinity keep IEEE semantics.

Attention: each (row, head) task reads its kv head's keys once for all its
query tokens (their scores kept per query), then the values once. The
arrays must be C-contiguous (numba vectorizes the depth loops only then), so
the keys and values come as the cache's whole buffer and the span in use.

Compiled on first use and cached on disk (numba's cache: beside this file, or
the user's cache folder where that is read-only).
"""

from typing import Any

import numpy as np
from numba import njit, prange  # pyright: ignore[reportMissingTypeStubs, reportUnknownVariableType]

Float32Matrix = np.ndarray[Any, np.dtype[np.float32]]
Float32Array = np.ndarray[Any, np.dtype[np.float32]]
BoolArray = np.ndarray[Any, np.dtype[np.bool_]]

_FASTMATH = {"reassoc", "contract", "nsz"}
# Features in whole blocks of 8 (the lone row's blocks; two blocks of 4 for more
# rows); the rest are summed one at a time, for one row as for many.
_BLOCK = 8


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _rows_in_pairs(weight: Float32Matrix, rows: Float32Matrix, out: Float32Matrix) -> None:
    """Blocks of 4 weight rows times pairs of input rows (an odd last row twice)."""
    features, depth = weight.shape
    n = rows.shape[0]
    for block in prange(features // _BLOCK * 2):  # pyright: ignore[reportUnknownVariableType]
        i = 4 * block
        for first in range(0, n, 2):
            second = min(first + 1, n - 1)
            a0 = a1 = a2 = a3 = np.float32(0.0)
            b0 = b1 = b2 = b3 = np.float32(0.0)
            for t in range(depth):
                x, y = rows[first, t], rows[second, t]
                w0, w1, w2, w3 = weight[i, t], weight[i + 1, t], weight[i + 2, t], weight[i + 3, t]
                a0 += w0 * x
                a1 += w1 * x
                a2 += w2 * x
                a3 += w3 * x
                b0 += w0 * y
                b1 += w1 * y
                b2 += w2 * y
                b3 += w3 * y
            out[first, i], out[first, i + 1], out[first, i + 2], out[first, i + 3] = a0, a1, a2, a3
            out[second, i], out[second, i + 1], out[second, i + 2], out[second, i + 3] = (
                b0,
                b1,
                b2,
                b3,
            )
    _remaining_features(weight, rows, out)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _one_row(weight: Float32Matrix, rows: Float32Matrix, out: Float32Matrix) -> None:
    """Blocks of 8 weight rows times the one input row."""
    features, depth = weight.shape
    for block in prange(features // _BLOCK):  # pyright: ignore[reportUnknownVariableType]
        i = _BLOCK * block
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for t in range(depth):
            x = rows[0, t]
            a0 += weight[i, t] * x
            a1 += weight[i + 1, t] * x
            a2 += weight[i + 2, t] * x
            a3 += weight[i + 3, t] * x
            a4 += weight[i + 4, t] * x
            a5 += weight[i + 5, t] * x
            a6 += weight[i + 6, t] * x
            a7 += weight[i + 7, t] * x
        out[0, i], out[0, i + 1], out[0, i + 2], out[0, i + 3] = a0, a1, a2, a3
        out[0, i + 4], out[0, i + 5], out[0, i + 6], out[0, i + 7] = a4, a5, a6, a7
    _remaining_features(weight, rows, out)


@njit(fastmath=_FASTMATH, cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _remaining_features(weight: Float32Matrix, rows: Float32Matrix, out: Float32Matrix) -> None:
    features, depth = weight.shape
    for i in range(features // _BLOCK * _BLOCK, features):
        for j in range(rows.shape[0]):
            total = np.float32(0.0)
            for t in range(depth):
                total += weight[i, t] * rows[j, t]
            out[j, i] = total


def few_rows_product(weight: Float32Matrix, rows: Float32Matrix) -> Float32Matrix:
    """`rows @ weight.T`: `weight` (out, in) and `rows` (n, in), C-contiguous float32."""
    if rows.ndim != 2 or rows.shape[1] != weight.shape[1]:  # the kernel checks no bounds
        raise ValueError(f"rows of shape {rows.shape} do not match a {weight.shape} weight")
    out = np.empty((rows.shape[0], weight.shape[0]), dtype=np.float32)
    if rows.shape[0] == 1:
        _one_row(weight, rows, out)
    else:
        _rows_in_pairs(weight, rows, out)
    return out


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _attend(
    queries: Any, keys: Any, values: Any, allowed: Any, scale: np.float32, out: Any
) -> None:
    batch, heads, length, depth = queries.shape
    group = heads // keys.shape[1]
    span = allowed.shape[2]
    for task in prange(batch * heads):  # pyright: ignore[reportUnknownVariableType]
        b = task // heads
        h = task % heads
        kv = h // group
        mask = allowed[b if allowed.shape[0] > 1 else 0]
        # Each key read once for all of the head's queries.
        scores = np.empty((length, span), dtype=np.float32)
        for s in range(span):
            for q in range(length):
                total = np.float32(0.0)
                for d in range(depth):
                    total += queries[b, h, q, d] * keys[b, kv, s, d]
                scores[q, s] = total * scale if mask[q, s] else -np.inf
        for q in range(length):
            top = -np.inf
            for s in range(span):
                top = max(top, scores[q, s])
            weights = np.float32(0.0)
            for s in range(span):
                weight = np.float32(np.exp(scores[q, s] - top)) if mask[q, s] else np.float32(0.0)
                scores[q, s] = weight
                weights += weight
            share = np.float32(1.0) / weights if weights > 0 else np.float32(0.0)
            for s in range(span):
                scores[q, s] *= share
        mixed = np.empty((length, depth), dtype=np.float32)
        for q in range(length):
            for d in range(depth):
                mixed[q, d] = 0.0
        for s in range(span):
            for q in range(length):
                weight = scores[q, s]
                for d in range(depth):
                    mixed[q, d] += weight * values[b, kv, s, d]
        for q in range(length):
            for d in range(depth):
                out[b, h, q, d] = mixed[q, d]


def few_rows_attention(
    queries: Float32Array,
    keys: Float32Array,
    values: Float32Array,
    allowed: BoolArray,
    scale: float,
) -> Float32Array:
    """Softmax attention of `queries` (batch, heads, length, depth) over the first
    `span` slots of `keys` and `values` (batch, kv heads, at least span, depth),
    each query over the keys `allowed` (batch or 1, length, span) marks; the
    heads share kv heads in groups (grouped-query attention). All C-contiguous;
    a query with no key allowed gets zeros."""
    batch, heads, length, depth = queries.shape
    if (
        keys.shape != values.shape
        or keys.shape[0] != batch
        or keys.shape[3] != depth
        or heads % keys.shape[1]
        or allowed.shape[0] not in (1, batch)
        or allowed.shape[1] != length
        or allowed.shape[2] > keys.shape[2]
    ):  # the kernel checks no bounds
        raise ValueError(
            f"queries {queries.shape}, keys {keys.shape}, values {values.shape} and "
            f"mask {allowed.shape} do not fit together"
        )
    out = np.empty(queries.shape, dtype=np.float32)
    _attend(queries, keys, values, allowed, np.float32(scale), out)
    return out
