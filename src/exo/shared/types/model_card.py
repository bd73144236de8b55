"""Model cards: what placement and downloads need to know about a model (built
by `exo.models.cards`)."""

from collections.abc import Mapping
from typing import Any, Literal, Self, cast

from pydantic import model_validator

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId

SizeSource = Literal["safetensors_headers", "index_total_size", "file_sizes", "config_estimate"]
# What a layer caches while generating: keys and values of every token
# ("attention"), of the last `window` tokens ("sliding"), a compressed latent per
# token (multi-head latent attention, "latent"), a constant-size state (linear
# attention, SSM: "recurrent"), or nothing (MLP-only blocks: "none").
CacheKind = Literal["attention", "sliding", "latent", "recurrent", "none"]


class Quantization(FrozenModel):
    """The model's default affine quantization (modules may override it)."""

    bits: int
    group_size: int


def quantization_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """A config.json's quantization entry with its bits and group size, if any."""
    for key in ("quantization", "quantization_config"):
        value = config.get(key)
        if isinstance(value, dict) and "bits" in value and "group_size" in value:
            return value
    return None


def default_quantization(config: Mapping[str, Any]) -> Quantization | None:
    """A config.json's quantization (mlx-lm's key or Hugging Face's); None: unquantized."""
    quant = quantization_config(config)
    if quant is None:
        return None
    return Quantization(bits=int(quant["bits"]), group_size=int(quant["group_size"]))


class WeightFile(FrozenModel):
    """One safetensors file and which parts of the model it holds."""

    name: str
    layers: tuple[int, ...]  # sorted indices of the layers with tensors in this file
    embedding: bool  # holds input-side tensors (token embedding, vision tower)
    head: bool  # holds the final norm or the output head
    size_bytes: int | None = None  # the file's size, when known


class LayerCache(FrozenModel):
    """What one layer's cache (mlx-lm's, for its family) holds per sequence, in
    elements: the bytes depend on the backend's activation dtype
    (`exo.models.memory`)."""

    kind: CacheKind
    token_elements: int = 0  # cached per token, in the activation dtype
    window: int | None = None  # tokens kept at most; None: every token
    state_elements: int = 0  # constant-size state in the activation dtype (convolution state)
    float32_state_elements: int = 0  # constant-size state kept in float32 (recurrent state)


def full_attention(n_kv_heads: int, head_dim: int) -> LayerCache:
    """Keys and values of every KV head for every token."""
    return LayerCache(kind="attention", token_elements=2 * n_kv_heads * head_dim)


class ModelCard(FrozenModel):
    model_id: ModelId
    architecture: str  # config.json's model_type
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    tie_word_embeddings: bool
    # The dense MLP's hidden width and a mixture-of-experts expert's (None: the
    # config gives none): a tensor split divides them, with the heads, evenly.
    intermediate_size: int | None = None
    moe_intermediate_size: int | None = None
    # Relative file names a node needs: weight files, then config/tokenizer files.
    files: tuple[str, ...]
    weight_files: tuple[WeightFile, ...]
    # Bytes of the weights as stored (tensor data, safetensors headers excluded).
    total_bytes: int
    layer_bytes: int  # one transformer layer, average over layers, rounded up
    embedding_bytes: int  # input side: token embedding (and vision tower, if any)
    head_bytes: int  # output side: final norm and lm_head (0 for lm_head when tied)
    # Parameter counts as loaded (a quantized weight counts its dequantized elements).
    layer_params: int  # average over layers, rounded up
    embedding_params: int
    head_params: int
    quantization: Quantization | None  # None: unquantized
    dtype_bytes: int  # bytes per element of the unquantized weights (2 for bf16/fp16)
    size_source: SizeSource  # exact (headers) or how the sizes were estimated
    # One entry per layer: layers differ (dense and mixture-of-experts layers,
    # attention and recurrent layers). Cards from nodes that predate these fields
    # get the averages above for every layer and full attention over all KV heads.
    per_layer_bytes: tuple[int, ...]  # as stored
    per_layer_params: tuple[int, ...]  # as loaded, like `layer_params`
    layer_caches: tuple[LayerCache, ...]

    @model_validator(mode="before")
    @classmethod
    def _per_layer_from_averages(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, Any], data)
        n, kv_heads, head_dim = (fields.get(k) for k in ("n_layers", "n_kv_heads", "head_dim"))
        if not (isinstance(n, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
            return data  # the missing or malformed field fails validation
        defaults = {
            "per_layer_bytes": (fields.get("layer_bytes"),) * n,
            "per_layer_params": (fields.get("layer_params"),) * n,
            "layer_caches": (full_attention(kv_heads, head_dim),) * n,
        }
        return fields | {k: v for k, v in defaults.items() if not fields.get(k)}

    @model_validator(mode="after")
    def _one_entry_per_layer(self) -> Self:
        lengths = {len(self.per_layer_bytes), len(self.per_layer_params), len(self.layer_caches)}
        if lengths != {self.n_layers}:
            raise ValueError(
                f"per-layer fields need {self.n_layers} entries, one per layer, not {lengths}"
            )
        return self

    @property
    def other_bytes(self) -> int:
        """Embedding, norm and head, as stored."""
        return self.embedding_bytes + self.head_bytes

    @property
    def metadata_files(self) -> tuple[str, ...]:
        """The files that are not weights (config, tokenizer, index)."""
        weights = {f.name for f in self.weight_files}
        return tuple(f for f in self.files if f not in weights)
