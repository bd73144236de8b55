"""Which weight files hold which parts of a model, and which files a node
serving a range of layers needs."""

from collections.abc import Mapping

from exo.shared.tensor_names import tensor_part
from exo.shared.types.model_card import ModelCard, WeightFile

# Files of a model folder that a node never needs: exo's import marker and
# weights in other formats than safetensors.
_NOT_NEEDED_NAMES = {"exo_import.json"}
_NOT_NEEDED_SUFFIXES = (".gguf", ".bin", ".pt", ".pth", ".h5", ".onnx", ".msgpack", ".partial")


def weight_files_from_map(
    weight_map: Mapping[str, str], n_layers: int, sizes: Mapping[str, int]
) -> tuple[WeightFile, ...]:
    """The weight files of a tensor -> file map, each with the parts it holds."""
    layers: dict[str, set[int]] = {}
    embedding: set[str] = set()
    head: set[str] = set()
    for tensor, file in weight_map.items():
        layers.setdefault(file, set())
        part = tensor_part(tensor, n_layers)
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


def layer_files(card: ModelCard, start: int, end: int) -> set[str]:
    """The weight files holding layers [start, end), plus the embedding's files on
    the first rank and the norm/head's files on the last (the embedding's too when
    the head is tied to it)."""
    if not 0 <= start < end <= card.n_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within [0, {card.n_layers})")
    first, last = start == 0, end == card.n_layers
    return {
        f.name
        for f in card.weight_files
        if any(start <= i < end for i in f.layers)
        or (f.embedding and (first or (last and card.tie_word_embeddings)))
        or (f.head and last)
    }


def shard_files(card: ModelCard, start: int, end: int) -> set[str]:
    """Every file a node serving layers [start, end) needs: its weight files plus
    the config/tokenizer files."""
    return layer_files(card, start, end) | set(card.metadata_files)


def is_metadata_file(name: str) -> bool:
    """A file a node needs besides the weights (config, tokenizer, index, ...)."""
    return (
        not name.startswith(".")
        and name not in _NOT_NEEDED_NAMES
        and not name.endswith(".safetensors")
        and not name.endswith(_NOT_NEEDED_SUFFIXES)
    )
