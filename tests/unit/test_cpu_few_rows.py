"""`cpu_few_rows`: products of up to `KERNEL_ROWS` rows go through the numba kernel,
give what MLX's matmul gives up to float32 rounding, and anything else is left to
MLX's matmul as it was."""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.cpu_few_rows import (
    KERNEL_ROWS,
    FewRowsEmbedding,
    FewRowsLinear,
    eager_rows,
    load_kernel,
    use_kernel_for_few_rows,
)
from exo.engine.mlx.load import load_for_inference
from tests.platforms import HAS_NUMBA, needs_numba

if TYPE_CHECKING or HAS_NUMBA:  # numba: Linux only; the tests that use the kernel skip without it
    from exo.engine.mlx.few_rows_kernel import few_rows_product


def _weights(out_features: int, in_features: int, seed: int) -> mx.array:
    return mx.random.normal((out_features, in_features), key=mx.random.key(seed))


@needs_numba
@pytest.mark.parametrize("count", [KERNEL_ROWS, KERNEL_ROWS - 1, 2])
def test_the_kernel_is_the_matrix_product_and_a_row_s_result_does_not_depend_on_the_others(
    count: int,
) -> None:
    rng = np.random.default_rng(0)
    # 1003 features: blocks of 8 and 3 summed one at a time.
    weight = rng.standard_normal((1003, 576), dtype=np.float32)
    rows = rng.standard_normal((count, 576), dtype=np.float32)
    got = few_rows_product(weight, rows)
    assert got.shape == (count, 1003) and got.dtype == np.float32
    np.testing.assert_allclose(got, rows @ weight.T, rtol=1e-4, atol=1e-4)
    # Alone or beside others (an odd count's last row paired with itself), a row
    # gets the same bits: a batch of up to KERNEL_ROWS decodes each row as it
    # decodes alone.
    for j in range(count):
        np.testing.assert_array_equal(few_rows_product(weight, rows[j : j + 1])[0], got[j])


@needs_numba
@pytest.mark.parametrize("shape", [(96,), (1, 96), (1, 1, 96), (2, 96), (1, 3, 96), (4, 1, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_go_through_the_kernel(shape: tuple[int, ...], bias: bool) -> None:
    linear = nn.Linear(96, 40, bias=bias)
    linear.weight = _weights(40, 96, seed=1)
    reference = linear(x := mx.random.normal(shape, key=mx.random.key(2)))
    got = FewRowsLinear(linear, few_rows_product)(x)
    assert got.shape == reference.shape == (*shape[:-1], 40)
    assert mx.allclose(got, reference, rtol=1e-5, atol=1e-5).item()
    # Bit for bit the kernel's product: that path was taken.
    expected = few_rows_product(np.asarray(linear.weight), np.asarray(x).reshape(-1, 96))
    if bias:
        expected = expected + np.asarray(linear.bias)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, 40), expected)


@needs_numba
@pytest.mark.parametrize(
    "shape", [(KERNEL_ROWS + 1, 96), (2, KERNEL_ROWS, 96), (1, 2 * KERNEL_ROWS + 1, 96)]
)
def test_more_rows_keep_mlx_matmul(shape: tuple[int, ...]) -> None:
    linear = nn.Linear(96, 40)
    linear.weight = _weights(40, 96, seed=3)
    x = mx.random.normal(shape, key=mx.random.key(4))
    assert mx.array_equal(FewRowsLinear(linear, few_rows_product)(x), linear(x)).item()


@needs_numba
def test_other_dtypes_keep_mlx_matmul() -> None:
    linear = nn.Linear(64, 32)
    linear.set_dtype(mx.float16)
    x = mx.random.normal((1, 64), key=mx.random.key(5)).astype(mx.float16)
    got = FewRowsLinear(linear, few_rows_product)(x)
    assert got.dtype == mx.float16
    assert mx.array_equal(got, linear(x)).item()


@needs_numba
def test_the_tied_head_goes_through_the_kernel_and_the_lookup_is_unchanged() -> None:
    embedding = nn.Embedding(300, 48)
    embedding.weight = _weights(300, 48, seed=6)
    swapped = FewRowsEmbedding(embedding, few_rows_product)
    x = mx.random.normal((2, 1, 48), key=mx.random.key(7))
    got = swapped.as_linear(x)
    assert got.shape == (2, 1, 300)
    assert mx.allclose(got, embedding.as_linear(x), rtol=1e-5, atol=1e-5).item()
    np.testing.assert_array_equal(
        np.asarray(got).reshape(2, 300),
        few_rows_product(np.asarray(embedding.weight), np.asarray(x).reshape(2, 48)),
    )
    ids = mx.array([[3, 299, 0]])
    assert mx.array_equal(swapped(ids), embedding(ids)).item()


@needs_numba
def test_a_replaced_weight_is_used_from_then_on() -> None:
    linear = FewRowsLinear(nn.Linear(16, 8, bias=False), few_rows_product)
    x = mx.ones((1, 16))
    before = linear(x)
    linear.weight = linear.weight * 2
    assert mx.allclose(linear(x), before * 2, rtol=1e-6).item()


@needs_numba
def test_a_model_s_plain_layers_are_swapped_keeping_their_weights() -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 16, bias=True), nn.ReLU())
    weights = [model.layers[0].weight, model.layers[1].weight, model.layers[1].bias]
    assert eager_rows(model) == 0
    use_kernel_for_few_rows(model)
    assert [type(layer) for layer in model.layers] == [FewRowsEmbedding, FewRowsLinear, nn.ReLU]
    kept = [model.layers[0].weight, model.layers[1].weight, model.layers[1].bias]
    assert all(a is b for a, b in zip(kept, weights, strict=True))
    assert eager_rows(model) == KERNEL_ROWS


def test_without_numba_nothing_is_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "exo.engine.mlx.few_rows_kernel", None)  # import fails
    assert load_kernel() is None
    model = nn.Sequential(nn.Linear(8, 4))
    use_kernel_for_few_rows(model)
    assert type(model.layers[0]) is nn.Linear and eager_rows(model) == 0


@needs_numba
@pytest.mark.skipif(backend_name() != "cpu", reason="the swap is the CPU backend's")
@pytest.mark.parametrize("rows", [1, KERNEL_ROWS])
def test_a_loaded_model_decodes_as_mlx_matmul_does(tiny_model_dir: Path, rows: int) -> None:
    """The CPU load swaps the layers in; a prompt then 12 decode steps of 1 or
    `KERNEL_ROWS` rows give the logits of the model as mlx-lm loads it, to float32
    rounding."""
    swapped, _ = load_for_inference(tiny_model_dir)
    assert any(isinstance(m, FewRowsLinear) for m in swapped.modules())
    plain, _ = load_model(tiny_model_dir)
    plain.set_dtype(mx.float32)
    assert not any(isinstance(m, FewRowsLinear) for m in plain.modules())
    caches = make_prompt_cache(swapped), make_prompt_cache(plain)
    inputs = mx.array([[5, 17, 300, 42, 9, 1000 + row] for row in range(rows)])
    for _ in range(12):
        logits = [
            cast(mx.array, model(inputs, cache=cache))[:, -1, :]
            for model, cache in zip((swapped, plain), caches, strict=True)
        ]
        assert mx.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4).item()
        inputs = mx.argmax(logits[1], axis=-1, keepdims=True)


@needs_numba
def test_the_kernel_refuses_rows_that_do_not_match_the_weight() -> None:
    """It checks no bounds itself: a mismatch would read past the rows."""
    with pytest.raises(ValueError, match="do not match"):
        few_rows_product(np.ones((8, 16), np.float32), np.ones((2, 12), np.float32))
