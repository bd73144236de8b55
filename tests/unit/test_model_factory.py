"""The tiny random-weight models of `tests/model_factory.py`: each family's loads
back through mlx-lm exactly as written, has its distinctive parts, decodes
varied tokens, and gives the same logits whether its prompt runs in one
forward or token by token (which a wrong mask or cache would break)."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load  # pyright: ignore[reportAttributeAccessIssue]  # not in the stubs
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model

from tests.model_factory import TINY_FAMILIES, make_tiny_model

PROMPT_TOKENS = 40  # longer than the sliding windows (16)
DECODE_TOKENS = 12

# The cache kinds each family's layers use, in layer order (6 layers); nemotron_h's
# Mamba (M) and attention (*) blocks only, of its "M-*EME".
CACHE_KINDS: dict[str, list[type]] = {
    "gpt_oss": [RotatingKVCache, KVCache] * 3,
    "gemma3_text": [RotatingKVCache, RotatingKVCache, KVCache] * 2,
    "qwen3_next": [ArraysCache, ArraysCache, KVCache] * 2,
    "nemotron_h": [ArraysCache, KVCache, ArraysCache],
}
# Whether each layer's MLP is a mixture of experts.
MOE_LAYERS: dict[str, list[bool]] = {
    "qwen3_moe": [True] * 6,
    "mixtral": [True] * 6,
    "gpt_oss": [True] * 6,
    "deepseek_v3": [False] + [True] * 5,
    "glm4_moe": [False] + [True] * 5,
    "qwen3_next": [True] * 6,
    "nemotron_h": [False, False, False, True, False, True],
}
UNTIED = {
    "mistral",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "nemotron_h",
}


def prompt(vocab_size: int) -> mx.array:
    return mx.array([[(i * 7919) % (vocab_size - 100) + 50 for i in range(PROMPT_TOKENS)]])


def is_moe(layer: nn.Module) -> bool:
    # nemotron_h's blocks hold one mixer: Mamba, attention, MLP or MoE.
    mlp = next(layer[key] for key in ("mlp", "block_sparse_moe", "mixer") if key in layer)
    return isinstance(mlp, nn.Module) and any(key in mlp for key in ("switch_mlp", "experts"))


def last_logits(model: nn.Module, tokens: mx.array, cache: list[object]) -> mx.array:
    logits: mx.array = model(tokens, cache=cache)[0, -1]
    return logits


@pytest.mark.parametrize("model_type", TINY_FAMILIES)
def test_a_tiny_model_loads_as_written_and_decodes_varied_tokens(
    model_type: str, smollm_dir: Path, tmp_path: Path
) -> None:
    path = make_tiny_model(model_type, tmp_path / model_type, smollm_dir)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == model_type
    assert (
        config["vocab_size"] == json.loads((smollm_dir / "config.json").read_text())["vocab_size"]
    )

    model, _ = load_model(path)
    saved = mx.load(str(path / "model.safetensors"))
    assert isinstance(saved, dict)
    loaded = dict(tree_flatten(model.parameters()))
    assert sorted(loaded) == sorted(saved)
    assert [name for name, array in saved.items() if array.dtype != mx.float32] == []
    assert [name for name in saved if not mx.array_equal(saved[name], loaded[name]).item()] == []
    assert ("lm_head.weight" in saved) == (model_type in UNTIED)

    layers = model.layers
    assert isinstance(layers, list)
    assert len(layers) == 6
    assert [is_moe(layer) for layer in layers] == MOE_LAYERS.get(model_type, [False] * 6)
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == CACHE_KINDS.get(model_type, [KVCache] * 6)

    tokens = prompt(config["vocab_size"])
    logits = last_logits(model, tokens, cache)
    decoded: list[int] = []
    for _ in range(DECODE_TOKENS):
        assert mx.all(mx.isfinite(logits)).item()
        token = mx.argmax(logits).item()
        assert isinstance(token, int)
        decoded.append(token)
        logits = last_logits(model, mx.array([decoded[-1:]]), cache)
    assert len(set(decoded)) >= 3, decoded

    whole = last_logits(model, tokens, make_prompt_cache(model))
    stepwise = make_prompt_cache(model)
    step = whole
    for i in range(PROMPT_TOKENS):
        step = last_logits(model, tokens[:, i : i + 1], stepwise)
    difference = mx.abs(whole - step).max().item()
    assert mx.allclose(whole, step, rtol=1e-4, atol=1e-4).item(), difference


# Every family with 3 layers; with 4 those whose layer kinds follow a pattern.
FEWER_LAYERS = [(family, 3) for family in TINY_FAMILIES] + [
    (family, 4) for family in ("gpt_oss", "gemma3_text", "qwen3_next", "nemotron_h")
]


@pytest.mark.parametrize(("model_type", "n_layers"), FEWER_LAYERS)
def test_a_tiny_model_of_fewer_layers_runs(
    model_type: str, n_layers: int, smollm_dir: Path, tmp_path: Path
) -> None:
    path = make_tiny_model(model_type, tmp_path / model_type, smollm_dir, n_layers=n_layers, seed=1)
    model, config = load_model(path)
    assert isinstance(model.layers, list) and len(model.layers) == n_layers
    logits = last_logits(model, prompt(config["vocab_size"])[:, :20], make_prompt_cache(model))
    assert mx.all(mx.isfinite(logits)).item()


def test_mlx_lm_load_reads_a_tiny_model_and_its_tokenizer(smollm_dir: Path, tmp_path: Path) -> None:
    path = make_tiny_model("qwen3_next", tmp_path / "qwen3_next", smollm_dir)
    model, tokenizer = load(str(path))[:2]
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    assert mx.all(mx.isfinite(model(mx.array([ids])))).item()
    assert tokenizer.eos_token_id == json.loads((path / "config.json").read_text())["eos_token_id"]


def test_the_tiny_nemotron_h_has_every_block_kind(smollm_dir: Path, tmp_path: Path) -> None:
    path = make_tiny_model("nemotron_h", tmp_path / "nemotron_h", smollm_dir)
    model, config = load_model(path)
    layers = model.layers
    assert isinstance(layers, list)
    assert [layer.block_type for layer in layers] == list("M-*EME")
    # The MoE: a shared expert, no latent projections, no biases.
    assert config["moe_latent_size"] is None
    moe = layers[3]["mixer"]
    assert isinstance(moe, nn.Module)
    assert "shared_experts" in moe and "fc1_latent_proj" not in moe
    biases = [name for name, _ in tree_flatten(moe.parameters()) if name.endswith("bias")]
    assert biases == ["gate.e_score_correction_bias"]
