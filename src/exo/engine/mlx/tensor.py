"""Tensor-parallel ranks: every rank holds a slice of every layer.

Attention is split by heads (each rank's q/k/v projections make its own heads,
its share of the output projection is summed across ranks), MLPs by their
hidden width, mixtures of experts by each expert's hidden width (the router
stays whole: every rank routes alike). Where a layer's output is a sum of the
ranks' partial outputs, `mx.distributed.all_sum` makes it whole again on every
rank: twice per layer per token, so the ranks need a fast link.

How a model is sliced: mlx-lm's own `shard(group)` where the model has one;
otherwise exo's strategy for the family (`OWN_TENSOR_STRATEGIES`), which slices
the attention, dense MLPs and mixtures of experts it recognises by their
projections and leaves everything else whole on every rank (linear-attention
and SSM mixers, norms), which is correct as every rank computes them on the
same inputs, only not split. What neither covers is refused before download
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
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.load import dequantize_f32, prepare_for_backend
from exo.engine.mlx.shard import UnsupportedShard
from exo.shared.architectures import OWN_TENSOR_STRATEGIES, tensor_refusal

# Attributes attention modules keep their head counts in (divided by the ranks).
_HEAD_COUNTS = (
    "n_heads",
    "n_kv_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
)


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
    model, config = load_model(model_dir, lazy=True)
    if backend_name() == "cpu" and "quantization" in config:
        # Sliced after dequantizing (the CPU runs float32): the whole model's
        # float32 weights pass through memory once, a layer at a time.
        model = dequantize_f32(model)
    shard_model(model, model_type, group)
    return RankZeroLogits(prepare_for_backend(model, config), group)


def shard_model(model: nn.Module, model_type: str, group: mx.distributed.Group) -> None:
    """Slice `model` in place for this rank of `group`."""
    try:
        if model_type in OWN_TENSOR_STRATEGIES:
            for layer in cast(list[nn.Module], cast(Any, model).layers):
                _shard_layer(layer, group)
        else:
            cast(Any, model).shard(group)
    except (AssertionError, ValueError) as error:  # mlx-lm's checks, uneven splits
        raise UnsupportedShard(
            f"{model_type} cannot be split into {group.size()} tensor ranks: {error}"
        ) from error


def _shard_layer(layer: nn.Module, group: mx.distributed.Group) -> None:
    """Exo's strategy: slice the parts of `layer` it recognises, in place."""
    for name, child in layer.children().items():
        if not isinstance(child, nn.Module):
            continue
        if _has(child, "q_proj", "k_proj", "v_proj", "o_proj"):
            _shard_attention(child, group)
        elif _has(child, "switch_mlp"):
            summed = _shard_experts(child, group)
            if summed is not child:
                layer[name] = summed
        elif _has(child, "up_proj", "down_proj"):
            _shard_dense(child, group)


def _has(module: nn.Module, *names: str) -> bool:
    return all(isinstance(module.get(name), nn.Module) for name in names)


def _shard_attention(attention: nn.Module, group: mx.distributed.Group) -> None:
    n = group.size()
    counts = {
        name: v for name in _HEAD_COUNTS if isinstance(v := getattr(attention, name, None), int)
    }
    uneven = {name: v for name, v in counts.items() if v % n}
    if uneven:
        raise UnsupportedShard(f"{uneven} cannot be divided among {n} tensor ranks")
    for name in ("q_proj", "k_proj", "v_proj"):
        attention[name] = shard_linear(attention[name], "all-to-sharded", group=group)
    attention["o_proj"] = shard_linear(attention["o_proj"], "sharded-to-all", group=group)
    for name, value in counts.items():
        setattr(attention, name, value // n)


def _shard_dense(mlp: nn.Module, group: mx.distributed.Group) -> None:
    for name in ("gate_proj", "up_proj"):
        if _has(mlp, name):
            mlp[name] = shard_linear(mlp[name], "all-to-sharded", group=group)
    mlp["down_proj"] = shard_linear(mlp["down_proj"], "sharded-to-all", group=group)


def _shard_experts(block: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Each expert's (and shared expert's) hidden width sliced; the block's output
    is then a partial sum, made whole by the block's own `sharding_group` where
    it has one, else by a wrapper. Returns the module that replaces `block`."""
    parts = [block["switch_mlp"]]
    parts += [block[name] for name in ("shared_expert", "shared_experts") if _has(block, name)]
    outputs = [block[name] for name in ("fc2_latent_proj",) if _has(block, name)]
    for part in parts:
        for name in ("gate_proj", "up_proj", "fc1"):
            if _has(part, name):
                shard_inplace(part[name], "all-to-sharded", group=group)
        for name in ("down_proj", "fc2"):
            if _has(part, name):
                shard_inplace(part[name], "sharded-to-all", group=group)
                outputs.append(part[name])
    if any("bias" in output for output in outputs):
        # Each rank's partial sum would add the bias once more.
        raise UnsupportedShard("experts whose output projections have a bias")
    if "sharding_group" in vars(block):
        block.sharding_group = group
        return block
    return _Summed(block, group)


class _Summed(nn.Module):
    """A block whose output each rank computes a part of: the parts summed."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.block = block
        self._group = group

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return mx.distributed.all_sum(self.block(*args, **kwargs), group=self._group)
