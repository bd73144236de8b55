"""Models for tests: the built-in SmolLM2 import and tiny random-weight models.

`make_tiny_llama` writes the plain llama most tests use; `make_tiny_model`
writes one of `TINY_FAMILIES`, each small enough to run on any CPU yet with its
family's distinctive parts (MoE routing, MLA, sliding windows, linear
attention, Mamba-2 mixers) in its first few layers, for tests that compare a
model run whole with the same model split across ranks."""

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import MODEL_REMAPPING  # pyright: ignore[reportAttributeAccessIssue]  # not in the stubs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# config.json `model_type` values `make_tiny_model` builds.
TINY_FAMILIES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "qwen3_next",
    "gemma3_text",
    "nemotron_h",
)

_HIDDEN = 64
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_INTERMEDIATE = 128
_EXPERTS = 4
_EXPERTS_PER_TOKEN = 2
_EXPERT_INTERMEDIATE = 32
_WINDOW = 16  # sliding-window layers: a 40-token prompt overflows it

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}

# Random weights as initialised give near-equal logits and hidden states that
# hardly depend on the token, so greedy decoding repeats one token. Scaled up,
# the embedding and head spread the logits and the MLPs' outputs dominate the
# residual stream, making each next token a different function of the last.
_EMBEDDING_SCALE = {
    "default": 4.0,
    # Gemma scales its embeddings up by sqrt(hidden) itself, and with its tied
    # head a larger scale has each token predict itself.
    "gemma3_text": 2.0,
}
_HEAD_SCALE = 4.0
_MLP_OUT_SCALE = 4.0


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
    config: dict[str, Any] = {
        **_common_config("llama", tokenizer_source, n_layers),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": n_layers,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    del config["head_dim"]  # hidden / heads, whatever `hidden` is
    weights = _random_weights(config, seed, varied=False)
    _write(target, config, weights, tokenizer_source, n_layers, weight_files)
    return target


def make_tiny_model(
    model_type: str,
    target: Path,
    tokenizer_source: Path,
    n_layers: int = 6,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """A random-weight model of family `model_type` (one of `TINY_FAMILIES`)
    using `tokenizer_source`'s tokenizer, written to `target` as mlx-lm loads it;
    `overrides` replace entries of its config.json.

    Every parameter is random, those the family initialises to a constant
    (norms, router gates and biases, attention sinks) included, so a weight
    that is not loaded or is sliced wrongly changes the output; the embedding
    and output head are scaled up so greedy decoding picks varied tokens."""
    config = {**tiny_config(model_type, tokenizer_source, n_layers), **(overrides or {})}
    weights = _random_weights(config, seed, varied=True)
    _write(target, config, weights, tokenizer_source, n_layers, 1)
    return target


def tiny_config(model_type: str, tokenizer_source: Path, n_layers: int = 6) -> dict[str, Any]:
    """The config.json `make_tiny_model` writes for `model_type`."""
    if model_type not in TINY_FAMILIES:
        raise ValueError(f"no tiny {model_type!r}: choose one of {', '.join(TINY_FAMILIES)}")
    return {
        **_common_config(model_type, tokenizer_source, n_layers),
        **_FAMILY_CONFIG[model_type](n_layers),
    }


def _common_config(model_type: str, tokenizer_source: Path, n_layers: int) -> dict[str, Any]:
    source = json.loads((tokenizer_source / "config.json").read_text())
    return {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "hidden_size": _HIDDEN,
        "intermediate_size": _INTERMEDIATE,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "num_hidden_layers": n_layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": source["vocab_size"],
        "tie_word_embeddings": False,
        "eos_token_id": source.get("eos_token_id", 2),
        "bos_token_id": source.get("bos_token_id", 1),
    }


def _dense(tied: bool) -> Callable[[int], dict[str, Any]]:
    return lambda n_layers: {"tie_word_embeddings": tied}


def _qwen3_moe(n_layers: int) -> dict[str, Any]:
    return {
        "num_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "moe_intermediate_size": _EXPERT_INTERMEDIATE,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _mixtral(n_layers: int) -> dict[str, Any]:
    return {"num_local_experts": _EXPERTS, "num_experts_per_tok": _EXPERTS_PER_TOKEN}


def _gpt_oss(n_layers: int) -> dict[str, Any]:
    return {
        "num_local_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "intermediate_size": _EXPERT_INTERMEDIATE,  # gpt-oss's experts' width
        "sliding_window": _WINDOW,
        # gpt-oss's YaRN (transformers warns when loading the tokenizer without it)
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        # Written out: the model's default pairs drop an odd last layer.
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(n_layers)],
    }


def _deepseek_v3(n_layers: int) -> dict[str, Any]:
    return {
        "num_key_value_heads": _HEADS,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "n_shared_experts": 1,
        "moe_intermediate_size": _EXPERT_INTERMEDIATE,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }


def _glm4_moe(n_layers: int) -> dict[str, Any]:
    return {
        "n_routed_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "n_shared_experts": 1,
        "moe_intermediate_size": _EXPERT_INTERMEDIATE,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    }


def _qwen3_next(n_layers: int) -> dict[str, Any]:
    return {
        # Layers 2 and 5 full attention, the rest GatedDeltaNet linear attention
        "full_attention_interval": min(3, n_layers),
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "moe_intermediate_size": _EXPERT_INTERMEDIATE,
        "shared_expert_intermediate_size": _EXPERT_INTERMEDIATE,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
    }


def _gemma3_text(n_layers: int) -> dict[str, Any]:
    return {
        "sliding_window": _WINDOW,
        "sliding_window_pattern": min(3, n_layers),  # layers 2 and 5 global, the rest sliding
        "query_pre_attn_scalar": _HEAD_DIM,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,  # as Gemma 3's: the model drops lm_head when it has no weights
    }


# Mamba-2 (M), MLP (-), attention (*) and MoE (E) blocks: the first four layers
# hold one of each; the pattern repeats for more than six.
_NEMOTRON_PATTERN = "M-*EME"


def _nemotron_h(n_layers: int) -> dict[str, Any]:
    return {
        "hybrid_override_pattern": (_NEMOTRON_PATTERN * n_layers)[:n_layers],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "mamba_proj_bias": False,
        "use_conv_bias": True,
        "use_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": _EXPERTS,
        "num_experts_per_tok": _EXPERTS_PER_TOKEN,
        "moe_intermediate_size": _EXPERT_INTERMEDIATE,
        "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": _EXPERT_INTERMEDIATE,
        "moe_latent_size": None,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }


_FAMILY_CONFIG: dict[str, Callable[[int], dict[str, Any]]] = {
    "llama": _dense(tied=True),
    "mistral": _dense(tied=False),
    "qwen2": _dense(tied=True),
    "qwen3": _dense(tied=False),
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "qwen3_next": _qwen3_next,
    "gemma3_text": _gemma3_text,
    "nemotron_h": _nemotron_h,
}


def _model_class(model_type: str) -> tuple[Any, Any]:
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return module.Model, module.ModelArgs


def _random_weights(config: dict[str, Any], seed: int, varied: bool) -> dict[str, mx.array]:
    """The parameters of the family's mlx-lm model built from `config` after
    `mx.random.seed(seed)`; with `varied`, made to give varied greedy tokens."""
    model_class, args_class = _model_class(config["model_type"])
    mx.random.seed(seed)
    model: nn.Module = model_class(args_class.from_dict(config))
    weights: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    if varied:
        scale = _EMBEDDING_SCALE.get(config["model_type"], _EMBEDDING_SCALE["default"])
        weights = {name: _vary(name, array, scale) for name, array in weights.items()}
    if config.get("tie_word_embeddings"):
        # gemma3's model has an lm_head until sanitize finds no weights for it
        weights.pop("lm_head.weight", None)
    mx.eval(weights)
    return weights


def _vary(name: str, array: mx.array, embedding_scale: float) -> mx.array:
    if name.endswith(("embed_tokens.weight", "backbone.embeddings.weight")):  # (nemotron_h)
        return array * embedding_scale
    if name == "lm_head.weight":
        return array * _HEAD_SCALE
    # MLPs' and experts' outputs (nemotron_h's ReLU² experts: fc2)
    if name.endswith(("down_proj.weight", "switch_mlp.fc2.weight")):
        return array * _MLP_OUT_SCALE
    if name == "model.norm.weight":
        # Signs mixed, so that with a tied head a token's logits do not favour
        # the token itself (which makes greedy decoding repeat one or two).
        return mx.random.normal(array.shape)
    if name.endswith(".sinks"):  # gpt-oss's attention sinks (0)
        return mx.random.normal(array.shape)
    if name.endswith(".gate.weight") and not bool(mx.any(array).item()):
        # DeepSeek's and GLM's routers (0): scores that vary by token
        return mx.random.normal(array.shape) * array.shape[-1] ** -0.5
    if bool(mx.all(array == array.reshape(-1)[0]).item()):
        # Norms and dt_bias (1), router score biases and experts' biases (0)
        return array + 0.1 * mx.random.normal(array.shape)
    return array


def _write(
    target: Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    tokenizer_source: Path,
    n_layers: int,
    weight_files: int,
) -> None:
    target.mkdir(parents=True, exist_ok=True)
    if weight_files == 1:
        mx.save_safetensors(str(target / "model.safetensors"), weights)
    else:
        _save_sharded(target, weights, n_layers, weight_files)
    (target / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source / name, target / name)


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
