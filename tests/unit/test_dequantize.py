"""`dequantized_f32`: the CPU's float32 weights from a quantized one, as
`mx.dequantize` gives them (up to its rounding to the scales' float16)."""

from typing import cast

import mlx.core as mx
import mlx.nn as nn
import pytest

from exo.engine.mlx.load import dequantize_f32, dequantized_f32


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("scales_dtype", [mx.float16, mx.float32])
def test_dequantized_weights_match_mlx(bits: int, group_size: int, scales_dtype: mx.Dtype) -> None:
    mx.random.seed(bits * group_size)
    weight = mx.random.normal((48, 256)).astype(scales_dtype)
    packed, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    expected = mx.dequantize(packed, scales, biases, group_size, bits).astype(mx.float32)
    got = dequantized_f32(packed, scales, biases, group_size, bits)
    assert got.dtype == mx.float32
    assert got.shape == (48, 256)
    # Exact with float32 scales; within float16 rounding of MLX's float16 result.
    tolerance = 1e-5 if scales_dtype == mx.float32 else 2e-3
    assert mx.allclose(got, expected, rtol=tolerance, atol=tolerance).item()


def test_a_model_s_quantized_layers_become_float32_ones() -> None:
    model = nn.Sequential(
        nn.Embedding(64, 64), nn.Linear(64, 32, bias=True), nn.Linear(32, 64, bias=False)
    )
    nn.quantize(model, group_size=32, bits=4)
    bias = cast(mx.array, model.layers[1].bias)
    layers = list(model.layers)
    plain = dequantize_f32(model)
    assert [type(layer) for layer in plain.layers] == [nn.Embedding, nn.Linear, nn.Linear]
    for i, layer in enumerate(layers):
        weight = plain.layers[i].weight
        reference = mx.dequantize(
            layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
        ).astype(mx.float32)
        assert weight.dtype == mx.float32 and mx.allclose(weight, reference, atol=1e-2).item()
    assert mx.array_equal(plain.layers[1].bias, bias).item()
    assert "bias" not in plain.layers[2]
