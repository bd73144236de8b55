"""Attention of decode steps' few query tokens on the CPU backend, by a numba
kernel (`few_rows_kernel.few_rows_attention`) in place of MLX's.

MLX's CPU `scaled_dot_product_attention` spends far more than the arithmetic
needs on a few queries (it builds the scores and the softmax as separate
arrays, the keys of a grouped head repeated for each of its query heads):
SmolLM2-135M's attention over 600 cached tokens took 0.43 ms a layer for one
query and 1.4 ms for 9 (a verify step's), 13 and 42 ms of a decode step of
30 layers, on a 2-core x86 VM. The kernel reads the cache in place (a numpy
view of MLX's buffer) and keeps each query's scores to itself.

It applies where the layers' matmuls go through the few-rows kernel
(`cpu_few_rows`, up to `KERNEL_ROWS` query tokens in all, float32: the forward
pass already runs as it is built) and the attention is the plain one: no
quantized cache, no attention sinks, keys and values of one head size, and a
mask that is none, "causal" or a boolean array over the keys, 2-D or one per
row (a batch's left padding, a window's). Everything else keeps MLX's: prompts
of more than `KERNEL_ROWS` tokens, multi-head latent attention, additive masks.

mlx-lm's model files call `scaled_dot_product_attention` from their own
namespace (imported from `mlx_lm.models.base`), so a loaded model's files get
this module's in its place (`use_kernel_for_attention`): other models of the
same files in this process then use it too, under the same conditions.
"""

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base

from exo.engine.mlx import cpu_few_rows
from exo.engine.mlx.cpu_threads import blas_for_kernel

mlx_attention = base.scaled_dot_product_attention  # what the kernel stands in for


def few_rows_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, by the kernel where it applies."""
    allowed = _allowed(queries, keys, values, cache, mask, sinks)
    if allowed is None:
        return mlx_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    from exo.engine.mlx.few_rows_kernel import few_rows_attention as kernel

    blas_for_kernel.for_kernel()
    mx.eval(queries, keys, values)
    keys_in, values_in = (
        whole_buffer(keys, getattr(cache, "keys", None)),
        whole_buffer(values, getattr(cache, "values", None)),
    )
    if keys_in.shape != values_in.shape:  # one read in place, the other copied: both copied
        keys_in, values_in = (np.ascontiguousarray(np.asarray(a)) for a in (keys, values))
    out = kernel(np.ascontiguousarray(np.asarray(queries)), keys_in, values_in, allowed, scale)
    return mx.array(out)


def whole_buffer(view: mx.array, buffer: object) -> np.ndarray[Any, np.dtype[np.float32]]:
    """`view` (evaluated) for the kernel, C-contiguous: the cache's whole buffer
    where `view` is its first slots (a cache's keys or values: read in place, and
    numba vectorizes only contiguous arrays), else a copy."""
    array = np.asarray(view)
    if isinstance(buffer, mx.array) and buffer.ndim == 4 and buffer.dtype == view.dtype:
        whole = np.asarray(buffer)
        if (
            whole.flags.c_contiguous
            and whole.ctypes.data == array.ctypes.data
            and whole.strides == array.strides
            and whole.shape[:2] == array.shape[:2]
            and whole.shape[3] == array.shape[3]
        ):
            return whole
    return np.ascontiguousarray(array)


def _allowed(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    mask: mx.array | str | None,
    sinks: mx.array | None,
) -> np.ndarray[Any, np.dtype[np.bool_]] | None:
    """Which keys each query attends to, (batch or 1, queries, keys), where the
    kernel applies; None where MLX's attention is kept."""
    if sinks is not None or hasattr(cache, "bits") or queries.ndim != 4 or keys.ndim != 4:
        return None
    batch, heads, length, depth = queries.shape
    if batch * length > cpu_few_rows.KERNEL_ROWS or heads % keys.shape[1]:
        return None
    if keys.shape != values.shape or keys.shape[0] != batch or keys.shape[3] != depth:
        return None  # values of another head size (multi-head latent attention): MLX's
    if not all(a.dtype == mx.float32 for a in (queries, keys, values)):
        return None
    span = keys.shape[2]
    if mask is None:
        return np.ones((1, length, span), dtype=np.bool_)
    if isinstance(mask, str):
        if mask != "causal":
            return None
        # The queries are the last `length` positions: each sees the keys up to its own.
        return (np.arange(span)[None, :] <= np.arange(span - length, span)[:, None])[None]
    if mask.dtype != mx.bool_ or mask.ndim not in (2, 4):
        return None  # an additive mask: MLX's
    mx.eval(mask)
    allowed = np.asarray(mask)
    if allowed.ndim == 4:
        if allowed.shape[1] != 1:
            return None  # per-head masks: MLX's
        allowed = allowed[:, 0]
    else:
        allowed = allowed[None]
    if allowed.shape[0] not in (1, batch) or allowed.shape[1] not in (1, length):
        return None
    if allowed.shape[2] != span:
        return None  # not a mask over these keys: MLX's says what to make of it
    # A fresh array: writable, as the other masks are (numba compiles per flag).
    return np.array(np.broadcast_to(allowed, (allowed.shape[0], length, span)))


def use_kernel_for_attention(model: nn.Module) -> None:
    """Give the files of `model`'s modules that call mlx-lm's attention this
    module's in its place."""
    for module in model.modules():
        namespace = sys.modules.get(type(module).__module__)
        if (
            namespace is not None
            and getattr(namespace, "scaled_dot_product_attention", None) is mlx_attention
        ):
            namespace.scaled_dot_product_attention = few_rows_attention  # pyright: ignore[reportAttributeAccessIssue]
