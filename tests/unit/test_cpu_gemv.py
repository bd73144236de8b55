"""`cpu_gemv`: one-row products go through BLAS `sgemv` (numpy's `matrix @ vector`),
give what MLX's matmul gives up to float32 rounding, and anything else is left
to MLX's matmul as it was."""

from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.cpu_gemv import GemvEmbedding, GemvLinear, use_gemv_for_one_row
from exo.engine.mlx.load import load_for_inference


def _weights(out_features: int, in_features: int, seed: int) -> mx.array:
    return mx.random.normal((out_features, in_features), key=mx.random.key(seed))


@pytest.mark.parametrize("shape", [(96,), (1, 96), (1, 1, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_one_row_product_is_blas_gemv(shape: tuple[int, ...], bias: bool) -> None:
    linear = nn.Linear(96, 40, bias=bias)
    linear.weight = _weights(40, 96, seed=1)
    reference = linear(x := mx.random.normal(shape, key=mx.random.key(2)))
    gemv = GemvLinear(linear)
    got = gemv(x)
    assert got.shape == reference.shape == (*shape[:-1], 40)
    assert mx.allclose(got, reference, rtol=1e-5, atol=1e-5).item()
    # Bit for bit numpy's matrix-vector product: the gemv path was taken.
    expected = np.asarray(linear.weight) @ np.asarray(x).reshape(-1)
    if bias:
        expected = expected + np.asarray(linear.bias)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), expected)


@pytest.mark.parametrize("shape", [(2, 96), (1, 3, 96), (4, 1, 96)])
def test_more_rows_keep_mlx_matmul(shape: tuple[int, ...]) -> None:
    linear = nn.Linear(96, 40)
    linear.weight = _weights(40, 96, seed=3)
    x = mx.random.normal(shape, key=mx.random.key(4))
    assert mx.array_equal(GemvLinear(linear)(x), linear(x)).item()


def test_other_dtypes_keep_mlx_matmul() -> None:
    linear = nn.Linear(64, 32)
    linear.set_dtype(mx.float16)
    x = mx.random.normal((1, 64), key=mx.random.key(5)).astype(mx.float16)
    got = GemvLinear(linear)(x)
    assert got.dtype == mx.float16
    assert mx.array_equal(got, linear(x)).item()


def test_the_tied_head_is_gemv_and_the_lookup_unchanged() -> None:
    embedding = nn.Embedding(300, 48)
    embedding.weight = _weights(300, 48, seed=6)
    gemv = GemvEmbedding(embedding)
    x = mx.random.normal((1, 1, 48), key=mx.random.key(7))
    got = gemv.as_linear(x)
    assert got.shape == (1, 1, 300)
    assert mx.allclose(got, embedding.as_linear(x), rtol=1e-5, atol=1e-5).item()
    np.testing.assert_array_equal(
        np.asarray(got).reshape(-1), np.asarray(embedding.weight) @ np.asarray(x).reshape(-1)
    )
    ids = mx.array([[3, 299, 0]])
    assert mx.array_equal(gemv(ids), embedding(ids)).item()


def test_a_replaced_weight_is_used_from_then_on() -> None:
    linear = GemvLinear(nn.Linear(16, 8, bias=False))
    x = mx.ones((1, 16))
    before = linear(x)
    linear.weight = linear.weight * 2
    assert mx.allclose(linear(x), before * 2, rtol=1e-6).item()


def test_a_model_s_plain_layers_are_swapped_keeping_their_weights() -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 16, bias=True), nn.ReLU())
    weights = [model.layers[0].weight, model.layers[1].weight, model.layers[1].bias]
    use_gemv_for_one_row(model)
    assert [type(layer) for layer in model.layers] == [GemvEmbedding, GemvLinear, nn.ReLU]
    kept = [model.layers[0].weight, model.layers[1].weight, model.layers[1].bias]
    assert all(a is b for a, b in zip(kept, weights, strict=True))


@pytest.mark.skipif(backend_name() != "cpu", reason="the swap is the CPU backend's")
def test_a_loaded_model_decodes_one_row_as_mlx_matmul_does(tiny_model_dir: Path) -> None:
    """The CPU load swaps the layers in; a prompt then 12 one-row decode steps
    give the logits of the model as mlx-lm loads it, to float32 rounding."""
    swapped, _ = load_for_inference(tiny_model_dir)
    assert any(isinstance(m, GemvLinear) for m in swapped.modules())
    plain, _ = load_model(tiny_model_dir)
    plain.set_dtype(mx.float32)
    assert not any(isinstance(m, GemvLinear) for m in plain.modules())
    caches = make_prompt_cache(swapped), make_prompt_cache(plain)
    inputs = mx.array([[5, 17, 300, 42, 9, 1000]])
    for _ in range(12):
        logits = [
            cast(mx.array, model(inputs, cache=cache))[:, -1, :]
            for model, cache in zip((swapped, plain), caches, strict=True)
        ]
        assert mx.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4).item()
        inputs = mx.argmax(logits[1], axis=-1, keepdims=True)
