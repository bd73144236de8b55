"""`cpu_attention`: a few query tokens' attention by the numba kernel gives what
MLX's gives, reading a cache's buffer in place; everything else is left to MLX's."""

import sys
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.cpu_attention import few_rows_attention, mlx_attention, whole_buffer
from exo.engine.mlx.cpu_few_rows import KERNEL_ROWS
from exo.engine.mlx.load import load_for_inference
from tests.platforms import needs_numba

SCALE = 0.125


def _normal(*shape: int, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def _close(got: mx.array, expected: mx.array) -> None:
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@needs_numba
@pytest.mark.parametrize("length", [1, 3, 9])
def test_a_single_sequence_s_queries_attend_as_mlx_s_do_reading_the_cache_in_place(
    length: int,
) -> None:
    cache = KVCache()
    keys, values = cache.update_and_fetch(
        _normal(1, 3, 300, 64, seed=1), _normal(1, 3, 300, 64, seed=2)
    )
    queries = _normal(1, 9, length, 64, seed=3)  # 3 query heads per kv head
    mask = None if length == 1 else "causal"
    got = few_rows_attention(queries, keys, values, cache, SCALE, mask)
    _close(got, mlx_attention(queries, keys, values, cache, scale=SCALE, mask=mask))
    # The keys are the first 300 slots of the cache's bigger buffer: read there, not copied.
    buffer = whole_buffer(keys, cache.keys)
    assert buffer.shape[2] > 300 and np.shares_memory(buffer, np.asarray(cache.keys))


@needs_numba
def test_a_batch_s_rows_attend_each_to_its_own_keys_past_its_left_padding() -> None:
    rows: list[KVCache] = []
    for n, length in enumerate((40, 25, 7, 33)):  # merged, the shorter rows are left-padded
        cache = KVCache()
        cache.update_and_fetch(
            _normal(1, 3, length, 64, seed=n), _normal(1, 3, length, 64, seed=10 + n)
        )
        rows.append(cache)
    batch = BatchKVCache.merge(rows)  # pyright: ignore[reportAttributeAccessIssue]
    fed = 3
    mask = batch.make_mask(fed, return_array=True)  # pyright: ignore[reportAttributeAccessIssue]
    keys, values = batch.update_and_fetch(
        _normal(4, 3, fed, 64, seed=20), _normal(4, 3, fed, 64, seed=21)
    )
    assert isinstance(mask, mx.array) and mask.dtype == mx.bool_
    queries = _normal(4, 9, fed, 64, seed=22)
    got = few_rows_attention(queries, keys, values, batch, SCALE, mask)
    _close(got, mlx_attention(queries, keys, values, batch, scale=SCALE, mask=mask))


@needs_numba
def test_a_two_dimensional_mask_applies_to_every_row() -> None:
    keys, values = _normal(2, 2, 50, 32, seed=1), _normal(2, 2, 50, 32, seed=2)
    queries = _normal(2, 4, 3, 32, seed=3)
    mask = _normal(3, 50, seed=4) > -0.5
    got = few_rows_attention(queries, keys, values, None, SCALE, mask)
    _close(got, mlx_attention(queries, keys, values, None, scale=SCALE, mask=mask))


@needs_numba
@pytest.mark.parametrize("case", ["additive mask", "sinks", "too many queries", "float16"])
def test_what_the_kernel_does_not_take_is_mlx_s_attention(case: str) -> None:
    keys, values = _normal(1, 2, 40, 32, seed=1), _normal(1, 2, 40, 32, seed=2)
    queries = _normal(1, 4, 2, 32, seed=3)
    mask: mx.array | str | None = "causal"
    sinks = None
    if case == "additive mask":
        mask = _normal(2, 40, seed=4)
    elif case == "sinks":
        sinks = _normal(4, seed=5)
    elif case == "too many queries":
        queries = _normal(1, 4, KERNEL_ROWS + 1, 32, seed=6)
    else:
        queries, keys, values = (a.astype(mx.float16) for a in (queries, keys, values))
    got = few_rows_attention(queries, keys, values, None, SCALE, mask, sinks)
    expected = mlx_attention(queries, keys, values, None, scale=SCALE, mask=mask, sinks=sinks)
    assert mx.array_equal(got, expected).item()


@needs_numba
@pytest.mark.skipif(backend_name() != "cpu", reason="the kernels are the CPU backend's")
def test_a_loaded_model_decodes_as_with_mlx_s_attention(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt, then decode steps of 1 and of 4 tokens: the loaded model's logits
    with the kernel's attention and with MLX's agree to float32 rounding."""
    model, _ = load_for_inference(tiny_model_dir)
    files = sys.modules[type(model).__module__]
    assert files.scaled_dot_product_attention is few_rows_attention  # pyright: ignore[reportAttributeAccessIssue]
    prompt = mx.array([[5, 17, 300, 42, 9, 1000, 77, 3]])
    logits: list[list[mx.array]] = []
    for attention in (few_rows_attention, mlx_attention):
        monkeypatch.setattr(files, "scaled_dot_product_attention", attention)
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        steps = [cast(mx.array, model(mx.array([[11]]), cache=cache))]
        steps.append(cast(mx.array, model(mx.array([[12, 13, 14, 15]]), cache=cache)))
        steps.append(cast(mx.array, model(mx.array([[16]]), cache=cache)))
        logits.append(steps)
    for got, expected in zip(*logits, strict=True):
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-4).item()


@needs_numba
def test_values_of_another_head_size_than_the_keys_are_mlx_s_attention() -> None:
    """Multi-head latent attention (DeepSeek-V2's): keys of 192, values of 128."""
    keys, values = _normal(1, 2, 40, 192, seed=1), _normal(1, 2, 40, 128, seed=2)
    queries = _normal(1, 4, 2, 192, seed=3)
    got = few_rows_attention(queries, keys, values, None, SCALE, "causal")
    expected = mlx_attention(queries, keys, values, None, scale=SCALE, mask="causal")
    assert got.shape == (1, 4, 2, 128)
    assert mx.array_equal(got, expected).item()
