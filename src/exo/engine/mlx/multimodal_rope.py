"""Multimodal rotary positions (M-RoPE) on mlx-lm's text model of a Qwen-VL
family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), whose attention layers rotate by the
token's index in the cache (`nn.RoPE`), right for text only
(`engine/image_positions.py` says where tokens sit once a prompt has images).

`install` gives every attention layer a `MultimodalRope` in place of its RoPE,
and (Qwen3-VL) the first decoder layers a `deepstack` addition; both read what
the current forward pass is given, a `ForwardPositions` shared by the model:

- a forward pass that reads image tokens (a prompt's chunk, one row: prompts
  with images are read alone) is given every token's three positions, which are
  rotated here (the frequencies of each axis' section, as mlx-vlm does), and
  Qwen3-VL's deepstack features, added to the hidden states of image tokens
  after the first decoder layers;
- any other pass rotates by index + the row's delta (MLX's fast RoPE with a
  per-row offset): text after an image, decode and draft verification.

The deltas live in the cache: the model's cache list ends with a `KVCache` of
one scalar per token, each token's delta (`PositionTracker`). Everything the
runner does to caches (batching rows, trimming refused drafts, the prefix
cache and its disk tier) thus keeps each row's deltas with its KV, and the
delta of a row's next token is its last token's. A pipeline rank keeps the same
cache for the same reason (`pipeline.PipelineStage`, where it also counts
tokens for ranks whose layers all keep a fixed-size state).
"""

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from exo.engine.image_positions import PositionSpan
from exo.engine.mlx.batch_order import mark_read_by_position
from exo.engine.mlx.prefix_cache import LayerCache


@dataclass(frozen=True)
class ImageInputs:
    """What a forward pass reading image tokens is given besides their
    embeddings: the tokens' positions and deltas, and the deepstack features
    added after the first decoder layers (Qwen3-VL; each (1, tokens, hidden),
    zero where no image token is)."""

    positions: PositionSpan
    deepstack: tuple[mx.array, ...] = ()


@dataclass
class ForwardPositions:
    """The current forward pass' positions, read by the model's attention layers:
    each token's three positions (3, rows, tokens), or each row's delta (rows,)."""

    positions: mx.array | None = None
    shift: mx.array | None = None
    deepstack: tuple[mx.array, ...] = field(default_factory=tuple[mx.array, ...])


def rope_sections(config: dict[str, Any]) -> tuple[list[int], bool] | None:
    """A model's M-RoPE sections (frequencies per axis) and whether they
    interleave (Qwen3-VL), from its config.json; None for any other RoPE."""
    text = config.get("text_config", config)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = text.get(key) or config.get(key) or {}
        section = scaling.get("mrope_section") if isinstance(scaling, dict) else None
        if isinstance(section, list) and len(cast(list[object], section)) == 3:
            interleaved = bool(scaling.get("mrope_interleaved", False))
            return [int(n) for n in cast(list[int], section)], interleaved
    return None


def uses_multimodal_rope(model_dir: Path) -> bool:
    """Whether the model in `model_dir` places tokens by M-RoPE (`install` applies)."""
    return rope_sections(json.loads((model_dir / "config.json").read_text())) is not None


class MultimodalRope(nn.Module):
    """An attention layer's RoPE, made multimodal (see the module docstring)."""

    def __init__(
        self, rope: nn.RoPE, sections: Sequence[int], interleaved: bool, state: ForwardPositions
    ) -> None:
        super().__init__()
        if rope.traditional:
            raise ValueError("M-RoPE of a traditional (interleaved pairs) RoPE is not supported")
        self.rope = rope
        half = rope.dims // 2
        # Which axis each frequency takes its position from (mlx-vlm's selectors).
        axis = [0] * half
        if interleaved:  # Qwen3-VL: t h w t h w ... for 3 x the smaller sections
            for which, first in ((1, 1), (2, 2)):
                for index in range(first, min(sections[which] * 3, half), 3):
                    axis[index] = which
        else:  # Qwen2-VL: t t ... h h ... w w ...
            start = sections[0]
            for which in (1, 2):
                for index in range(start, min(start + sections[which], half)):
                    axis[index] = which
                start += sections[which]
        self._axis = mx.array(axis, dtype=mx.int32)
        exponents = mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims
        self._inverse_frequencies = rope.scale / (rope.base**exponents)
        mx.eval(self._axis, self._inverse_frequencies)  # never tied to the loading thread
        object.__setattr__(self, "_state", state)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        state = cast(ForwardPositions, self._state)
        if state.positions is not None:
            return self._rotate(x, state.positions)
        if state.shift is not None:
            offset = offset + state.shift
        return self.rope(x, offset=cast(Any, offset))  # MLX takes an offset per row too

    def _rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """`x` (rows, heads, tokens, dims) rotated by each token's positions
        (3, rows, tokens): each frequency by its axis' position."""
        dims, half = self.rope.dims, self.rope.dims // 2
        chosen = mx.take(positions, self._axis, axis=0)  # (half, rows, tokens)
        angles = chosen.transpose(1, 2, 0).astype(mx.float32) * self._inverse_frequencies
        cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]
        first, second = x[..., :half], x[..., half:dims]
        rotated = [first * cos - second * sin, second * cos + first * sin]
        if x.shape[-1] > dims:
            rotated.append(x[..., dims:])
        return mx.concatenate(rotated, axis=-1).astype(x.dtype)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        raise ValueError("the model keeps no list of layers")
    return cast(list[nn.Module], layers)


def install(model: nn.Module, config: dict[str, Any]) -> ForwardPositions | None:
    """Make an mlx-lm model of a Qwen-VL family place tokens by M-RoPE (see the
    module docstring); its `ForwardPositions`, or None for a model without
    M-RoPE (left as it is)."""
    found = rope_sections(config)
    if found is None:
        return None
    sections, interleaved = found
    state = ForwardPositions()
    replaced = 0
    for _, module in model.named_modules():
        rope = module.get("rope") if isinstance(module, nn.Module) else None
        if isinstance(rope, nn.RoPE):
            module["rope"] = MultimodalRope(rope, sections, interleaved, state)
            replaced += 1
    if not replaced:
        raise ValueError("the model's attention layers have no RoPE to make multimodal")
    for index, layer in enumerate(_decoder_layers(model)[: deepstack_layers(config)]):
        _add_deepstack(layer, index, state)
    return state


def deepstack_layers(config: dict[str, Any]) -> int:
    """How many of the first decoder layers take deepstack features (Qwen3-VL)."""
    vision = config.get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or ())


def _add_deepstack(layer: nn.Module, index: int, state: ForwardPositions) -> None:
    """Qwen3-VL's deepstack: the features of the pass' image tokens for layer
    `index` are added to its output. The layer keeps its class's forward (and
    its parameters their names): its class becomes a subclass adding them."""
    base = type(layer)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        if index >= len(state.deepstack):
            return out
        return out + state.deepstack[index].astype(out.dtype)

    layer.__class__ = type(f"Deepstack{base.__name__}", (base,), {"__call__": __call__})


class PositionTracker:
    """Keeps each token's delta in the last cache of a model's cache list and
    sets a forward pass' positions from it (see the module docstring)."""

    def __init__(self, state: ForwardPositions | None) -> None:
        self.state = state  # None: a model without M-RoPE (deltas stay 0)

    def begin(self, cache: LayerCache, inputs: mx.array, images: ImageInputs | None) -> None:
        """Before a forward pass of `inputs` (rows, tokens): its positions, and
        the new tokens' deltas appended to `cache`."""
        rows, tokens = inputs.shape[:2]
        state = self.state
        if state is None or images is None:
            last = _last_delta(cache, rows) if state is not None else mx.zeros((rows,))
            deltas = mx.broadcast_to(last[:, None], (rows, tokens))
            if state is not None:
                state.shift = last.astype(mx.int32)
        else:
            span = images.positions
            if rows != 1 or len(span.deltas) != tokens:
                raise ValueError(
                    f"positions of {len(span.deltas)} tokens were given for {rows} x {tokens}"
                )
            state.positions = mx.array(list(span.axes), dtype=mx.int32)[:, None, :]
            state.deepstack = images.deepstack
            deltas = mx.array(span.deltas, dtype=mx.float32)[None]
        value = deltas.astype(mx.float32)[:, None, :, None]
        cache.update_and_fetch(value, value)
        mark_read_by_position(cache)  # `_last_delta` reads a row's last slot

    def end(self) -> None:
        if self.state is not None:
            self.state.positions, self.state.shift, self.state.deepstack = None, None, ()

    @contextmanager
    def forward(
        self, cache: LayerCache, inputs: mx.array, images: ImageInputs | None
    ) -> Iterator[None]:
        """A forward pass' span: `begin` before, `end` after."""
        self.begin(cache, inputs, images)
        try:
            yield
        finally:
            self.end()


def _last_delta(cache: LayerCache, rows: int) -> mx.array:
    """Each row's last token's delta (rows are right-aligned in a batch cache)."""
    held = getattr(cache, "_idx", None)  # a batch cache's end; else the tokens held
    held = cache.offset if held is None else held
    if cache.keys is None or held == 0:
        return mx.zeros((rows,))
    return cache.keys[:, 0, held - 1, 0]


class MultimodalRopeModel(nn.Module):
    """A whole model with M-RoPE, called as mlx-lm's model is, with one cache
    more (the deltas) and, for a chunk with images, its `ImageInputs`."""

    def __init__(self, model: nn.Module, state: ForwardPositions) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "_tracker", PositionTracker(state))

    @property
    def layers(self) -> list[nn.Module]:
        return _decoder_layers(self.model)

    def make_cache(self) -> list[LayerCache]:
        return [*make_prompt_cache(self.model), KVCache()]

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        images: ImageInputs | None = None,
    ) -> mx.array:
        if cache is None:
            raise ValueError("a model with multimodal positions runs on its caches")
        *layers, deltas = cache
        embedded = {} if input_embeddings is None else {"input_embeddings": input_embeddings}
        with cast(PositionTracker, self._tracker).forward(deltas, inputs, images):
            return self.model(inputs, cache=layers, **embedded)


def with_multimodal_rope(model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """A whole model as the runner calls it: with M-RoPE (`install`) and its
    cache of deltas where its family places tokens so; else `model` itself."""
    state = install(model, config)
    return model if state is None else MultimodalRopeModel(model, state)
