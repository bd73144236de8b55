"""Decode-step matmuls on the CPU backend: a few rows times each weight matrix,
by a kernel that reads the weights once (`few_rows_kernel`).

A decode step multiplies one row per request in the batch (and per drafted
token, in a verify step) by every weight matrix of the model, so it is bound by
memory bandwidth. MLX's CPU backend runs every matmul as a BLAS `sgemm`, which
packs (copies) the weight matrix before multiplying: for a few rows that is most
of the work. Over all the matrices of a 135M-parameter float32 model, on a
2-core x86 VM: `sgemm` 54-96 ms for 1 to 8 rows, 95-130 ms for 10-12 and
58-68 ms for 16 (its blocking suits 16); the kernel 11 / 19 / 27 / 34-53 /
55-76 ms for 1 / 4 / 8 / 12 / 16 rows (`few_rows_kernel` has the finer figures).

The layers here hand a float32 input of up to `KERNEL_ROWS` rows to the kernel
on a zero-copy numpy view of the weight; more rows (prompt reading, bigger
batches) keep MLX's matmul, where `sgemm` is the faster one. The input is
evaluated first, one wait per distinct input (q, k and v share theirs, as gate
and up do), ~50 µs each. While forward passes go through the kernel, OpenBLAS
runs on one thread (`cpu_threads.blas_for_kernel`: its threads and the kernel's
would take turns on the cores).

Consequences for callers:
- A forward pass of up to `KERNEL_ROWS` rows runs as it is built (`eager_rows`);
  `LocalModel.eager_rows` (`generate.py`) says what decode loops make of that.
- The kernel sums in another order than `sgemm`: a row's logits alone (or in a
  batch of up to `KERNEL_ROWS`) and in a bigger batch agree to float32 rounding
  (~1e-4), not bit for bit, so a greedy near-tie may resolve differently.
- The layers are for inference: `mx.grad` sees no gradient through the numpy
  product, and `mx.compile` or `mx.vmap` of a few-row call raises.
- Where the kernel cannot be had (no numba, which is a Linux dependency; numba's
  cache folders not writable; a failed compile), nothing is swapped.
- The kernel's threads (OpenMP, libgomp) take their settings once, when the
  kernel first runs, which loading a model does: `configure_kernel_threads`
  comes before that.
"""

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from loguru import logger
from mlx.utils import tree_unflatten

from exo.engine.mlx.cpu_threads import blas_for_kernel

# Up to this many rows the kernel beats `sgemm` or matches it (measured above);
# beyond, MLX's matmul. 16: a verify step of 4 requests with drafts of 3.
KERNEL_ROWS = 16
# How long the kernel's OpenMP threads spin after each parallel region, in a
# pipeline rank: libgomp's default (300,000 rounds) bridges the gaps between a
# step's matmuls (a lone runner's 2-4-row steps were ~25 % slower at 10,000), but
# it also spins through a rank's wait for its neighbour, so ranks sharing cores
# slowed each other (2 ranks 0.72x of 1 rank; 1.01x at 10,000).
PIPELINE_GOMP_SPINCOUNT = "10000"

Float32Matrix = np.ndarray[Any, np.dtype[np.float32]]
Product = Callable[[Float32Matrix, Float32Matrix], Float32Matrix]


class _Kernel:
    """One layer's way to the kernel: its weight's numpy view (made once, kept
    while the weight is the same) and the product."""

    def __init__(self, product: Product) -> None:
        self._product = product
        self._weight: mx.array | None = None
        self._view: Float32Matrix | None = None

    def view(self, weight: mx.array) -> Float32Matrix:
        if self._view is None or self._weight is not weight:
            mx.eval(weight)
            view = np.asarray(weight)
            view.flags.writeable = False  # MLX's memory: never written from here
            self._weight, self._view = weight, view
        return self._view

    def __call__(self, weight: mx.array, x: mx.array) -> mx.array | None:
        """`x @ weight.T` by the kernel; None (MLX's matmul then) for more than
        `KERNEL_ROWS` rows or other dtypes."""
        few = x.size <= KERNEL_ROWS * x.shape[-1]
        if not (few and x.dtype == mx.float32 and weight.dtype == mx.float32):
            blas_for_kernel.for_matmul()
            return None
        blas_for_kernel.for_kernel()
        view = self.view(weight)
        mx.eval(x)
        rows = np.ascontiguousarray(np.asarray(x).reshape(-1, x.shape[-1]))
        return mx.array(self._product(view, rows)).reshape(*x.shape[:-1], view.shape[0])


class FewRowsLinear(nn.Linear):
    """`nn.Linear` whose products of up to `KERNEL_ROWS` float32 rows go through the kernel."""

    def __init__(self, linear: nn.Linear, product: Product) -> None:
        out_features, in_features = linear.weight.shape
        super().__init__(in_features, out_features, bias="bias" in linear)
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        self._kernel = _Kernel(product)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._kernel(self.weight, x)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


class FewRowsEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output head (tied weights) goes through the
    kernel for up to `KERNEL_ROWS` rows."""

    def __init__(self, embedding: nn.Embedding, product: Product) -> None:
        super().__init__(*embedding.weight.shape)
        self.weight = embedding.weight
        self._kernel = _Kernel(product)

    def as_linear(self, x: mx.array) -> mx.array:
        y = self._kernel(self.weight, x)
        return super().as_linear(x) if y is None else y


def configure_kernel_threads(pipeline_rank: bool) -> None:
    """Set how this process's kernel threads wait between parallel regions. Call
    it before loading a model: libgomp reads its settings once, when numba loads it
    for the kernel's first run (`load_kernel`, which loading a model calls).
    A pipeline rank's threads spin less (`PIPELINE_GOMP_SPINCOUNT`); a whole-model
    runner keeps libgomp's default. A value already in the environment wins."""
    if pipeline_rank:
        os.environ.setdefault("GOMP_SPINCOUNT", PIPELINE_GOMP_SPINCOUNT)


def load_kernel() -> Product | None:
    """The kernel, compiled (or read from numba's cache); None where it cannot be
    had (no numba, numba's cache folders not writable, a failed compile)."""
    try:
        from exo.engine.mlx.few_rows_kernel import few_rows_product

        # Compiled now, for the argument types the layers pass (a read-only weight view).
        _Kernel(few_rows_product)(mx.ones((3, 8)), mx.ones((2, 8)))
    except Exception as error:  # no numba, no writable cache folder, no compiler target
        logger.warning(f"CPU decode kernel unavailable ({error!r}): MLX's matmul is used")
        return None
    return few_rows_product


def use_kernel_for_few_rows(model: nn.Module) -> nn.Module:
    """Swap `model`'s plain linear and embedding layers for the ones above (same
    weights); unchanged where the kernel cannot be had."""
    product = load_kernel()
    if product is None:
        return model
    replaced: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            replaced.append((name, FewRowsLinear(module, product)))
        elif type(module) is nn.Embedding:
            replaced.append((name, FewRowsEmbedding(module, product)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def eager_rows(model: nn.Module) -> int:
    """Up to how many rows `model`'s forward pass runs as it is built (0: none,
    MLX's lazy graph throughout): its `LocalModel.eager_rows`."""
    swapped = any(isinstance(m, FewRowsLinear | FewRowsEmbedding) for m in model.modules())
    return KERNEL_ROWS if swapped else 0
