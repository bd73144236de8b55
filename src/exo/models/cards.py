"""Model cards: what placement and downloads need to know about a model.

A card is built from an MLX model folder (`card_from_folder`: exact sizes from
the safetensors headers, no weights read) or from a Hugging Face repo's
`config.json` and `model.safetensors.index.json` without the weight files
(`card_from_config`: sizes estimated, see there). What a card implies for RAM
is in `exo.models.memory`, which files hold which layers in
`exo.models.weight_files`.
"""

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from exo.models.layer_estimates import (
    ATTENTION_FREE,
    DENSE_SIZE_KEYS,
    FAMILY_DEFAULTS,
    Dims,
    Layer,
    estimate_layers,
    nemotron_pattern,
)
from exo.models.safetensors_header import (
    DTYPE_BYTES,
    FLOAT_DTYPES,
    SafetensorsHeaderError,
    TensorInfo,
    read_safetensors_header,
)
from exo.models.weight_files import is_metadata_file, weight_files_from_map
from exo.shared.tensor_names import tensor_part
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import (
    ModelCard,
    Quantization,
    SizeSource,
    WeightFile,
    default_quantization,
    quantization_config,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
# What a node fetches besides the weights when the repo's listing is unknown.
DEFAULT_METADATA_FILES = (CONFIG_FILE, "tokenizer.json", "tokenizer_config.json")
_DEFAULT_CONTEXT = 4096
# A config.json or safetensors index this large is not one.
MAX_METADATA_BYTES = 50_000_000
_TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_FLOAT16_BYTES = 2


class ModelCardError(ValueError):
    """A model folder or config cannot be described (missing or malformed files)."""


# --- config -------------------------------------------------------------------


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Vision-language configs nest the language model's settings in `text_config`;
    keys neither gives take the defaults mlx-lm fills in for the model type."""
    nested = config.get("text_config")
    defaults = FAMILY_DEFAULTS.get(str(config.get("model_type")), {})
    return {**defaults, **config, **nested} if isinstance(nested, dict) else {**defaults, **config}


def _optional_int(config: Mapping[str, Any], *keys: str) -> int | None:
    """The first of `keys` the config gives as an int; None when it gives none."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _first_int(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    value = _optional_int(config, *keys)
    if value is not None:
        return value
    if default is None:
        raise ModelCardError(f"config.json lacks {' / '.join(keys)}")
    return default


def _module_group_size(config: Mapping[str, Any], module: str) -> int | None:
    quant = quantization_config(config)
    if quant is None:
        return None
    override = quant.get(module)
    if isinstance(override, dict) and "group_size" in override:
        return int(override["group_size"])
    return int(quant["group_size"])


def context_length_from_config(config: Mapping[str, Any]) -> int:
    """The longest sequence the model takes, in tokens, from its `config.json`."""
    return _first_int(
        _text_config(config), "max_position_embeddings", "max_seq_len", default=_DEFAULT_CONTEXT
    )


class _Shape(FrozenModel):
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    tie_word_embeddings: bool
    intermediate_size: int | None
    moe_intermediate_size: int | None


# Far beyond any model's, small enough that a card's per-layer lists and the
# sums over them stay cheap: a config past them is malformed (or hostile).
_MAX_LAYERS = 4096
_MAX_WIDTH = 1 << 20  # hidden size, heads, head dim
_MAX_VOCABULARY = 1 << 24
_MAX_CONTEXT = 1 << 31


def _check_bounds(shape: _Shape) -> None:
    """A `ModelCardError` for a shape no model has (0 layers, 2**62 of them)."""
    heads = 0 if shape.architecture in ATTENTION_FREE else 1  # attention-free: none
    bounds = {
        "layers": (shape.n_layers, 1, _MAX_LAYERS),
        "hidden size": (shape.hidden_size, 1, _MAX_WIDTH),
        "attention heads": (shape.n_heads, heads, _MAX_WIDTH),
        "key-value heads": (shape.n_kv_heads, heads, _MAX_WIDTH),
        "head dimension": (shape.head_dim, heads, _MAX_WIDTH),
        "vocabulary size": (shape.vocab_size, 1, _MAX_VOCABULARY),
        "context length": (shape.context_length, 1, _MAX_CONTEXT),
    }
    for name, (value, least, most) in bounds.items():
        if not least <= value <= most:
            raise ModelCardError(f"config.json gives {value} {name}; a model has {least}..{most}")


def _shape(config: Mapping[str, Any]) -> _Shape:
    """The model type is the top-level one, which mlx-lm loads the model by (a
    vision-language config's `text_config` has a type of its own)."""
    text = _text_config(config)
    architecture = str(config.get("model_type") or text.get("model_type", "unknown"))
    hidden = _first_int(text, "hidden_size", "n_embd", "d_model")
    if architecture in ATTENTION_FREE:
        n_heads = n_kv_heads = head_dim = 0
    else:
        n_heads = _first_int(text, "num_attention_heads", "n_head", "n_heads", "num_heads")
        n_kv_heads = _first_int(
            text, "num_key_value_heads", "n_kv_heads", "num_kv_heads", default=n_heads
        )
        head_dim = _first_int(text, "head_dim", default=hidden // max(1, n_heads))
    pattern = nemotron_pattern(text)  # nemotron_h may give its layers as a pattern only
    shape = _Shape(
        architecture=architecture,
        n_layers=_first_int(
            text,
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "n_layers",
            default=len(pattern) or None,
        ),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        context_length=context_length_from_config(config),
        vocab_size=_first_int(text, "vocab_size"),
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        intermediate_size=_optional_int(text, *DENSE_SIZE_KEYS),
        moe_intermediate_size=_optional_int(text, "moe_intermediate_size"),
    )
    _check_bounds(shape)
    return shape


def _layers(config: Mapping[str, Any]) -> Sequence[Layer]:
    """Each layer's parameters and cache, by the family's rules (`exo.models.layer_estimates`)."""
    shape = _shape(config)
    dims = Dims(
        n_layers=shape.n_layers,
        hidden=shape.hidden_size,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim,
    )
    layers = estimate_layers(config, _text_config(config), dims)
    if len(layers) != shape.n_layers:
        raise ModelCardError(f"config.json describes {len(layers)} layers but has {shape.n_layers}")
    return layers


def _config_dtype_bytes(config: Mapping[str, Any]) -> int | None:
    text = _text_config(config)
    name = text.get("torch_dtype") or text.get("dtype")
    return _TORCH_DTYPE_BYTES.get(name) if isinstance(name, str) else None


# --- parameters and bytes ----------------------------------------------------


def _weight_map(index: Mapping[str, Any]) -> dict[str, str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelCardError("safetensors index has no weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def _quantized_params(
    name: str, info: TensorInfo, tensors: Mapping[str, TensorInfo], config: Mapping[str, Any]
) -> int | None:
    """Elements of a quantized weight once dequantized, or None if `name` is not one.

    A quantized weight is packed (uint32) with a `scales` sibling holding one
    value per group: rows x groups x group_size elements.
    """
    module, _, part = name.rpartition(".")
    scales = tensors.get(f"{module}.scales")
    if part != "weight" or scales is None or info.dtype in FLOAT_DTYPES or not scales.shape:
        return None
    group_size = _module_group_size(config, module)
    if group_size is None:
        # Packed weight without a quantization config: assume 4 bits.
        return math.prod(info.shape) * 32 // 4
    return math.prod(scales.shape) * group_size


def _is_quantization_parameter(name: str, tensors: Mapping[str, TensorInfo]) -> bool:
    """`scales` / `biases` of a quantized weight vanish when it is dequantized."""
    module, _, part = name.rpartition(".")
    if part not in ("scales", "biases"):
        return False
    weight = tensors.get(f"{module}.weight")
    return weight is not None and weight.dtype not in FLOAT_DTYPES


# --- cards --------------------------------------------------------------------


def _read_json_object(model_id: ModelId, path: Path) -> dict[str, Any]:
    """A small JSON object of a model folder (config, index); a `ModelCardError`
    when it cannot be read, is too large for one, or is not a JSON object."""
    try:
        if path.stat().st_size > MAX_METADATA_BYTES:
            raise ModelCardError(f"{model_id}: {path.name} is over {MAX_METADATA_BYTES} bytes")
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        raise ModelCardError(f"{model_id}: cannot read {path.name}: {error}") from error
    if not isinstance(data, dict):
        raise ModelCardError(f"{model_id}: {path.name} is not a JSON object")
    return cast(dict[str, Any], data)


def card_from_folder(model_id: ModelId, path: Path) -> ModelCard:
    """A card with exact sizes from an MLX model folder: `config.json` plus either
    `model.safetensors.index.json` (several shards) or `*.safetensors` files.

    Reads only the safetensors headers. `files` lists the weight files, then the
    folder's other files a node needs (config, tokenizer, generation config,
    index), without exo's import marker or weights in other formats.
    """
    config = _read_json_object(model_id, path / CONFIG_FILE)
    shape = _shape(config)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = _read_json_object(model_id, index_path)
        weight_names = sorted(set(_weight_map(index).values()))
    else:
        weight_names = sorted(p.name for p in path.glob("*.safetensors"))
    if not weight_names:
        raise ModelCardError(f"{model_id}: no safetensors weights in the model folder")
    missing = [name for name in weight_names if not (path / name).is_file()]
    if missing:
        raise ModelCardError(f"{model_id}: weight files missing: {', '.join(missing)}")

    layer_bytes = [0] * shape.n_layers
    layer_params = [0] * shape.n_layers
    stored = {"embedding": 0, "head": 0, "unused": 0}
    params = {"embedding": 0, "head": 0, "unused": 0}
    float_bytes: dict[str, int] = {}
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for file in weight_names:
        try:
            tensors = read_safetensors_header(path / file)
        except SafetensorsHeaderError as error:
            raise ModelCardError(f"{model_id}: {error}") from error
        sizes[file] = (path / file).stat().st_size
        for name, info in tensors.items():
            weight_map[name] = file
            count = _quantized_params(name, info, tensors, config)
            if count is None:
                count = 0 if _is_quantization_parameter(name, tensors) else math.prod(info.shape)
            if info.dtype in FLOAT_DTYPES:
                float_bytes[info.dtype] = float_bytes.get(info.dtype, 0) + info.nbytes
            part = tensor_part(name, shape.n_layers)
            if isinstance(part, int):
                layer_bytes[part] += info.nbytes
                layer_params[part] += count
            else:
                stored[part] += info.nbytes
                params[part] += count

    dtype_bytes = _config_dtype_bytes(config)
    if dtype_bytes is None:
        dominant = max(float_bytes, key=lambda d: float_bytes[d], default="F16")
        dtype_bytes = DTYPE_BYTES[dominant]
    weight_files = weight_files_from_map(weight_map, shape.n_layers, sizes)
    others = sorted(p.name for p in path.iterdir() if p.is_file() and is_metadata_file(p.name))
    return ModelCard(
        model_id=model_id,
        **shape.model_dump(),
        files=(*weight_names, *others),
        weight_files=weight_files,
        total_bytes=sum(layer_bytes) + sum(stored.values()),
        layer_bytes=-(-sum(layer_bytes) // shape.n_layers),
        embedding_bytes=stored["embedding"],
        head_bytes=stored["head"],
        layer_params=-(-sum(layer_params) // shape.n_layers),
        embedding_params=params["embedding"],
        head_params=params["head"],
        quantization=default_quantization(config),
        dtype_bytes=dtype_bytes,
        size_source="safetensors_headers",
        per_layer_bytes=tuple(layer_bytes),
        per_layer_params=tuple(layer_params),
        layer_caches=tuple(layer.cache for layer in _layers(config)),
    )


def estimate_params(config: Mapping[str, Any]) -> tuple[tuple[int, ...], int, int]:
    """(each layer's, embedding, head) parameter counts from a config: the layers
    as the family's mlx-lm model builds them (`exo.models.layer_estimates`: dense
    and MoE layers, attention and recurrent mixers); the token embedding; the
    final norm plus the output head unless tied. Small parts some families add
    (biases, norms) outside the modelled families are not counted."""
    shape = _shape(config)
    hidden = shape.hidden_size
    layers = tuple(layer.params for layer in _layers(config))
    embedding = shape.vocab_size * hidden
    head = hidden + (0 if shape.tie_word_embeddings else shape.vocab_size * hidden)
    return layers, embedding, head


def _stored_bytes_per_param(quantization: Quantization | None, dtype_bytes: int) -> float:
    """Packed bits plus one scale and one bias (in the model's dtype) per group."""
    if quantization is None:
        return float(dtype_bytes)
    return quantization.bits / 8 + 2 * dtype_bytes / quantization.group_size


def card_from_config(
    model_id: ModelId,
    config: Mapping[str, Any],
    index: Mapping[str, Any] | None = None,
    *,
    file_sizes: Mapping[str, int] | None = None,
    metadata_files: Iterable[str] = DEFAULT_METADATA_FILES,
) -> ModelCard:
    """A card for a model whose weights are not here: a Hugging Face repo's
    `config.json` and, when the repo has one, its `model.safetensors.index.json`.

    Sizes are estimates. Parameter counts come from the config (`estimate_params`).
    Stored bytes are the index's `metadata.total_size` (exact total) split between
    the layers, embedding and head in proportion to their parameter counts; without
    it, the sum of `file_sizes` of the weight files; without those, the parameter
    counts times the bytes per parameter the quantization (or dtype) implies.
    Which file holds which layer comes from the index's `weight_map`; without an
    index the weights are one `model.safetensors`.
    """
    shape = _shape(config)
    sizes = dict(file_sizes or {})
    layer_params, embedding_params, head_params = estimate_params(config)
    quantization = default_quantization(config)
    dtype_bytes = _config_dtype_bytes(config) or _FLOAT16_BYTES
    all_params = sum(layer_params) + embedding_params + head_params

    if index is not None:
        weight_map = _weight_map(index)
        weight_files = weight_files_from_map(weight_map, shape.n_layers, sizes)
    else:
        weight_files = (
            WeightFile(
                name=SINGLE_WEIGHTS_FILE,
                layers=tuple(range(shape.n_layers)),
                embedding=True,
                head=True,
                size_bytes=sizes.get(SINGLE_WEIGHTS_FILE),
            ),
        )
    metadata = index.get("metadata") if index is not None else None
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    file_total = [f.size_bytes for f in weight_files]
    source: SizeSource
    if isinstance(total_size, int | float) and total_size > 0:
        total, source = int(total_size), "index_total_size"
    elif all(size is not None for size in file_total):
        # File sizes include the small safetensors headers: close enough.
        total, source = sum(s for s in file_total if s is not None), "file_sizes"
    else:
        bytes_per_param = _stored_bytes_per_param(quantization, dtype_bytes)
        total, source = math.ceil(all_params * bytes_per_param), "config_estimate"

    def share(params: int) -> int:
        return math.ceil(total * params / all_params)

    embedding_bytes, head_bytes = share(embedding_params), share(head_params)
    layers_total = max(0, total - embedding_bytes - head_bytes)
    weight_names = tuple(f.name for f in weight_files)
    extra = [*([INDEX_FILE] if index is not None else []), *metadata_files]
    others = tuple(sorted({name for name in extra if name not in weight_names}))
    return ModelCard(
        model_id=model_id,
        **shape.model_dump(),
        files=(*weight_names, *others),
        weight_files=weight_files,
        total_bytes=total,
        layer_bytes=-(-layers_total // shape.n_layers),
        embedding_bytes=embedding_bytes,
        head_bytes=head_bytes,
        layer_params=-(-sum(layer_params) // shape.n_layers),
        embedding_params=embedding_params,
        head_params=head_params,
        quantization=quantization,
        dtype_bytes=dtype_bytes,
        size_source=source,
        per_layer_bytes=_split_by_params(layers_total, layer_params),
        per_layer_params=layer_params,
        layer_caches=tuple(layer.cache for layer in _layers(config)),
    )


def _split_by_params(total: int, params: Sequence[int]) -> tuple[int, ...]:
    """`total` bytes split between layers in proportion to their parameters,
    summing to `total` exactly (equally when no layer has parameters)."""
    weights = list(params) if sum(params) > 0 else [1] * len(params)
    whole = sum(weights)
    bounds = [-(-total * done // whole) for done in itertools.accumulate(weights, initial=0)]
    return tuple(b - a for a, b in itertools.pairwise(bounds))
