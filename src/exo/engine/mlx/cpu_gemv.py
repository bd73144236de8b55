"""One-row matmuls on the CPU backend as BLAS matrix-vector products.

A decode step of a lone request multiplies one row by every weight matrix of
the model. MLX's CPU backend runs every matmul as a BLAS `sgemm`, which packs
the weight matrix before multiplying: for a single row that costs about twice
the memory traffic of `sgemv`, which streams the matrix once (OpenBLAS on a
2-core x86 machine: 8.8 ms vs 4.5 ms for a 49152x576 float32 head, 40 vs 26 ms
over all of a 135M-parameter model's matrices). Decode of one row is bound by
memory bandwidth, so that is most of a step.

The layers here hand a one-row float32 input to numpy's `matrix @ vector` (its
BLAS's `sgemv`) on a zero-copy view of the weight; more rows (prompt reading,
a batch of requests) keep MLX's matmul. The input is evaluated first, one wait
per distinct input (q, k and v share theirs, as gate and up do), ~50 µs each;
the waits cost less than the packing saved (a one-row step of the built-in
model: 55-59 ms instead of 59-63 ms).

Consequences for callers:
- A one-row forward pass runs as it is built, so a decode loop cannot overlap
  it with handing out the previous token; such loops hand the token out first
  (`eager_one_row`), and a reply's last token is then never fed in: the stored
  reply stops before it.
- `sgemv` sums in another order than `sgemm`: a row's logits alone and in a
  batch agree to float32 rounding (~1e-4), not bit for bit, so a greedy
  near-tie may resolve differently alone and batched.
- The layers are for inference: `mx.grad` sees no gradient through the numpy
  product, and `mx.compile` or `mx.vmap` of a one-row call raises.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten


class _WeightView:
    """A numpy view of one MLX weight, made once and kept while the weight is the same."""

    def __init__(self) -> None:
        self._weight: mx.array | None = None
        self._view: np.ndarray[Any, np.dtype[np.float32]] | None = None

    def of(self, weight: mx.array) -> np.ndarray[Any, np.dtype[np.float32]]:
        if self._view is None or self._weight is not weight:
            mx.eval(weight)
            view = np.asarray(weight)
            view.flags.writeable = False  # MLX's memory: never written from here
            self._weight, self._view = weight, view
        return self._view


def _one_row(x: mx.array, weight: mx.array) -> bool:
    return x.size == x.shape[-1] and x.dtype == mx.float32 and weight.dtype == mx.float32


def _gemv(weight: np.ndarray[Any, np.dtype[np.float32]], x: mx.array) -> mx.array:
    """`x @ weight.T` for a one-row `x`, by the BLAS matrix-vector product."""
    mx.eval(x)
    product = weight @ np.asarray(x).reshape(-1)
    return mx.array(product).reshape(*x.shape[:-1], weight.shape[0])


class GemvLinear(nn.Linear):
    """`nn.Linear` whose one-row float32 products go through BLAS `sgemv`."""

    def __init__(self, linear: nn.Linear) -> None:
        out_features, in_features = linear.weight.shape
        super().__init__(in_features, out_features, bias="bias" in linear)
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        self._view = _WeightView()

    def __call__(self, x: mx.array) -> mx.array:
        if not _one_row(x, self.weight):
            return super().__call__(x)
        product = _gemv(self._view.of(self.weight), x)
        return product + self.bias if "bias" in self else product


class GemvEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output head (tied weights) goes through
    BLAS `sgemv` for one row."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(*embedding.weight.shape)
        self.weight = embedding.weight
        self._view = _WeightView()

    def as_linear(self, x: mx.array) -> mx.array:
        if not _one_row(x, self.weight):
            return super().as_linear(x)
        return _gemv(self._view.of(self.weight), x)


def use_gemv_for_one_row(model: nn.Module) -> nn.Module:
    """Swap `model`'s plain linear and embedding layers for the ones above (same weights)."""
    replaced: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            replaced.append((name, GemvLinear(module)))
        elif type(module) is nn.Embedding:
            replaced.append((name, GemvEmbedding(module)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def eager_one_row(model: nn.Module) -> bool:
    """Whether `model`'s one-row forward pass runs as it is built (its layers are
    the ones above)."""
    return any(isinstance(m, GemvLinear | GemvEmbedding) for m in model.modules())
