"""One rank's part of a model for pipeline-parallel inference, run by the model's
own forward pass.

Rank r holds the layers [start, end) of the model's layer list. The model is
built by mlx-lm as for a whole run, lazily (no weight is read yet), and every
layer another rank holds is replaced by a `_Ghost`, which hands its input on
unchanged and holds no weights. The model's own `__call__` then runs on every
rank, so whatever an architecture does around its layers (masks, sliding
windows, attention sinks, hybrid SSM / linear-attention caches, MLA, embedding
scales, logit soft-caps) is mlx-lm's code, never ours:

- rank 0 is called with the token ids; the ghost right after its slice stops
  the forward pass and hands out the hidden states it received (`_SliceEnd`);
- a later rank is called with placeholder ids of the same shape (their embedding
  is built lazily and never computed: nothing depends on it); the ghost right
  before its slice swaps in the hidden states the previous rank sent;
- the last rank runs to the model's end: the logits.

Caches: the model's own `make_cache()` says which cache each layer uses (a
dry run of the forward pass, every layer a ghost, records which cache object
each layer position receives). A rank keeps the caches of its own layers; the
others' positions get a `_GhostCache` at every call, which answers what the
model asks a cache at the top of its forward pass (`make_mask`, `offset`) as
one of this rank's caches of the same kind would (they hold the same tokens).
A mask made from a ghost of a kind this rank does not hold only feeds other
ranks' layers, so it is never used here.

Weights: a rank reads and evaluates only its layers' weights, the embedding
(first rank) and the final norm / head (last rank; the embedding too when the
head is tied to it). Everything else stays an unevaluated lazy array: other
ranks' files need not be on this node.
"""

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from exo.engine.mlx.load import prepare_for_backend
from exo.shared.architectures import pipeline_refusal
from exo.shared.tensor_names import tensor_part
from exo.shared.types.shard import LayerRange

LayerCache = Any  # an mlx_lm cache object


class UnsupportedShard(ValueError):
    """The model cannot be split this way (architecture or layer count)."""


class _SliceEnd(Exception):  # control flow, not an error
    """Raised by the ghost after a non-last rank's slice: its hidden states."""

    def __init__(self, hidden: mx.array) -> None:
        super().__init__()
        self.hidden = hidden


_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(module: object) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, _PLAIN)
    }


class _Ghost(nn.Module):
    """Stands in for a layer another rank holds: no weights, input handed on.

    It keeps the layer's plain attributes (`is_linear`, `use_sliding`,
    `block_type`, ... which models read in their forward loop), and records the
    cache object it was given when `seen` is a list (the dry run)."""

    def __init__(self, layer: nn.Module, seen: list[object] | None = None) -> None:
        super().__init__()
        for name, value in _plain_attributes(layer).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_hidden", None)  # the entry ghost's: what to swap in
        object.__setattr__(self, "_ends_slice", False)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        seen = cast(list[object] | None, self._seen)
        if seen is not None:
            seen.extend([*args, *kwargs.values()])
        if self._ends_slice:
            raise _SliceEnd(x)
        hidden = cast(mx.array | None, self._hidden)
        return x if hidden is None else hidden


def _kind(cache: LayerCache) -> tuple[Any, ...]:
    """What makes two caches answer `make_mask` alike: class and window."""
    inner = getattr(cache, "caches", None)
    if isinstance(inner, list | tuple):
        return (type(cache).__name__, *(_kind(c) for c in cast(list[Any], inner)))
    return (
        type(cache).__name__.removeprefix("Batch"),
        getattr(cache, "max_size", None),
        getattr(cache, "keep", None),
    )


class _GhostCache:
    """Another rank's layer's cache: answers as `twin` (one of this rank's caches
    of the same kind, holding the same tokens) or, with none, as any of them."""

    def __init__(self, twin: LayerCache | None, fallback: Sequence[LayerCache]) -> None:
        self._twin = twin
        self._fallback = fallback

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        # No twin: the mask feeds only other ranks' layers.
        return None if self._twin is None else self._twin.make_mask(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        for cache in [self._twin, *self._fallback]:
            if cache is not None and hasattr(cache, name):
                return getattr(cache, name)
        raise AttributeError(f"no cache of this rank has {name!r}")


@dataclass(frozen=True)
class _CacheLayout:
    """Where this rank's caches go in the model's cache list."""

    template: list[LayerCache]  # the model's own, empty: fresh copies for requests
    owned: list[int]  # indices of the caches this rank's layers use, in order
    twins: dict[int, int | None]  # other index -> position in `owned` of one of its kind


def _layout(model: nn.Module, layers: list[nn.Module], layer_range: LayerRange) -> _CacheLayout:
    """Which of the model's caches this rank's layers use: found by a dry run of
    the forward pass (nothing computed) with every layer a recording ghost."""
    template = make_prompt_cache(model)
    originals = list(layers)
    records: list[list[object]] = [[] for _ in layers]
    try:
        layers[:] = [_Ghost(layer, seen) for layer, seen in zip(layers, records, strict=True)]
        model(mx.zeros((1, 2), dtype=mx.int32), cache=template)
    except Exception as error:
        raise UnsupportedShard(
            f"its forward pass cannot run with other ranks' layers left out ({error!r})"
        ) from error
    finally:
        layers[:] = originals
    by_id = {id(cache): index for index, cache in enumerate(template)}
    owned: list[int] = []
    for position in range(layer_range.start, layer_range.end):
        for value in records[position]:
            index = by_id.get(id(value))
            if index is not None and index not in owned:
                owned.append(index)
    kinds = [_kind(cache) for cache in template]
    twins = {
        index: next((n for n, o in enumerate(owned) if kinds[o] == kinds[index]), None)
        for index in range(len(template))
        if index not in owned
    }
    return _CacheLayout(template, owned, twins)


def _layer_list(model: nn.Module) -> list[nn.Module]:
    """The model's layer list, the one object its forward pass iterates (when
    `model.layers` is a fresh list per access, e.g. mlx-lm's pipeline view, the
    list it is taken from)."""
    view = getattr(model, "layers", None)
    if not isinstance(view, list) or not view:
        raise UnsupportedShard("its model keeps no list of layers")
    if getattr(model, "layers", None) is view:
        return cast(list[nn.Module], view)
    for _, module in model.named_modules():
        for value in module.values():
            if (
                isinstance(value, list)
                and len(cast(list[object], value)) == len(view)
                and all(a is b for a, b in zip(cast(list[object], value), view, strict=True))
            ):
                return cast(list[nn.Module], value)
    raise UnsupportedShard("its model keeps no single list of layers")


class ShardModel:
    """The model's own forward pass over this rank's layers (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layer_range: LayerRange,
        layout: _CacheLayout,
        weights: frozenset[str],
        hidden_size: int,
    ) -> None:
        self.model = model
        self.hidden_size = hidden_size
        self.weights = weights  # the names of the parameters this rank holds
        self.layer_range = layer_range
        self._layout = layout
        layers = _layer_list(model)
        self._entry = layers[layer_range.start - 1] if not layer_range.is_first else None
        if not layer_range.is_last:
            object.__setattr__(layers[layer_range.end], "_ends_slice", True)

    def whole_model_caches(self) -> list[LayerCache]:
        """Empty caches of every layer of the model: their kinds decide what all
        ranks do alike (whether requests batch)."""
        return [copy.deepcopy(cache) for cache in self._layout.template]

    def make_cache(self) -> list[LayerCache]:
        """Empty caches for this rank's layers."""
        return [copy.deepcopy(self._layout.template[i]) for i in self._layout.owned]

    def run(
        self, inputs: mx.array, cache: list[LayerCache], input_embeddings: mx.array | None = None
    ) -> mx.array:
        """Token ids (first rank; or their `input_embeddings`, a prompt with
        images) or the previous rank's hidden states -> this rank's output:
        hidden states for the next rank, or the logits (last rank). Appends to
        `cache` (this rank's layers' caches)."""
        layout = self._layout
        full: list[Any] = [None] * len(layout.template)
        for index, own in zip(layout.owned, cache, strict=True):
            full[index] = own
        for index, twin in layout.twins.items():
            full[index] = _GhostCache(None if twin is None else cache[twin], cache)
        if self._entry is None:
            ids = inputs
        else:
            ids = mx.zeros(inputs.shape[:2], dtype=mx.int32)
            object.__setattr__(self._entry, "_hidden", inputs)
        embedded = {} if input_embeddings is None else {"input_embeddings": input_embeddings}
        try:
            return self.model(ids, cache=full, **embedded)
        except _SliceEnd as end:
            if not isinstance(end.hidden, mx.array):
                raise UnsupportedShard("its layers hand on more than one array") from None
            return end.hidden
        finally:
            if self._entry is not None:
                object.__setattr__(self._entry, "_hidden", None)

    def placeholder_hidden(self, tokens: int) -> mx.array:
        """Zeros shaped like the hidden states of `tokens` tokens (warm-up input of a
        rank that is not the first)."""
        parameters = cast(list[tuple[str, mx.array]], tree_flatten(self.model.parameters()))
        dtype = next(
            (
                array.dtype
                for name, array in parameters
                if name in self.weights and mx.issubdtype(array.dtype, mx.floating)
            ),
            mx.float32,
        )
        return mx.zeros((1, tokens, self.hidden_size), dtype=dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds."""
        return sum(
            array.nbytes
            for name, array in cast(
                list[tuple[str, mx.array]], tree_flatten(self.model.parameters())
            )
            if name in self.weights
        )


def model_layer_count(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])


def _tensors_on_disk(model_dir: Path, model: nn.Module) -> set[str]:
    """Names of the weights in the folder's files, as the model names them."""
    weights: dict[str, mx.array] = {}
    for path in model_dir.glob("model*.safetensors"):
        weights.update(cast(dict[str, mx.array], mx.load(str(path))))  # lazy: headers only
    sanitize = getattr(copy.copy(model), "sanitize", None)
    if sanitize is None:
        return set(weights)
    try:  # on a copy: some models' `sanitize` also changes the model (load_model ran it)
        return set(sanitize(weights))
    except Exception:  # one that cannot run twice (e.g. it removes a module): names as stored
        return set(weights)


def _needed(name: str, layers: LayerRange, tied: bool) -> bool:
    """Whether this rank reads the parameter `name` (ghosts hold none)."""
    part = tensor_part(name, layers.total)
    if isinstance(part, int):
        return layers.start <= part < layers.end
    if part == "head":
        return layers.is_last
    if part == "embedding":
        return layers.is_first or (layers.is_last and tied)
    return False


def load_shard(model_dir: Path, layers: LayerRange) -> ShardModel:
    """Load `layers` of the model in `model_dir` for inference on this machine's
    backend. The folder may hold only the weight files this rank needs."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    refusal = pipeline_refusal(str(model_type))
    if refusal is not None:
        raise UnsupportedShard(refusal)
    if layers.total != (count := model_layer_count(model_dir)):
        raise UnsupportedShard(f"{layers} were asked for, but the model has {count} layers")
    # Lazy: parameters are unevaluated views of the files. Not strict: other
    # ranks' weights may be absent (this rank's own are checked below).
    model, config = load_model(model_dir, lazy=True, strict=False)
    layer_list = _layer_list(model)
    if len(layer_list) != layers.total:
        raise UnsupportedShard(
            f"the model's layer list has {len(layer_list)} layers, its config {layers.total}"
        )
    layout = _layout(model, layer_list, layers)
    for index in [*range(layers.start), *range(layers.end, layers.total)]:
        layer_list[index] = _Ghost(layer_list[index])
    names = [name for name, _ in tree_flatten(model.parameters())]
    tied = not any(
        tensor_part(name, layers.total) == "head" and "norm" not in name for name in names
    )
    needed = {name for name in names if _needed(name, layers, tied)}
    missing = sorted(needed - _tensors_on_disk(model_dir, model))
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} weights of layers [{layers.start}, {layers.end}) are not in "
            f"{model_dir}, e.g. {', '.join(missing[:3])}"
        )
    model = prepare_for_backend(model, config, evaluate=needed.__contains__)
    text = config.get("text_config", config)
    hidden = int(config.get("hidden_size") or text.get("hidden_size") or text["d_model"])
    return ShardModel(model, layers, layout, frozenset(needed), hidden)
