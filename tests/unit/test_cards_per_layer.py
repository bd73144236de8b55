"""Per-layer sizes and caches on model cards: published configs (and one
Nemotron-H-like) against hand-computed numbers, and tiny mlx-lm models of each
family against what their modules and caches really hold."""

import importlib
import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from pydantic import ValidationError

from exo.models.cards import card_from_config, card_from_folder, estimate_params
from exo.models.layer_estimates import nemotron_pattern
from exo.models.memory import (
    KV_RESERVE_TOKENS,
    kv_bytes_per_token,
    layer_kv,
    layer_weights,
    rank_kv,
    rank_memory,
    rank_weights,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import LayerCache
from tests.unit.sharded_card import sharded_card

FOUR_BIT = {"quantization": {"bits": 4, "group_size": 64}, "torch_dtype": "bfloat16"}
# 4 bits plus a bf16 scale and bias per 64 weights.
FOUR_BIT_BYTES_PER_PARAM = 0.5625


def attention(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q, k, v, o projections."""
    return hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden


def card(config: dict[str, Any]) -> Any:
    return card_from_config(ModelId("org/m"), config)


# --- published configs, hand-computed ---------------------------------------------

LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA_8B_LAYER = attention(4096, 32, 8, 128) + 3 * 4096 * 14336 + 2 * 4096


def test_a_dense_llama_has_equal_layers_with_full_attention() -> None:
    layers, embedding, head = estimate_params(LLAMA_8B)
    assert layers == (LLAMA_8B_LAYER,) * 32
    assert 8.02e9 < sum(layers) + embedding + head < 8.04e9  # Llama 3.1 8B: 8.03B
    model = card(LLAMA_8B)
    assert model.layer_caches == (LayerCache(kind="attention", token_elements=2 * 8 * 128),) * 32
    assert kv_bytes_per_token(model, "metal") == 2 * 8 * 128 * 32 * 2


QWEN3_235B = {
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    **FOUR_BIT,
}
# Attention with q/k norms; 128 experts of 3 x 4096 x 1536 and a router; 2 norms.
QWEN3_235B_MOE = (
    attention(4096, 64, 4, 128) + 2 * 128 + 128 * 3 * 4096 * 1536 + 4096 * 128 + 2 * 4096
)
QWEN3_235B_DENSE = attention(4096, 64, 4, 128) + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096


def test_qwen3_moe_layers_hold_every_expert() -> None:
    layers, embedding, head = estimate_params(QWEN3_235B)
    assert layers == (QWEN3_235B_MOE,) * 94
    assert 234e9 < sum(layers) + embedding + head < 236e9  # Qwen3-235B-A22B
    model = card(QWEN3_235B)
    assert model.size_source == "config_estimate"
    for stored, params in zip(model.per_layer_bytes, model.per_layer_params, strict=True):
        assert abs(stored - params * FOUR_BIT_BYTES_PER_PARAM) <= 1
    assert {c.token_elements for c in model.layer_caches} == {2 * 4 * 128}
    # Layers Qwen keeps dense: `mlp_only_layers` and every `decoder_sparse_step`-th.
    sparse = QWEN3_235B | {"mlp_only_layers": [0], "decoder_sparse_step": 2}
    assert estimate_params(sparse)[0][:4] == (
        QWEN3_235B_DENSE,
        QWEN3_235B_MOE,
        QWEN3_235B_DENSE,
        QWEN3_235B_MOE,
    )


DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    **FOUR_BIT,
}
# q through a 1536 rank (with its norm); kv from a 512 latent plus a 64-dim rope
# key (with the latent's norm); per-head k/v up-projections; o.
MLA = (
    7168 * 1536
    + 1536
    + 1536 * 128 * (128 + 64)
    + 7168 * (512 + 64)
    + 512
    + 128 * 512 * (128 + 128)
    + 128 * 128 * 7168
)
DEEPSEEK_DENSE = MLA + 3 * 7168 * 18432 + 2 * 7168
# 256 routed experts, a router with a score correction per expert, one shared expert.
DEEPSEEK_MOE = MLA + 256 * 3 * 7168 * 2048 + 256 * (7168 + 1) + 3 * 7168 * 2048 + 2 * 7168


def test_deepseek_v3_has_three_dense_layers_then_moe_and_caches_a_latent() -> None:
    layers, embedding, head = estimate_params(DEEPSEEK_V3)
    assert layers == (DEEPSEEK_DENSE,) * 3 + (DEEPSEEK_MOE,) * 58
    assert 670e9 < sum(layers) + embedding + head < 672e9  # DeepSeek-V3: 671B without MTP
    # The index's exact total is split in proportion to the layers' parameters.
    index = {"metadata": {"total_size": 377 * 10**9}, "weight_map": {"lm_head.weight": "a"}}
    model = card_from_config(ModelId("org/ds"), DEEPSEEK_V3, index)
    assert model.size_source == "index_total_size"
    dense, moe = model.per_layer_bytes[0], model.per_layer_bytes[3]
    assert abs(moe / dense - DEEPSEEK_MOE / DEEPSEEK_DENSE) < 1e-6
    assert sum(model.per_layer_bytes) + model.other_bytes == model.total_bytes
    # The cache is the 512 latent plus the 64-dim rope key per token, not 128 heads' k/v.
    assert model.layer_caches == (LayerCache(kind="latent", token_elements=512 + 64),) * 61
    assert layer_kv(model, "metal") == ((512 + 64) * 2 * KV_RESERVE_TOKENS,) * 61
    assert layer_kv(model, "cpu") == ((512 + 64) * 4 * KV_RESERVE_TOKENS,) * 61


def test_deepseek_v32_also_caches_its_indexer_key() -> None:
    v32 = DEEPSEEK_V3 | {"model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128}
    [cache, *_] = card(v32).layer_caches
    assert cache.token_elements == 512 + 64 + 2 * 128  # the key and as many zeros


GPT_OSS_120B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
}
# Biased q/k/v/o and one sink per head; 128 biased experts; a biased router.
GPT_OSS_LAYER = (
    attention(2880, 64, 8, 64)
    + (64 + 2 * 8) * 64
    + 2880
    + 64
    + 128 * (3 * 2880 * 2880 + 2 * 2880 + 2880)
    + 128 * (2880 + 1)
    + 2 * 2880
)


def test_gpt_oss_alternates_sliding_and_full_attention() -> None:
    layers, embedding, head = estimate_params(GPT_OSS_120B)
    assert layers == (GPT_OSS_LAYER,) * 36
    assert 116e9 < sum(layers) + embedding + head < 118e9  # gpt-oss-120b: 116.8B
    model = card(GPT_OSS_120B)
    per_token = 2 * 8 * 64
    sliding = LayerCache(kind="sliding", token_elements=per_token, window=128)
    full = LayerCache(kind="attention", token_elements=per_token)
    assert model.layer_caches == (sliding, full) * 18
    # A sliding layer reserves its window, a full one the whole reserve.
    assert layer_kv(model, "metal")[:2] == (128 * per_token * 2, KV_RESERVE_TOKENS * per_token * 2)


QWEN3_NEXT_80B = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
# 512 experts, a router, one shared expert with its gate; 2 norms.
QWEN3_NEXT_MLP = 512 * 3 * 2048 * 512 + 2048 * 512 + 3 * 2048 * 512 + 2048 + 2 * 2048
# Gated DeltaNet: q, k (16 x 128 each), v, z (32 x 128 each) and b, a per value
# head in; a depthwise conv over q, k, v; dt bias, A log; a norm; out.
QWEN3_NEXT_LINEAR = (
    2048 * (2 * 2048 + 2 * 4096 + 2 * 32) + 8192 * 4 + 2 * 32 + 128 + 4096 * 2048 + QWEN3_NEXT_MLP
)
# The query projection also yields the output gate; q/k norms.
QWEN3_NEXT_FULL = attention(2048, 16, 2, 256) + 16 * 256 * 2048 + 2 * 256 + QWEN3_NEXT_MLP


def test_qwen3_next_linear_layers_keep_a_constant_state() -> None:
    layers, embedding, head = estimate_params(QWEN3_NEXT_80B)
    assert layers == (QWEN3_NEXT_LINEAR,) * 3 + (QWEN3_NEXT_FULL,) + layers[:4] * 11
    assert 79e9 < sum(layers) + embedding + head < 82e9  # Qwen3-Next-80B-A3B
    model = card(QWEN3_NEXT_80B)
    # Convolution state: 3 steps of q, k, v; recurrent state: 32 x 128 x 128 in float32.
    linear = LayerCache(
        kind="recurrent",
        state_elements=3 * (2 * 2048 + 4096),
        float32_state_elements=32 * 128 * 128,
    )
    full = LayerCache(kind="attention", token_elements=2 * 2 * 256)
    assert model.layer_caches == (linear, linear, linear, full) * 12
    assert layer_kv(model, "metal")[:4] == (
        3 * 8192 * 2 + 32 * 128 * 128 * 4,
        3 * 8192 * 2 + 32 * 128 * 128 * 4,
        3 * 8192 * 2 + 32 * 128 * 128 * 4,
        KV_RESERVE_TOKENS * 1024 * 2,
    )
    assert kv_bytes_per_token(model, "metal") == 12 * 1024 * 2  # only full layers grow


GEMMA3_27B_TEXT = {
    "model_type": "gemma3_text",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "vocab_size": 262208,
    "tie_word_embeddings": True,
}


def test_gemma3_keeps_a_window_in_five_layers_of_six() -> None:
    layers, *_ = estimate_params(GEMMA3_27B_TEXT)
    # q/k norms and four norms per layer.
    assert layers == (attention(5376, 32, 16, 128) + 2 * 128 + 3 * 5376 * 21504 + 4 * 5376,) * 62
    model = card(GEMMA3_27B_TEXT)
    sliding = LayerCache(kind="sliding", token_elements=2 * 16 * 128, window=1024)
    full = LayerCache(kind="attention", token_elements=2 * 16 * 128)
    assert model.layer_caches == ((sliding,) * 5 + (full,)) * 10 + (sliding,) * 2
    # 52 windows of 1024 tokens and 10 full layers of the 8192-token reserve.
    assert rank_kv(model, "metal", 0, 62) == (52 * 1024 + 10 * KV_RESERVE_TOKENS) * 4096 * 2


def test_a_vision_language_gemma3_is_read_from_its_text_config() -> None:
    config = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "sliding_window": 1024,
        },
        "vocab_size": 262208,
    }
    model = card(config)
    # mlx-lm loads it by the top-level type; the text config lacks the head
    # counts, which take gemma3's defaults (8 heads, 4 KV heads of 256).
    assert (model.architecture, model.n_heads, model.n_kv_heads, model.head_dim) == (
        "gemma3",
        8,
        4,
        256,
    )
    assert model.layer_caches[5] == LayerCache(kind="attention", token_elements=2 * 4 * 256)
    assert model.layer_caches[0].window == 1024
    assert (model.intermediate_size, model.moe_intermediate_size) == (10240, None)


_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}


@pytest.mark.parametrize(
    ("config", "widths"),
    [
        (LLAMA_8B, (32, 8, 14336, None)),
        (QWEN3_235B, (64, 4, 12288, 1536)),
        (DEEPSEEK_V3, (128, 128, 18432, 2048)),
        # Other families' spellings (gpt2, afm7, ...).
        ({"model_type": "gpt2", "n_head": 4, "n_inner": 256} | _SMALL, (4, 4, 256, None)),
        (
            {"model_type": "afm7", "num_heads": 8, "num_kv_heads": 2, "ffn_dim": 128} | _SMALL,
            (8, 2, 128, None),
        ),
        ({"model_type": "dbrx", "n_heads": 6, "ffn_hidden_size": 96} | _SMALL, (6, 6, 96, None)),
        # A vision-language wrapper: the language model's in `text_config`.
        (
            {
                "model_type": "qwen3_vl_moe",
                "text_config": {
                    "num_attention_heads": 16,
                    "num_key_value_heads": 4,
                    "intermediate_size": 512,
                    "moe_intermediate_size": 64,
                }
                | _SMALL,
            },
            (16, 4, 512, 64),
        ),
    ],
)
def test_the_widths_a_tensor_split_divides_are_read_in_each_spelling(
    config: dict[str, Any], widths: tuple[int, int, int | None, int | None]
) -> None:
    model = card(config)
    assert (
        model.n_heads,
        model.n_kv_heads,
        model.intermediate_size,
        model.moe_intermediate_size,
    ) == widths


# A Nemotron-H-like model with one block of each kind.
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 6,
    "hybrid_override_pattern": "M-M*ME",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "attention_bias": False,
    "mlp_bias": False,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_shared_expert_intermediate_size": 2048,
    "max_position_embeddings": 8192,
    "vocab_size": 131072,
    "tie_word_embeddings": False,
}
# Every block: one norm (4096). Mamba-2: inner 128 x 64 = 8192, conv over x, B, C
# (8192 + 2 x 8 groups x 128 = 10240), in projection to z, xBC and dt.
NEMOTRON_M = 4096 * (8192 + 10240 + 128) + 10240 * 4 + 10240 + 3 * 128 + 8192 + 8192 * 4096 + 4096
NEMOTRON_MLP = 2 * 4096 * 21504 + 4096  # ReLU² up and down
NEMOTRON_ATTENTION = attention(4096, 32, 8, 128) + 4096
NEMOTRON_MOE = 8 * 2 * 4096 * 1024 + 8 * (4096 + 1) + 2 * 4096 * 2048 + 4096


def test_nemotron_h_blocks_follow_the_pattern() -> None:
    layers, *_ = estimate_params(NEMOTRON_H)
    assert layers == (
        NEMOTRON_M,
        NEMOTRON_MLP,
        NEMOTRON_M,
        NEMOTRON_ATTENTION,
        NEMOTRON_M,
        NEMOTRON_MOE,
    )
    model = card(NEMOTRON_H)
    mamba = LayerCache(
        kind="recurrent", state_elements=3 * 10240, float32_state_elements=128 * 64 * 128
    )
    none = LayerCache(kind="none")
    full = LayerCache(kind="attention", token_elements=2 * 8 * 128)
    assert model.layer_caches == (mamba, none, mamba, full, mamba, none)
    assert layer_kv(model, "metal")[:2] == (3 * 10240 * 2 + 128 * 64 * 128 * 4, 0)
    # Without `num_hidden_layers` the pattern says how many layers there are.
    unnumbered = {k: v for k, v in NEMOTRON_H.items() if k != "num_hidden_layers"}
    assert card(unnumbered).n_layers == 6


GLM45_AIR = {
    "model_type": "glm4_moe",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "attention_bias": True,
    "use_qk_norm": False,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 131072,
    "vocab_size": 151552,
    "tie_word_embeddings": False,
}
GLM_ATTENTION = attention(4096, 96, 8, 128) + (96 + 2 * 8) * 128  # q/k/v biased
GLM_DENSE = GLM_ATTENTION + 3 * 4096 * 10944 + 2 * 4096
GLM_MOE = GLM_ATTENTION + 128 * 3 * 4096 * 1408 + 128 * (4096 + 1) + 3 * 4096 * 1408 + 2 * 4096


def test_glm4_moe_has_a_dense_first_layer_and_plain_attention_caches() -> None:
    layers, embedding, head = estimate_params(GLM45_AIR)
    assert layers == (GLM_DENSE,) + (GLM_MOE,) * 45
    assert 105e9 < sum(layers) + embedding + head < 108e9  # GLM-4.5-Air: 106B with MTP
    assert (
        card(GLM45_AIR).layer_caches
        == (LayerCache(kind="attention", token_elements=2 * 8 * 128),) * 46
    )


def test_the_rank_memory_sums_its_own_layers() -> None:
    model = card(DEEPSEEK_V3)
    weights, kv = layer_weights(model, "metal"), layer_kv(model, "metal")
    assert rank_weights(model, "metal", 0, 3) == sum(weights[:3]) + model.embedding_bytes
    assert rank_weights(model, "metal", 3, 61) == sum(weights[3:]) + model.head_bytes
    assert rank_memory(model, "metal", 3, 10) == sum(weights[3:10]) + sum(kv[3:10])
    # The first rank of three dense layers needs a fraction of a rank of three MoE layers.
    assert rank_memory(model, "metal", 0, 3) < rank_memory(model, "metal", 3, 6) / 10


# --- cards from older nodes ------------------------------------------------------


def test_a_card_without_per_layer_fields_gets_the_averages() -> None:
    old = sharded_card().model_dump(mode="json")
    for key in ("per_layer_bytes", "per_layer_params", "layer_caches"):
        del old[key]
    restored = type(sharded_card()).model_validate_json(json.dumps(old))
    assert restored.per_layer_bytes == (restored.layer_bytes,) * 4
    assert restored.per_layer_params == (restored.layer_params,) * 4
    assert restored.layer_caches == (LayerCache(kind="attention", token_elements=2 * 1 * 32),) * 4
    assert restored == sharded_card()


def test_per_layer_fields_need_one_entry_per_layer() -> None:
    with pytest.raises(ValidationError, match="one per layer"):
        sharded_card(per_layer_bytes=(1, 2, 3))


# --- tiny mlx-lm models: the estimates against the real modules and caches ----------

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 6,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,  # the KV reserve: one 256-token KVCache step
    "vocab_size": 100,
    "tie_word_embeddings": False,
}
_MLA = {
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 2,
}
_LINEAR = {
    "full_attention_interval": 3,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 40,
}
_ROUTING = {"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
_WINDOW = 8  # fewer than the tokens decoded below
TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "attention_bias": True,
        "mlp_bias": True,
        "sliding_window": _WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    },
    "qwen2": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "norm_topk_prob": True,
    },
    "deepseek_v3": _MLA | {"moe_layer_freq": 2},
    "deepseek_v32": _MLA | {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8},
    "kimi_k2": _MLA | {"q_lora_rank": None},
    "glm4_moe": _ROUTING
    | {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": _WINDOW,
    },
    "qwen3_next": _LINEAR
    | {"mlp_only_layers": [1], "decoder_sparse_step": 1, "partial_rotary_factor": 0.5},
    "gemma3_text": {"sliding_window": _WINDOW, "sliding_window_pattern": 3},
    "nemotron_h": {
        "num_hidden_layers": 5,
        "hybrid_override_pattern": "M-M*E",
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "attention_bias": False,
        "mamba_proj_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_shared_experts": 1,
    }
    | _ROUTING,
    "mamba": {
        "intermediate_size": 128,
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": True,
        "use_conv_bias": True,
        "time_step_rank": "auto",
    },
    "mamba2": {
        "num_heads": 8,
        "head_dim": 8,
        "state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 1e9],
        "time_step_rank": "auto",
    },
}


_REMAPPING = {"kimi_k2": "deepseek_v3"}  # mlx-lm's module for the type


def tiny_config(model_type: str) -> dict[str, Any]:
    return {"model_type": model_type, **_BASE, **TINY[model_type]}


def tiny_model(config: dict[str, Any]) -> Any:
    model_type = config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(0)
    return module.Model(module.ModelArgs.from_dict(config))


def params(module: Any) -> int:
    return sum(cast(mx.array, v).size for _, v in tree_flatten(module.parameters()))


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_estimated_layer_params_match_the_mlx_lm_model(model_type: str) -> None:
    config = tiny_config(model_type)
    model = tiny_model(config)
    layers, embedding, head = estimate_params(config)
    assert layers == tuple(params(layer) for layer in model.layers)
    assert sum(layers) + embedding + head == params(model)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_cache_reserves_match_the_mlx_lm_caches(model_type: str) -> None:
    """Decode past the sliding windows: each layer's cache then holds what the
    card reserves for it (float32, the dtype of a randomly initialised model,
    as on the CPU backend; the reserve is one 256-token KVCache step)."""
    config = tiny_config(model_type)
    model = tiny_model(config)
    cache = make_prompt_cache(model)
    for token in range(2 * _WINDOW):
        model(mx.array([[token + 1]]), cache=cache)
    reserve = layer_kv(card(config), "cpu")
    if model_type == "nemotron_h":  # MLP and MoE blocks have no cache at all
        blocks = nemotron_pattern(config)
        reserve = tuple(r for r, block in zip(reserve, blocks, strict=True) if block in "M*")
    assert tuple(c.nbytes for c in cache) == reserve


def test_a_folder_card_has_each_layers_exact_bytes(tmp_path: Path) -> None:
    config = tiny_config("deepseek_v3")
    model = tiny_model(config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder = card_from_folder(ModelId("org/tiny-ds"), tmp_path)
    assert folder.per_layer_params == estimate_params(config)[0]
    assert folder.per_layer_bytes == tuple(params(layer) * 4 for layer in model.layers)  # float32
    assert folder.layer_caches == card(config).layer_caches
    assert folder.per_layer_bytes[0] < folder.per_layer_bytes[2]  # dense, then MoE
