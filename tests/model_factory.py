"""Models for tests: the built-in SmolLM2 import and tiny random-weight llamas."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_llama(
    target: Path, tokenizer_source: Path, n_layers: int = 2, hidden: int = 64, seed: int = 0
) -> Path:
    """A random-weight llama using `tokenizer_source`'s tokenizer; fast on any CPU."""
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
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source / name, target / name)
    return target
