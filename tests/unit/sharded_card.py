"""A model card for unit tests: 4 layers in three weight files, plus metadata.

model-1.safetensors  embedding, layers 0 and 1   (300 MB)
model-2.safetensors  layer 2                     (100 MB)
model-3.safetensors  layer 3, norm and head      (150 MB)
config.json, tokenizer.json                      (1 "byte" each for progress)
"""

from typing import Any

from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard, Quantization, WeightFile

MB = 10**6
GB = 10**9

W1, W2, W3 = "model-1.safetensors", "model-2.safetensors", "model-3.safetensors"
CONFIG, TOKENIZER = "config.json", "tokenizer.json"
METADATA = frozenset({CONFIG, TOKENIZER})
SIZES = {W1: 300 * MB, W2: 100 * MB, W3: 150 * MB}


def sharded_card(model_id: str = "org/m", **overrides: Any) -> ModelCard:
    layer_bytes, other_bytes = 100 * MB, 50 * MB
    fields: dict[str, Any] = {
        "model_id": ModelId(model_id),
        "architecture": "llama",
        "n_layers": 4,
        "hidden_size": 64,
        "n_heads": 4,
        "n_kv_heads": 1,
        "head_dim": 32,  # a KV head's query heads are whole quantization groups
        "context_length": 4096,
        "vocab_size": 100,
        "tie_word_embeddings": False,
        "files": (W1, W2, W3, CONFIG, TOKENIZER),
        "weight_files": (
            WeightFile(name=W1, layers=(0, 1), embedding=True, head=False, size_bytes=SIZES[W1]),
            WeightFile(name=W2, layers=(2,), embedding=False, head=False, size_bytes=SIZES[W2]),
            WeightFile(name=W3, layers=(3,), embedding=False, head=True, size_bytes=SIZES[W3]),
        ),
        "total_bytes": 4 * layer_bytes + 2 * other_bytes,
        "layer_bytes": layer_bytes,
        "embedding_bytes": other_bytes,
        "head_bytes": other_bytes,
        "layer_params": layer_bytes * 8 // 5,
        "embedding_params": other_bytes * 8 // 5,
        "head_params": other_bytes * 8 // 5,
        "quantization": Quantization(bits=4, group_size=32),
        "dtype_bytes": 2,
        "size_source": "safetensors_headers",
    }
    return ModelCard(**(fields | overrides))
