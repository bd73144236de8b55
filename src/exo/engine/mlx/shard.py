"""One rank's part of a model for pipeline-parallel inference.

Rank r holds the transformer layers [start, end); the first rank also holds
the token embedding, the last one the final norm and the output head (with
tied embeddings that is the embedding matrix, so the last rank loads it too).
Only those tensors are ever read from disk: mlx_lm builds the model lazily,
the shard keeps references to its own modules, and the rest is dropped before
anything is evaluated.
"""

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import load_model

from exo.engine.mlx.load import prepare_for_backend
from exo.shared.architectures import SHARDABLE_ARCHITECTURES
from exo.shared.types.shard import LayerRange

# Architectures whose mlx_lm model is `model.embed_tokens -> model.layers[i](h, mask,
# cache) -> model.norm -> lm_head | tied embedding`, which is what a shard runs.
SUPPORTED_MODEL_TYPES = SHARDABLE_ARCHITECTURES


class UnsupportedShard(ValueError):
    """The model cannot be split this way (architecture or layer count)."""


class ShardModel(nn.Module):
    """Embedding (first rank), layers [start, end), norm and head (last rank)."""

    def __init__(
        self,
        layers: LayerRange,
        blocks: list[nn.Module],
        embed: nn.Module | None,
        norm: nn.Module | None,
        head: nn.Module | None,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        self.layer_range = layers
        self.layers = blocks
        self.embed_tokens = embed
        self.norm = norm
        # None with tied embeddings: the head is the embedding matrix.
        self.lm_head = head
        self.sliding_window = sliding_window

    def _is_sliding(self, block: nn.Module) -> bool:
        return bool(getattr(block, "use_sliding", False))

    def make_cache(self) -> list[Any]:
        return [
            RotatingKVCache(max_size=self.sliding_window)
            if self._is_sliding(block) and self.sliding_window
            else KVCache()
            for block in self.layers
        ]

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids (1, n) -> hidden states (1, n, hidden); first rank only."""
        if self.embed_tokens is None:
            raise RuntimeError("only the first rank embeds tokens")
        return self.embed_tokens(tokens)

    def forward(self, h: mx.array, cache: list[Any]) -> mx.array:
        """Run this shard's layers over hidden states, appending to `cache`."""
        full_mask = sliding_mask = None
        for block, layer_cache in zip(self.layers, cache, strict=True):
            if self._is_sliding(block):
                if sliding_mask is None:
                    sliding_mask = create_attention_mask(
                        h, layer_cache, window_size=self.sliding_window
                    )
                mask = sliding_mask
            else:
                if full_mask is None:
                    full_mask = create_attention_mask(h, layer_cache)
                mask = full_mask
            h = block(h, mask, cache=layer_cache)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Hidden states -> vocabulary logits; last rank only."""
        if self.norm is None:
            raise RuntimeError("only the last rank computes logits")
        out = self.norm(h)
        head, embed = self.lm_head, self.embed_tokens
        if head is not None:
            return head(out)
        # Tied: the embedding matrix (an Embedding, or a QuantizedEmbedding off the CPU).
        return cast(nn.Embedding, embed).as_linear(out)


def model_layer_count(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])


def _tensors_on_disk(model_dir: Path, model: nn.Module) -> set[str]:
    """Names of the weights in the folder's files, as the model names them."""
    weights: dict[str, mx.array] = {}
    for path in model_dir.glob("model*.safetensors"):
        weights.update(cast(dict[str, mx.array], mx.load(str(path))))  # lazy: headers only
    sanitize = getattr(model, "sanitize", None)
    return set(sanitize(weights) if sanitize else weights)


def load_shard(model_dir: Path, layers: LayerRange) -> ShardModel:
    """Load `layers` of the model in `model_dir` (plus embedding/head as the
    position needs) for inference on this machine's backend. The folder may
    hold only the weight files with this shard's tensors."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedShard(
            f"pipeline sharding supports {sorted(SUPPORTED_MODEL_TYPES)}, not {model_type!r}"
        )
    if layers.total != (count := model_layer_count(model_dir)):
        raise UnsupportedShard(f"{layers} were asked for, but the model has {count} layers")
    start, end = layers.start, layers.end
    # Lazy: parameters are unevaluated views of the files; only what the shard
    # keeps is ever read, dequantized and evaluated. Not strict: other ranks'
    # weights may be absent (checked below for this shard's own).
    full, config = load_model(model_dir, lazy=True, strict=False)
    inner: Any = full["model"]
    tied = "lm_head" not in full  # mlx_lm makes no head module for tied embeddings
    keep = [f"model.layers.{i}." for i in range(start, end)]
    if layers.is_first or (layers.is_last and tied):
        keep.append("model.embed_tokens.")
    if layers.is_last:
        keep += ["model.norm.", "lm_head."]
    needed = {
        name
        for name, _ in cast(list[tuple[str, mx.array]], tree_flatten(full.parameters()))
        if name.startswith(tuple(keep))
    }
    missing = sorted(needed - _tensors_on_disk(model_dir, full))
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} weights of layers [{start}, {end}) are not in {model_dir}, "
            f"e.g. {', '.join(missing[:3])}"
        )
    shard = ShardModel(
        layers,
        blocks=list(inner.layers[start:end]),
        embed=inner.embed_tokens if "model.embed_tokens." in keep else None,
        norm=inner.norm if layers.is_last else None,
        head=None if tied or not layers.is_last else full["lm_head"],
        sliding_window=getattr(inner, "sliding_window", None),
    )
    del full, inner
    shard = prepare_for_backend(shard, config)
    shard.eval()
    return shard
