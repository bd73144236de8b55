"""The numba kernel behind `cpu_few_rows`: `out = rows @ weight.T` for a few rows,
reading the weight matrix from memory once.

Each output feature (split over the cores) takes its weight row into L1 and
computes its dot product with every input row there. The sums may be reordered
into SIMD lanes (`reassoc`, `contract`, `nsz`); NaN and infinity keep IEEE
semantics. Compiled on first use and cached on disk (numba's cache: beside this
file, or the user's cache folder where that is read-only).
"""

from typing import Any

import numpy as np
from numba import njit, prange  # pyright: ignore[reportMissingTypeStubs, reportUnknownVariableType]

Float32Matrix = np.ndarray[Any, np.dtype[np.float32]]


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _product(weight: Float32Matrix, rows: Float32Matrix, out: Float32Matrix) -> None:
    features, depth = weight.shape
    for i in prange(features):  # pyright: ignore[reportUnknownVariableType]
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
    _product(weight, rows, out)
    return out
