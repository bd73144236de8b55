import json
import re
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.load import load_for_inference
from exo.models.cards import (
    ModelCardError,
    card_from_config,
    card_from_folder,
    estimate_params,
)
from exo.models.memory import kv_bytes_per_token, layer_weights, memory_other
from exo.models.safetensors_header import SafetensorsHeaderError, read_safetensors_header
from exo.models.store import context_length
from exo.models.weight_files import layer_files, shard_files
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard, Quantization

# SmolLM2-135M: attention q/o 576x576, k/v 192x576; MLP 3 x 576x1536; 2 norms.
SMOL_LAYER_PARAMS = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576
# 4-bit, group 32, fp16 scales and biases: packed weights + 2 x 2 bytes per 32.
# float32 norms stay as they are.
SMOL_LAYER_BYTES = (SMOL_LAYER_PARAMS - 2 * 576) * 5 // 8 + 2 * 576 * 4


def test_smollm_card_shape(smollm_dir: Path) -> None:
    card = card_from_folder(ModelId("SmolLM2-135M-Instruct"), smollm_dir)
    assert (
        card.architecture,
        card.n_layers,
        card.hidden_size,
        card.n_heads,
        card.n_kv_heads,
        card.head_dim,
        card.context_length,
        card.vocab_size,
        card.tie_word_embeddings,
    ) == ("llama", 30, 576, 9, 3, 64, 8192, 49152, True)
    assert card.quantization == Quantization(bits=4, group_size=32)
    assert card.dtype_bytes == 2  # fp16 scales and biases
    assert card.size_source == "safetensors_headers"
    assert card.files == (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )
    assert card.metadata_files == card.files[1:]


def test_smollm_card_bytes_add_up_to_the_safetensors_data(smollm_dir: Path) -> None:
    card = card_from_folder(ModelId("SmolLM2-135M-Instruct"), smollm_dir)
    weights = smollm_dir / "model.safetensors"
    with weights.open("rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
    data_bytes = weights.stat().st_size - 8 - header_len
    assert card.total_bytes == data_bytes
    # Every layer has the same tensors, so the average is exact.
    assert card.layer_bytes * card.n_layers + card.other_bytes == card.total_bytes
    assert card.layer_params == SMOL_LAYER_PARAMS
    assert card.layer_bytes == SMOL_LAYER_BYTES
    assert card.embedding_params == 49152 * 576  # 8-bit embedding, dequantized
    assert card.head_params == 576  # final norm; the head is tied to the embedding
    assert card.weight_files[0].size_bytes == weights.stat().st_size


def test_smollm_memory_by_backend(smollm_dir: Path) -> None:
    card = card_from_folder(ModelId("SmolLM2-135M-Instruct"), smollm_dir)
    assert layer_weights(card, "metal") == layer_weights(card, "cuda") == (SMOL_LAYER_BYTES,) * 30
    assert layer_weights(card, "cpu") == (SMOL_LAYER_PARAMS * 4,) * 30
    assert memory_other(card, "cpu") == (49152 * 576 + 576) * 4
    assert memory_other(card, "metal") == card.other_bytes
    assert kv_bytes_per_token(card, "cpu") == 2 * 3 * 64 * 30 * 4
    assert kv_bytes_per_token(card, "metal") == 2 * 3 * 64 * 30 * 2


def test_cpu_estimate_matches_the_loaded_model(smollm_dir: Path) -> None:
    """The CPU runner dequantizes to float32: the card predicts its bytes exactly."""
    if backend_name() != "cpu":  # pragma: no cover - Metal/CUDA keep weights packed
        pytest.skip("CPU backend only")
    card = card_from_folder(ModelId("SmolLM2-135M-Instruct"), smollm_dir)
    model, _ = load_for_inference(smollm_dir)
    arrays = [v for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)]
    loaded = sum(a.nbytes for a in arrays)
    predicted = sum(layer_weights(card, "cpu")) + memory_other(card, "cpu")
    assert loaded == predicted


def synthetic_card(**overrides: Any) -> ModelCard:
    fields: dict[str, Any] = {
        "model_id": ModelId("m"),
        "architecture": "llama",
        "n_layers": 4,
        "hidden_size": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "context_length": 2048,
        "vocab_size": 100,
        "tie_word_embeddings": False,
        "files": ("model.safetensors", "config.json"),
        "weight_files": (),
        "total_bytes": 4 * 640 + 2 * 640,
        "layer_bytes": 640,  # 1024 params, 4-bit, group 32: 512 packed + 128 scales/biases
        "embedding_bytes": 640,
        "head_bytes": 640,
        "layer_params": 1024,
        "embedding_params": 1024,
        "head_params": 1024,
        "quantization": Quantization(bits=4, group_size=32),
        "dtype_bytes": 2,
        "size_source": "config_estimate",
    }
    return ModelCard(**(fields | overrides))


@pytest.mark.parametrize(
    ("backend", "per_layer"),
    [
        ("metal", 640),
        ("cuda", 640),
        # float32: 4 bytes per parameter, 8x the 0.5 byte of a packed 4-bit weight
        # (6.4x the stored bytes once the fp16 scales and biases are counted).
        ("cpu", 1024 * 4),
    ],
)
def test_memory_per_layer_by_backend(backend: Any, per_layer: int) -> None:
    card = synthetic_card()
    assert layer_weights(card, backend) == (per_layer,) * 4
    packed_weight_bytes = card.layer_params * 4 // 8
    assert layer_weights(card, "cpu")[0] == 8 * packed_weight_bytes


@pytest.mark.parametrize(
    ("tied", "first", "last", "expected"),
    [
        (False, True, True, 640 + 640),
        (False, True, False, 640),
        (False, False, True, 640),
        (False, False, False, 0),
        # A tied head is the embedding: the last rank holds it too.
        (True, False, True, 640 + 640),
        (True, True, True, 640 + 640),
        (True, True, False, 640),
    ],
)
def test_memory_other_by_rank(tied: bool, first: bool, last: bool, expected: int) -> None:
    card = synthetic_card(tie_word_embeddings=tied)
    assert memory_other(card, "metal", first=first, last=last) == expected


# A 4-layer model in three shards; layer 2 spans shards 2 and 3.
SHARDS = {
    "model-00001-of-00003.safetensors": [
        "model.embed_tokens.weight",
        *[f"model.layers.{i}.{t}" for i in (0, 1) for t in ("attn.weight", "mlp.weight")],
    ],
    "model-00002-of-00003.safetensors": ["model.layers.2.attn.weight"],
    "model-00003-of-00003.safetensors": [
        "model.layers.2.mlp.weight",
        "model.layers.3.attn.weight",
        "model.layers.3.mlp.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
}
TENSOR_SHAPES = {
    "embed_tokens": (10, 8),
    "attn": (8, 8),
    "mlp": (16, 8),
    "norm": (8,),
    "lm_head": (10, 8),
}


def _shape_of(name: str) -> tuple[int, ...]:
    return next(shape for key, shape in TENSOR_SHAPES.items() if f".{key}." in f".{name}")


SHARDED_CONFIG = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 4,
    "intermediate_size": 16,
    "max_position_embeddings": 512,
    "vocab_size": 10,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


@pytest.fixture
def sharded_dir(tmp_path: Path) -> Path:
    weight_map: dict[str, str] = {}
    for file, names in SHARDS.items():
        tensors = {name: mx.zeros(_shape_of(name), dtype=mx.float16) for name in names}
        mx.save_safetensors(str(tmp_path / file), tensors)
        weight_map |= dict.fromkeys(names, file)
    (tmp_path / "config.json").write_text(json.dumps(SHARDED_CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "exo_import.json").write_text("{}")  # not a file a node needs
    return tmp_path


def test_sharded_card_sizes(sharded_dir: Path) -> None:
    card = card_from_folder(ModelId("org/sharded"), sharded_dir)
    layer = (8 * 8 + 16 * 8) * 2  # fp16 attn + mlp
    assert card.layer_bytes == layer
    assert card.layer_params == 8 * 8 + 16 * 8
    assert card.embedding_bytes == 10 * 8 * 2
    assert card.head_bytes == (8 + 10 * 8) * 2
    assert card.total_bytes == 4 * layer + card.other_bytes
    assert card.dtype_bytes == 2
    assert card.files == (
        *SHARDS,
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
    )
    # Unquantized fp16 on the CPU becomes float32: twice the bytes.
    assert layer_weights(card, "cpu") == tuple(2 * w for w in layer_weights(card, "metal"))


S1, S2, S3 = SHARDS


@pytest.mark.parametrize(
    ("start", "end", "files"),
    [
        (0, 4, {S1, S2, S3}),
        (0, 1, {S1}),
        (0, 2, {S1}),
        (1, 2, {S1}),
        (2, 3, {S2, S3}),
        (2, 4, {S2, S3}),
        (1, 3, {S1, S2, S3}),
        (3, 4, {S3}),
    ],
)
def test_layer_files_picks_only_the_needed_shards(
    sharded_dir: Path, start: int, end: int, files: set[str]
) -> None:
    card = card_from_folder(ModelId("org/sharded"), sharded_dir)
    assert layer_files(card, start, end) == files
    assert shard_files(card, start, end) == files | {
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
    }


def test_layer_files_with_a_tied_head_gives_the_last_rank_the_embedding() -> None:
    weight_map = {
        name: file for file, names in SHARDS.items() for name in names if name != "lm_head.weight"
    }
    tied = SHARDED_CONFIG | {"tie_word_embeddings": True}
    card = card_from_config(ModelId("org/tied"), tied, {"weight_map": weight_map})
    assert layer_files(card, 3, 4) == {S1, S3}
    assert layer_files(card, 1, 3) == {S1, S2, S3}
    assert layer_files(card, 1, 2) == {S1}


def test_layer_files_single_file_and_bad_ranges(smollm_dir: Path) -> None:
    card = card_from_folder(ModelId("SmolLM2-135M-Instruct"), smollm_dir)
    assert layer_files(card, 10, 20) == {"model.safetensors"}
    for start, end in [(0, 0), (-1, 3), (5, 31), (4, 2)]:
        with pytest.raises(ValueError, match="layer range"):
            layer_files(card, start, end)


def test_missing_shard_and_missing_config_are_clear_errors(sharded_dir: Path) -> None:
    (sharded_dir / S2).unlink()
    with pytest.raises(ModelCardError, match=re.escape(f"weight files missing: {S2}")):
        card_from_folder(ModelId("org/sharded"), sharded_dir)
    (sharded_dir / "config.json").unlink()
    with pytest.raises(ModelCardError, match=r"config\.json"):
        card_from_folder(ModelId("org/sharded"), sharded_dir)


def test_read_safetensors_header_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"nope!")
    with pytest.raises(SafetensorsHeaderError, match="malformed"):
        read_safetensors_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(SafetensorsHeaderError, match="too short"):
        read_safetensors_header(path)


def test_a_folder_with_a_broken_header_is_a_card_error(sharded_dir: Path) -> None:
    (sharded_dir / S2).write_bytes(b"abc")
    with pytest.raises(ModelCardError, match=re.escape(f"org/sharded: {S2}: too short")):
        card_from_folder(ModelId("org/sharded"), sharded_dir)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SHARDED_CONFIG, 512),
        (SHARDED_CONFIG | {"max_position_embeddings": None, "max_seq_len": 2048}, 2048),
        ({k: v for k, v in SHARDED_CONFIG.items() if k != "max_position_embeddings"}, 4096),
        # Vision-language configs nest the language model's settings.
        (SHARDED_CONFIG | {"text_config": {"max_position_embeddings": 32768}}, 32768),
    ],
)
def test_the_folder_and_the_card_agree_on_the_context_length(
    sharded_dir: Path, config: dict[str, Any], expected: int
) -> None:
    (sharded_dir / "config.json").write_text(json.dumps(config))
    card = card_from_folder(ModelId("org/sharded"), sharded_dir)
    assert card.context_length == context_length(sharded_dir) == expected


# Llama 3.2 1B's published architecture, quantized the way mlx-community does.
LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "quantization": {"group_size": 64, "bits": 4},
}
LLAMA_1B_LAYER = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048


def test_estimate_params_for_a_llama_config() -> None:
    assert estimate_params(LLAMA_1B) == ((LLAMA_1B_LAYER,) * 16, 128256 * 2048, 2048)
    untied = LLAMA_1B | {"tie_word_embeddings": False}
    assert estimate_params(untied)[2] == 2048 + 128256 * 2048
    moe = LLAMA_1B | {"num_local_experts": 8, "moe_intermediate_size": 1024}
    assert estimate_params(moe)[0] == (
        (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8 * 1024 + 2048 * 8 + 2 * 2048,) * 16
    )


def test_card_from_config_without_index_estimates_from_quantization() -> None:
    card = card_from_config(ModelId("mlx-community/Llama-3.2-1B-Instruct-4bit"), LLAMA_1B)
    all_params = 16 * LLAMA_1B_LAYER + 128256 * 2048 + 2048
    # 4 bits + a bf16 scale and bias per 64 weights = 0.5625 bytes per parameter.
    assert card.total_bytes == int(all_params * 0.5625)
    assert card.size_source == "config_estimate"
    assert card.layer_params == LLAMA_1B_LAYER
    assert abs(card.layer_bytes - LLAMA_1B_LAYER * 0.5625) <= 1
    assert card.files == (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )
    assert layer_files(card, 3, 9) == {"model.safetensors"}
    assert (card.n_layers, card.n_kv_heads, card.head_dim, card.context_length) == (
        16,
        8,
        64,
        131072,
    )


def test_card_from_config_splits_the_index_total_by_parameters() -> None:
    weight_map = {
        "model.embed_tokens.weight": "a.safetensors",
        "model.norm.weight": "b.safetensors",
    }
    weight_map |= {f"model.layers.{i}.mlp.down_proj.weight": "a.safetensors" for i in range(8)}
    weight_map |= {f"model.layers.{i}.mlp.down_proj.weight": "b.safetensors" for i in range(8, 16)}
    index = {"metadata": {"total_size": 1_000_000_000}, "weight_map": weight_map}
    card = card_from_config(ModelId("org/llama"), LLAMA_1B, index)
    assert card.size_source == "index_total_size"
    assert card.total_bytes == 1_000_000_000
    all_params = 16 * LLAMA_1B_LAYER + 128256 * 2048 + 2048
    assert abs(card.embedding_bytes - 1e9 * 128256 * 2048 / all_params) <= 1
    assert abs(card.layer_bytes * 16 + card.other_bytes - 1e9) <= 16
    assert layer_files(card, 0, 4) == {"a.safetensors"}
    assert layer_files(card, 8, 12) == {"b.safetensors"}
    # Tied: the last rank needs the embedding's shard.
    assert layer_files(card, 12, 16) == {"a.safetensors", "b.safetensors"}
    assert "model.safetensors.index.json" in card.metadata_files
