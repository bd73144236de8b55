"""`MultimodalRope` (`engine/mlx/multimodal_rope.py`) rotates as mlx-vlm's
M-RoPE does for both Qwen layouts, equals plain RoPE for text, and shifts text
by each row's delta; `PositionTracker` keeps the deltas in a cache."""

from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

from exo.engine.image_positions import PositionSpan
from exo.engine.mlx.multimodal_rope import (
    ForwardPositions,
    ImageInputs,
    MultimodalRope,
    PositionTracker,
    rope_sections,
)

DIMS, BASE = 16, 10000.0
SECTIONS = [2, 3, 3]
STYLES = {False: "chunked", True: "interleaved"}  # Qwen2-VL / Qwen2.5-VL, Qwen3-VL


def _rope(interleaved: bool) -> tuple[MultimodalRope, ForwardPositions]:
    state = ForwardPositions()
    return MultimodalRope(nn.RoPE(DIMS, base=BASE), SECTIONS, interleaved, state), state


@pytest.mark.parametrize("interleaved", [False, True])
def test_three_axes_rotate_as_mlx_vlm(interleaved: bool) -> None:
    rope, state = _rope(interleaved)
    theirs = MRoPERotaryEmbedding(
        DIMS, base=BASE, mrope_section=SECTIONS, style=STYLES[interleaved]
    )
    mx.random.seed(3)
    q = mx.random.normal((1, 2, 7, DIMS))
    positions = mx.random.randint(0, 50, (3, 1, 7))
    expected, _ = cast(tuple[mx.array, mx.array], theirs.apply_rotary(q, q, positions))
    state.positions = positions
    assert np.allclose(np.array(rope(q)), np.array(expected), atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_rotates_as_plain_rope_shifted_by_its_rows_delta(interleaved: bool) -> None:
    rope, state = _rope(interleaved)
    mx.random.seed(4)
    x = mx.random.normal((2, 2, 3, DIMS))
    plain = nn.RoPE(DIMS, base=BASE)
    # Three equal axes are plain RoPE at that position.
    state.positions = mx.broadcast_to(mx.arange(5, 8)[None, None], (3, 2, 3))
    assert np.allclose(np.array(rope(x)), np.array(plain(x, offset=5)), atol=1e-5)
    # Without positions: index + each row's delta.
    state.positions, state.shift = None, mx.array([0, -4])
    out = rope(x, offset=mx.array([9, 9]))
    assert np.allclose(np.array(out[0]), np.array(plain(x[:1], offset=9)[0]), atol=1e-6)
    assert np.allclose(np.array(out[1]), np.array(plain(x[1:], offset=5)[0]), atol=1e-6)


def test_the_tracker_keeps_each_tokens_delta_and_text_goes_on_from_the_last() -> None:
    state = ForwardPositions()
    tracker = PositionTracker(state)
    cache = KVCache()
    span = PositionSpan(([0, 1, 1, 1, 1], [0, 1, 1, 2, 2], [0, 1, 2, 1, 2]), [0, -1, -1, -1, -2])
    tracker.begin(cache, mx.zeros((1, 5)), ImageInputs(span))
    assert state.positions is not None and state.positions.shape == (3, 1, 5)
    tracker.end()
    assert state.positions is None
    tracker.begin(cache, mx.zeros((1, 2)), None)  # text: from the last token's delta
    assert state.shift is not None and state.shift.tolist() == [-2]
    tracker.end()
    assert cache.keys is not None
    assert cache.keys[0, 0, : cache.offset, 0].tolist() == [0, -1, -1, -1, -2, -2, -2]
    cache.trim(3)  # a shorter prefix: its own last delta
    tracker.begin(cache, mx.zeros((1, 1)), None)
    assert state.shift is not None and state.shift.tolist() == [-1]


def test_the_tracker_without_multimodal_rope_counts_tokens_only() -> None:
    tracker, cache = PositionTracker(None), KVCache()
    tracker.begin(cache, mx.zeros((2, 3)), None)
    tracker.end()
    assert cache.offset == 3 and cache.keys is not None
    assert not bool(mx.any(cache.keys[:, :, :3] != 0).item())


def test_rope_sections_from_both_config_layouts() -> None:
    flat = {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    nested = {
        "text_config": {"rope_scaling": {"mrope_section": [24, 20, 20], "mrope_interleaved": True}}
    }
    assert rope_sections(flat) == ([16, 24, 24], False)
    assert rope_sections(nested) == ([24, 20, 20], True)
    assert rope_sections({"rope_scaling": {"type": "linear", "factor": 2.0}}) is None
    assert rope_sections({}) is None
