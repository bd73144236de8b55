"""Tensor-parallel ranks: every rank holds a slice of every layer.

Attention is split by heads (each rank's q/k/v projections make its own heads,
its share of the output projection is summed across ranks), MLPs by their
hidden width, mixtures of experts by each expert's hidden width (the router
stays whole: every rank routes alike). Where a layer's output is a sum of the
ranks' partial outputs, `mx.distributed.all_sum` makes it whole again on every
rank: twice per layer per token, so the ranks need a fast link.

How a model is sliced: exo's strategy for the families it has one for
(`EXO_TENSOR_STRATEGIES`), which slices the attention, dense MLPs and mixtures
of experts it recognises by their projections, as `shared/tensor_split.py`
divides them (unevenly where the sizes call for it), and leaves everything else
whole on every rank (linear-attention and SSM mixers, norms), which is correct
as every rank computes them on the same inputs, only not split; mlx-lm's own
`shard(group)` for the other families that have one (even splits only). Exo's
slices stay plain linear layers (the CPU's few-rows kernel takes them), the
ones whose outputs are partial sums wrapped in an `all_sum`. What neither covers is refused before download
(`shared/architectures.py:tensor_refusal`).

Every rank runs the whole forward pass and computes the same hidden states; the
logits every rank samples from are rank 0's (`RankZeroLogits`), so that ranks
on different hardware, whose kernels may round differently, still draw the
same tokens and decide alike (see `lockstep.py`).
"""

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.load import dequantize_f32, prepare_for_backend
from exo.engine.mlx.shard import UnsupportedShard
from exo.shared.architectures import EXO_TENSOR_STRATEGIES, tensor_refusal
from exo.shared.tensor_split import bounds, shares, split_layers
from exo.shared.types.model_card import default_quantization

# Attributes attention modules keep their head counts in (set to the rank's).
_QUERY_COUNTS = ("n_heads", "num_heads", "num_attention_heads")
_KV_COUNTS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


class RankZeroLogits(nn.Module):
    """The model with rank 0's logits on every rank: rank 0's summed with zeros
    from the others. The zeros still depend on each rank's logits, so every rank
    runs the last layer and its `all_sum`s as rank 0 does. Every position's:
    decode uses the last, a verify step (speculative decoding) all; prompt
    reading evaluates none, so no rank computes or sums them there."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.model = model
        self._group = group

    @property
    def layers(self) -> list[nn.Module]:
        return cast(list[nn.Module], cast(Any, self.model).layers)

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        logits = self.model(inputs, cache=cache)
        if self._group.rank() != 0:
            logits = mx.where(mx.array(False), logits, mx.zeros_like(logits))
        return mx.distributed.all_sum(logits, group=self._group)


def load_tensor_rank(model_dir: Path, group: mx.distributed.Group) -> RankZeroLogits:
    """This rank's slice of every layer of the model in `model_dir` (which holds
    every weight file), prepared for this machine's backend."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = str(config.get("model_type"))
    refusal = tensor_refusal(model_type)
    if refusal is not None:
        raise UnsupportedShard(refusal)
    quantization = default_quantization(config)
    model, config = load_model(model_dir, lazy=True)
    if backend_name() == "cpu" and "quantization" in config:
        # Sliced after dequantizing (the CPU runs float32): the whole model's
        # float32 weights pass through memory once, a layer at a time.
        model = dequantize_f32(model)
    # The split's blocks are the stored quantization's groups on every backend,
    # so ranks on a CPU (dequantized) and on Metal (quantized) slice alike.
    shard_model(model, model_type, group, quantization.group_size if quantization else 1)
    return RankZeroLogits(prepare_for_backend(model, config), group)


def shard_model(
    model: nn.Module, model_type: str, group: mx.distributed.Group, group_size: int = 1
) -> None:
    """Slice `model` in place for this rank of `group`; a quantized model's
    columns in blocks of `group_size`."""
    try:
        if model_type in EXO_TENSOR_STRATEGIES:
            for layer in cast(list[nn.Module], cast(Any, model).layers):
                _shard_layer(layer, group, group_size)
        else:
            cast(Any, model).shard(group)
    except (AssertionError, ValueError) as error:  # mlx-lm's checks, uneven splits
        raise UnsupportedShard(
            f"{model_type} cannot be split into {group.size()} tensor ranks: {error}"
        ) from error


def _shard_layer(layer: nn.Module, group: mx.distributed.Group, group_size: int) -> None:
    """Exo's strategy: slice the parts of `layer` it recognises, in place."""
    for name, child in layer.children().items():
        if not isinstance(child, nn.Module):
            continue
        if _has(child, "q_proj", "k_proj", "v_proj", "o_proj"):
            _shard_attention(child, group, group_size)
        elif _has(child, "switch_mlp"):
            summed = _shard_experts(child, group, group_size)
            if summed is not child:
                layer[name] = summed
        elif _has(child, "up_proj", "down_proj"):
            _shard_dense(child, group, group_size)


def _has(module: nn.Module, *names: str) -> bool:
    return all(isinstance(module.get(name), nn.Module) for name in names)


def _shard_attention(attention: nn.Module, group: mx.distributed.Group, group_size: int) -> None:
    """Whole KV heads per rank, each with the query heads that read it."""
    queries = [name for name in _QUERY_COUNTS if isinstance(getattr(attention, name, None), int)]
    keys = [name for name in _KV_COUNTS if isinstance(getattr(attention, name, None), int)]
    if not queries:
        raise UnsupportedShard(f"{type(attention).__name__} names no count of its heads")
    n_heads = int(getattr(attention, queries[0]))
    n_kv_heads = int(getattr(attention, keys[0])) if keys else n_heads
    per_head = _in_dims(attention["o_proj"]) // n_heads
    split = split_layers(
        group.size(),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=per_head,
        widths={},
        group_size=group_size,
    )
    if isinstance(split, str):
        raise UnsupportedShard(split)
    assert split.heads is not None and split.kv_heads is not None
    rank = group.rank()
    (q0, q1), (k0, k1) = bounds(split.heads, rank), bounds(split.kv_heads, rank)
    _keep_rows(attention["q_proj"], q0, q1, n_heads)
    for name in ("k_proj", "v_proj"):
        _keep_rows(attention[name], k0, k1, n_kv_heads)
    attention["o_proj"] = _summed_columns(attention["o_proj"], q0, q1, n_heads, group)
    for name in queries:
        setattr(attention, name, split.heads[rank])
    for name in keys:
        setattr(attention, name, split.kv_heads[rank])


def _shard_dense(mlp: nn.Module, group: mx.distributed.Group, group_size: int) -> None:
    start, end = _width_bounds(mlp["up_proj"], group, group_size)
    for name in ("gate_proj", "up_proj"):
        if _has(mlp, name):
            _keep_rows(mlp[name], start, end)
    mlp["down_proj"] = _summed_columns(mlp["down_proj"], start, end, None, group)


def _shard_experts(block: nn.Module, group: mx.distributed.Group, group_size: int) -> nn.Module:
    """Each expert's (and shared expert's) hidden width sliced; the block's output
    is then a partial sum, made whole by the block's own `sharding_group` where
    it has one, else by a wrapper. Returns the module that replaces `block`."""
    parts = [block["switch_mlp"]]
    parts += [block[name] for name in ("shared_expert", "shared_experts") if _has(block, name)]
    for part in parts:
        inputs = [name for name in ("gate_proj", "up_proj", "fc1") if _has(part, name)]
        start, end = _width_bounds(part[inputs[-1]], group, group_size)
        for name in inputs:
            _keep_rows(part[name], start, end)
        for name in ("down_proj", "fc2"):
            if _has(part, name):
                _keep_columns(part[name], start, end, group)
    for name in ("fc2_latent_proj",):  # applied to the partial sums: its bias once
        if _has(block, name) and group.rank() != 0 and "bias" in block[name]:
            del block[name]["bias"]
    if "sharding_group" in vars(block):
        block.sharding_group = group
        return block
    return _Summed(block, group)


def _width_bounds(
    layer: nn.Module, group: mx.distributed.Group, group_size: int
) -> tuple[int, int]:
    """This rank's [start, end) of the hidden width `layer` projects to."""
    width = _out_dims(layer)
    parts = shares(width, group.size(), group_size)
    if parts is None:
        raise UnsupportedShard(
            f"a width of {width} does not split into {group.size()} parts of {group_size}"
        )
    return bounds(parts, group.rank())


def _out_dims(layer: nn.Module) -> int:
    return int(layer["weight"].shape[-2])


def _in_dims(layer: nn.Module) -> int:
    columns = int(layer["weight"].shape[-1])
    return columns * 32 // int(cast(Any, layer).bits) if "scales" in layer else columns


def _keep_rows(layer: nn.Module, start: int, end: int, units: int | None = None) -> None:
    """Keep output rows [start, end) of `layer` (of `units` equal blocks: heads)."""
    if units is not None:
        per = _out_dims(layer) // units
        start, end = start * per, end * per
    for name in ("weight", "scales", "biases"):
        if name in layer:
            layer[name] = mx.contiguous(layer[name][..., start:end, :])
    if "bias" in layer:
        layer["bias"] = mx.contiguous(layer["bias"][..., start:end])


def _keep_columns(layer: nn.Module, start: int, end: int, group: mx.distributed.Group) -> None:
    """Keep input columns [start, end) of `layer`, whose output is then a partial
    sum: its bias stays on rank 0 only, so the sum adds it once."""
    if "scales" in layer:
        group_size, bits = int(cast(Any, layer).group_size), int(cast(Any, layer).bits)
        if start % group_size or end % group_size:
            raise UnsupportedShard(
                f"columns [{start}, {end}) cut quantization groups of {group_size}"
            )
        layer["weight"] = mx.contiguous(layer["weight"][..., start * bits // 32 : end * bits // 32])
        for name in ("scales", "biases"):
            if name in layer:
                layer[name] = mx.contiguous(
                    layer[name][..., start // group_size : end // group_size]
                )
    else:
        layer["weight"] = mx.contiguous(layer["weight"][..., start:end])
    if "bias" in layer and group.rank() != 0:
        del layer["bias"]


def _summed_columns(
    layer: nn.Module, start: int, end: int, units: int | None, group: mx.distributed.Group
) -> nn.Module:
    """`layer` keeping input columns [start, end) (of `units` equal blocks),
    its partial outputs summed over the ranks."""
    if units is not None:
        per = _in_dims(layer) // units
        start, end = start * per, end * per
    _keep_columns(layer, start, end, group)
    return _Summed(layer, group)


class _Summed(nn.Module):
    """A module whose output each rank computes a part of: the parts summed."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.block = block
        self._group = group

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return mx.distributed.all_sum(self.block(*args, **kwargs), group=self._group)
