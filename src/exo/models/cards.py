"""Model cards: what placement and downloads need to know about a model.

A card is built from an MLX model folder (`card_from_folder`: exact sizes from
the safetensors headers, no weights read) or from a Hugging Face repo's
`config.json` and `model.safetensors.index.json` without the weight files
(`card_from_config`: sizes estimated, see there). Memory on a node depends on
its MLX backend: the CPU runner dequantizes quantized weights and casts every
weight to float32 at load (`exo.engine.mlx.load`), Metal and CUDA keep the
weights as stored.
"""

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import (
    ModelCard,
    Quantization,
    SizeSource,
    WeightFile,
)
from exo.shared.types.state import MlxBackend

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
# What a node fetches besides the weights when the repo's listing is unknown.
DEFAULT_METADATA_FILES = (CONFIG_FILE, "tokenizer.json", "tokenizer_config.json")
# Files of a model folder that a node never needs: exo's import marker and
# weights in other formats than safetensors.
_NOT_NEEDED_NAMES = {"exo_import.json"}
_NOT_NEEDED_SUFFIXES = (".gguf", ".bin", ".pt", ".pth", ".h5", ".onnx", ".msgpack", ".partial")
_MAX_HEADER_BYTES = 100_000_000
_DEFAULT_CONTEXT = 4096

# `model.layers.N.` and the prefixes vision-language and SSM models put before it.
_LAYER_TENSOR = re.compile(
    r"^(?:model\.|language_model\.model\.|model\.language_model\.|backbone\.)?layers\.(\d+)\."
)
# Non-layer tensors used after the last layer: final norm and output head.
_HEAD_TENSOR = re.compile(r"(?:^|\.)(?:norm|norm_f|final_layernorm|ln_f|lm_head|output)(?:\.|$)")
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_FLOAT32_BYTES = 4
_FLOAT16_BYTES = 2


class ModelCardError(ValueError):
    """A model folder or config cannot be described (missing or malformed files)."""


# --- memory -------------------------------------------------------------------


def _loaded_bytes(stored_bytes: int, params: int, backend: MlxBackend) -> int:
    return params * _FLOAT32_BYTES if backend == "cpu" else stored_bytes


def memory_per_layer(card: ModelCard, backend: MlxBackend) -> int:
    """Bytes one layer takes in RAM once loaded on `backend` (weights only)."""
    return _loaded_bytes(card.layer_bytes, card.layer_params, backend)


def memory_other(
    card: ModelCard, backend: MlxBackend, *, first: bool = True, last: bool = True
) -> int:
    """Bytes of the non-layer weights a rank holds once loaded on `backend`.

    The first rank holds the embedding, the last the final norm and head; with
    tied embeddings the head is the embedding, so a last rank that is not also
    the first holds the embedding too. The defaults describe a single rank.
    """
    total = 0
    if first or (last and card.tie_word_embeddings):
        total += _loaded_bytes(card.embedding_bytes, card.embedding_params, backend)
    if last:
        total += _loaded_bytes(card.head_bytes, card.head_params, backend)
    return total


def kv_bytes_per_token(card: ModelCard, backend: MlxBackend) -> int:
    """KV cache bytes per token over all layers: keys and values of every KV head,
    float32 on the CPU backend, float16 otherwise."""
    dtype = _FLOAT32_BYTES if backend == "cpu" else _FLOAT16_BYTES
    return 2 * card.n_kv_heads * card.head_dim * card.n_layers * dtype


# --- which files hold which layers --------------------------------------------


def layer_files(card_or_index: ModelCard | Mapping[str, Any], start: int, end: int) -> set[str]:
    """The weight files holding layers [start, end), plus the embedding's files on
    the first rank and the norm/head's files on the last (the embedding's too when
    the head is tied to it).

    Takes a card, or a `model.safetensors.index.json` dict; for an index the layer
    count is the highest layer index in its `weight_map` plus one, and embeddings
    count as tied when the map has no `lm_head` tensor.
    """
    if isinstance(card_or_index, ModelCard):
        files, n_layers, tied = (
            card_or_index.weight_files,
            card_or_index.n_layers,
            card_or_index.tie_word_embeddings,
        )
    else:
        weight_map = _weight_map(card_or_index)
        layers = [_layer_index(name) for name in weight_map]
        n_layers = max((i for i in layers if i is not None), default=-1) + 1
        files = _weight_files_from_map(weight_map, n_layers, {})
        tied = not any(name.startswith("lm_head") for name in weight_map)
    if not 0 <= start < end <= n_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within [0, {n_layers})")
    first, last = start == 0, end == n_layers
    return {
        f.name
        for f in files
        if any(start <= i < end for i in f.layers)
        or (f.embedding and (first or (last and tied)))
        or (f.head and last)
    }


def shard_files(card: ModelCard, start: int, end: int) -> set[str]:
    """Every file a node serving layers [start, end) needs: its weight files plus
    the config/tokenizer files."""
    return layer_files(card, start, end) | set(card.metadata_files)


# --- safetensors headers ------------------------------------------------------


class TensorInfo(FrozenModel):
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and data sizes of a safetensors file, from its
    header only (8-byte little-endian length, then JSON); no tensor data is read."""
    try:
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise ModelCardError(f"{path.name}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES:
                raise ModelCardError(f"{path.name}: header of {length} bytes is not plausible")
            raw = fh.read(length)
    except OSError as error:
        raise ModelCardError(f"cannot read {path.name}: {error}") from error
    try:
        header = json.loads(raw)
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            tensors[name] = TensorInfo(
                dtype=entry["dtype"], shape=tuple(entry["shape"]), nbytes=stop - begin
            )
    except (ValueError, KeyError, TypeError) as error:
        raise ModelCardError(f"{path.name}: malformed safetensors header: {error}") from error
    return tensors


# --- config -------------------------------------------------------------------


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Vision-language configs nest the language model's settings in `text_config`."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else dict(config)


def _first_int(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ModelCardError(f"config.json lacks {' / '.join(keys)}")
    return default


def _quantization_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    for key in ("quantization", "quantization_config"):
        value = config.get(key)
        if isinstance(value, dict) and "bits" in value and "group_size" in value:
            return value
    return None


def _default_quantization(config: Mapping[str, Any]) -> Quantization | None:
    quant = _quantization_config(config)
    if quant is None:
        return None
    return Quantization(bits=int(quant["bits"]), group_size=int(quant["group_size"]))


def _module_group_size(config: Mapping[str, Any], module: str) -> int | None:
    quant = _quantization_config(config)
    if quant is None:
        return None
    override = quant.get(module)
    if isinstance(override, dict) and "group_size" in override:
        return int(override["group_size"])
    return int(quant["group_size"])


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


def _shape(config: Mapping[str, Any]) -> _Shape:
    text = _text_config(config)
    hidden = _first_int(text, "hidden_size", "n_embd", "d_model")
    n_heads = _first_int(text, "num_attention_heads", "n_head", "n_heads")
    return _Shape(
        architecture=str(text.get("model_type", "unknown")),
        n_layers=_first_int(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=_first_int(text, "num_key_value_heads", "n_kv_heads", default=n_heads),
        head_dim=_first_int(text, "head_dim", default=hidden // n_heads),
        context_length=_first_int(
            text, "max_position_embeddings", "max_seq_len", default=_DEFAULT_CONTEXT
        ),
        vocab_size=_first_int(text, "vocab_size"),
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
    )


def _config_dtype_bytes(config: Mapping[str, Any]) -> int | None:
    text = _text_config(config)
    name = text.get("torch_dtype") or text.get("dtype")
    return _TORCH_DTYPE_BYTES.get(name) if isinstance(name, str) else None


# --- tensor classification ----------------------------------------------------


def _layer_index(name: str) -> int | None:
    match = _LAYER_TENSOR.match(name)
    return int(match.group(1)) if match else None


def _part(name: str, n_layers: int) -> int | Literal["embedding", "head", "unused"]:
    """Layer index, or the non-layer part a tensor belongs to. Layers past
    `n_layers` (e.g. multi-token-prediction layers) are not loaded: "unused"."""
    layer = _layer_index(name)
    if layer is not None:
        return layer if layer < n_layers else "unused"
    if "embed" not in name and _HEAD_TENSOR.search(name):
        return "head"
    return "embedding"


def _weight_map(index: Mapping[str, Any]) -> dict[str, str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelCardError("safetensors index has no weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def _weight_files_from_map(
    weight_map: Mapping[str, str], n_layers: int, sizes: Mapping[str, int]
) -> tuple[WeightFile, ...]:
    layers: dict[str, set[int]] = {}
    embedding: set[str] = set()
    head: set[str] = set()
    for tensor, file in weight_map.items():
        layers.setdefault(file, set())
        part = _part(tensor, n_layers)
        if isinstance(part, int):
            layers[file].add(part)
        elif part == "embedding":
            embedding.add(file)
        elif part == "head":
            head.add(file)
    return tuple(
        WeightFile(
            name=file,
            layers=tuple(sorted(layers[file])),
            embedding=file in embedding,
            head=file in head,
            size_bytes=sizes.get(file),
        )
        for file in sorted(layers)
    )


def _quantized_params(
    name: str, info: TensorInfo, tensors: Mapping[str, TensorInfo], config: Mapping[str, Any]
) -> int | None:
    """Elements of a quantized weight once dequantized, or None if `name` is not one.

    A quantized weight is packed (uint32) with a `scales` sibling holding one
    value per group: rows x groups x group_size elements.
    """
    module, _, part = name.rpartition(".")
    scales = tensors.get(f"{module}.scales")
    if part != "weight" or scales is None or info.dtype in _FLOAT_DTYPES or not scales.shape:
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
    return weight is not None and weight.dtype not in _FLOAT_DTYPES


def is_metadata_file(name: str) -> bool:
    """A file a node needs besides the weights (config, tokenizer, index, ...)."""
    return (
        not name.startswith(".")
        and name not in _NOT_NEEDED_NAMES
        and not name.endswith(".safetensors")
        and not name.endswith(_NOT_NEEDED_SUFFIXES)
    )


# --- cards --------------------------------------------------------------------


def card_from_folder(model_id: ModelId, path: Path) -> ModelCard:
    """A card with exact sizes from an MLX model folder: `config.json` plus either
    `model.safetensors.index.json` (several shards) or `*.safetensors` files.

    Reads only the safetensors headers. `files` lists the weight files, then the
    folder's other files a node needs (config, tokenizer, generation config,
    index), without exo's import marker or weights in other formats.
    """
    try:
        config: dict[str, Any] = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ModelCardError(f"{model_id}: cannot read {CONFIG_FILE}: {error}") from error
    shape = _shape(config)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as error:
            raise ModelCardError(f"{model_id}: cannot read {INDEX_FILE}: {error}") from error
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
        tensors = read_safetensors_header(path / file)
        sizes[file] = (path / file).stat().st_size
        for name, info in tensors.items():
            weight_map[name] = file
            count = _quantized_params(name, info, tensors, config)
            if count is None:
                count = 0 if _is_quantization_parameter(name, tensors) else math.prod(info.shape)
            if info.dtype in _FLOAT_DTYPES:
                float_bytes[info.dtype] = float_bytes.get(info.dtype, 0) + info.nbytes
            part = _part(name, shape.n_layers)
            if isinstance(part, int):
                layer_bytes[part] += info.nbytes
                layer_params[part] += count
            else:
                stored[part] += info.nbytes
                params[part] += count

    dtype_bytes = _config_dtype_bytes(config)
    if dtype_bytes is None:
        dominant = max(float_bytes, key=lambda d: float_bytes[d], default="F16")
        dtype_bytes = _DTYPE_BYTES[dominant]
    weight_files = _weight_files_from_map(weight_map, shape.n_layers, sizes)
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
        quantization=_default_quantization(config),
        dtype_bytes=dtype_bytes,
        size_source="safetensors_headers",
    )


def estimate_params(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(per-layer, embedding, head) parameter counts of a llama-family decoder
    from its config: attention (q, k, v, o), a gated MLP (dense, or routed and
    shared experts with a router for MoE configs) and two norms per layer; the
    token embedding; the final norm plus the output head unless tied.

    An estimate: biases, and attention variants (MLA, linear attention, SSM)
    that other architectures use, are not modelled.
    """
    shape = _shape(config)
    text = _text_config(config)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    attention = 2 * hidden * shape.n_heads * head_dim + 2 * hidden * shape.n_kv_heads * head_dim
    n_experts = _first_int(text, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if n_experts:
        expert_size = _first_int(
            text, "moe_intermediate_size", "intermediate_size", "ffn_hidden_size"
        )
        n_shared = _first_int(text, "n_shared_experts", "num_shared_experts", default=0)
        shared_size = _first_int(text, "shared_expert_intermediate_size", default=0) or (
            n_shared * expert_size
        )
        mlp = 3 * hidden * (n_experts * expert_size + shared_size) + hidden * n_experts
    else:
        mlp = 3 * hidden * _first_int(text, "intermediate_size", "ffn_hidden_size", "n_inner")
    embedding = shape.vocab_size * hidden
    head = hidden + (0 if shape.tie_word_embeddings else shape.vocab_size * hidden)
    return attention + mlp + 2 * hidden, embedding, head


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
    layers, embedding and head in proportion to their parameter counts; without
    it, the sum of `file_sizes` of the weight files; without those, the parameter
    counts times the bytes per parameter the quantization (or dtype) implies.
    Which file holds which layer comes from the index's `weight_map`; without an
    index the weights are one `model.safetensors`.
    """
    shape = _shape(config)
    sizes = dict(file_sizes or {})
    layer_params, embedding_params, head_params = estimate_params(config)
    quantization = _default_quantization(config)
    dtype_bytes = _config_dtype_bytes(config) or _FLOAT16_BYTES
    all_params = layer_params * shape.n_layers + embedding_params + head_params

    if index is not None:
        weight_map = _weight_map(index)
        weight_files = _weight_files_from_map(weight_map, shape.n_layers, sizes)
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
    layer_bytes = max(0, math.ceil((total - embedding_bytes - head_bytes) / shape.n_layers))
    weight_names = tuple(f.name for f in weight_files)
    extra = [*([INDEX_FILE] if index is not None else []), *metadata_files]
    others = tuple(sorted({name for name in extra if name not in weight_names}))
    return ModelCard(
        model_id=model_id,
        **shape.model_dump(),
        files=(*weight_names, *others),
        weight_files=weight_files,
        total_bytes=total,
        layer_bytes=layer_bytes,
        embedding_bytes=embedding_bytes,
        head_bytes=head_bytes,
        layer_params=layer_params,
        embedding_params=embedding_params,
        head_params=head_params,
        quantization=quantization,
        dtype_bytes=dtype_bytes,
        size_source=source,
    )


# Cards of models known without their files. Left empty on purpose: exact byte
# counts and file lists of hub models cannot be checked offline, and a wrong
# card would misplace layers or fetch the wrong files. The default model's card
# comes from its imported folder (`card_from_folder`); hub models get theirs
# from the repo's config and index (`card_from_config`).
BUILTIN_CARDS: dict[ModelId, ModelCard] = {}
