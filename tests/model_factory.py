"""Models for tests: the built-in SmolLM2 import and tiny random-weight llamas."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_llama(
    target: Path,
    tokenizer_source: Path,
    n_layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    weight_files: int = 1,
    tie_word_embeddings: bool = True,
) -> Path:
    """A random-weight llama using `tokenizer_source`'s tokenizer; fast on any CPU.

    With `weight_files` > 1 the weights are split like a hub repo's: the
    embedding in the first file, the norm in the last, the layers spread over
    all of them in order, and a `model.safetensors.index.json`."""
    vocab = json.loads((tokenizer_source / "config.json").read_text())["vocab_size"]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": n_layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    target.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if weight_files == 1:
        mx.save_safetensors(str(target / "model.safetensors"), weights)
    else:
        _save_sharded(target, weights, n_layers, weight_files)
    (target / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source / name, target / name)
    return target


def _save_sharded(target: Path, weights: dict[str, mx.array], n_layers: int, parts: int) -> None:
    def part_of(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) * parts // n_layers
        return 0 if "embed_tokens" in name else parts - 1

    weight_map: dict[str, str] = {}
    for part in range(parts):
        filename = f"model-{part + 1:05d}-of-{parts:05d}.safetensors"
        tensors = {name: array for name, array in weights.items() if part_of(name) == part}
        mx.save_safetensors(str(target / filename), tensors)
        weight_map.update(dict.fromkeys(tensors, filename))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
