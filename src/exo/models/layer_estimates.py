"""Each layer's parameter count and cache, from a model's `config.json`.

The layers of one model differ: a mixture-of-experts layer holds every expert
and dwarfs the dense layers some models start with; multi-head latent attention
caches a compressed latent rather than keys and values; linear-attention and SSM
layers keep a constant-size state; sliding-window layers keep at most the
window; MLP-only blocks cache nothing. Placement needs this per layer before any
weight is downloaded, and without MLX (the node process never imports it), so
the config is read the way each family's mlx-lm model
(`mlx_lm/models/<model_type>.py`) builds its layers and caches. A family not
modelled here is taken as a llama-style decoder: attention over every KV head
in every layer, mixture-of-experts layers where the usual config keys put them.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exo.shared.types.model_card import LayerCache, full_attention

# model_type -> the family whose layers it builds (mlx-lm's remapping and the
# vision-language wrappers around a text model modelled here).
_ALIASES = {
    "mistral": "llama",
    "gemma3": "gemma3_text",
    "qwen3_5_moe": "qwen3_5",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "joyai_llm_flash": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3",
    "falcon_mamba": "mamba",
}
# Families without attention: the card's attention-head fields are 0.
ATTENTION_FREE = frozenset({"mamba", "falcon_mamba", "mamba2"})
# Defaults mlx-lm fills in for keys the family's configs may leave out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # The vision-language wrapper's text config often omits the attention shape.
    "gemma3": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "gemma3_text": {"head_dim": 256},
}


@dataclass(frozen=True)
class Dims:
    """The attention shape a card reads from every config (`exo.models.cards`)."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Layer:
    """What placement needs of one layer before its weights are here."""

    params: int  # as loaded: a quantized weight counts its dequantized elements
    cache: LayerCache


def family(config: Mapping[str, Any]) -> str:
    """The family whose mlx-lm model builds the layers of a config's model."""
    model_type = str(config.get("model_type", ""))
    return _ALIASES.get(model_type, model_type)


def _int(config: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _flag(config: Mapping[str, Any], key: str) -> bool:
    return config.get(key) is True


# --- building blocks ------------------------------------------------------------


def _attention(
    d: Dims,
    *,
    q_gate: bool = False,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    sinks: bool = False,
) -> int:
    """q, k, v and o projections of grouped-query attention; `q_gate`: the query
    projection also yields an output gate (twice the width)."""
    q = d.n_heads * d.head_dim * (2 if q_gate else 1)
    kv = d.n_kv_heads * d.head_dim
    params = d.hidden * (q + 2 * kv) + d.n_heads * d.head_dim * d.hidden
    params += (q + 2 * kv if qkv_bias else 0) + (d.hidden if o_bias else 0)
    return params + (2 * d.head_dim if qk_norm else 0) + (d.n_heads if sinks else 0)


def _glu(hidden: int, inner: int, *, bias: bool = False) -> int:
    """Gate, up and down projections."""
    return 3 * hidden * inner + (2 * inner + hidden if bias else 0)


# How families spell the dense MLP's hidden width.
DENSE_SIZE_KEYS = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")


def _dense_size(config: Mapping[str, Any]) -> int:
    return next((size for key in DENSE_SIZE_KEYS if (size := _int(config, key))), 0)


def _n_experts(config: Mapping[str, Any]) -> int:
    return (
        _int(config, "num_local_experts")
        or _int(config, "num_experts")
        or _int(config, "n_routed_experts")
    )


def _expert_size(config: Mapping[str, Any]) -> int:
    return _int(config, "moe_intermediate_size") or _dense_size(config)


def _moe(
    config: Mapping[str, Any], hidden: int, *, router_bias: bool = False, expert_bias: bool = False
) -> int:
    """A mixture-of-experts MLP with every expert resident: the routed experts,
    the router (with a per-expert bias or score correction when `router_bias`)
    and the shared experts (Qwen's one shared expert has a sigmoid gate of its
    own, DeepSeek's `n_shared_experts` are one wider MLP)."""
    experts, size = _n_experts(config), _expert_size(config)
    params = experts * _glu(hidden, size, bias=expert_bias) + hidden * experts
    params += experts if router_bias else 0
    if qwen_shared := _int(config, "shared_expert_intermediate_size"):
        params += _glu(hidden, qwen_shared) + hidden
    elif n_shared := _int(config, "n_shared_experts") or _int(config, "num_shared_experts"):
        params += _glu(hidden, n_shared * size)
    return params


# Families whose every layer is MoE when the config has experts, whatever other keys say.
_EVERY_LAYER_MOE = frozenset({"qwen2_moe", "qwen3_5"})


def _is_moe_layer(config: Mapping[str, Any], layer: int, name: str) -> bool:
    """The config keys families use to keep some layers dense: DeepSeek and GLM's
    `first_k_dense_replace` and `moe_layer_freq`, Qwen's `decoder_sparse_step`
    and `mlp_only_layers`."""
    if not _n_experts(config):
        return False
    if name in _EVERY_LAYER_MOE:
        return True
    if layer < _int(config, "first_k_dense_replace"):
        return False
    only_mlp = config.get("mlp_only_layers")
    if isinstance(only_mlp, list) and layer in only_mlp:
        return False
    if (layer + 1) % max(1, _int(config, "decoder_sparse_step", 1)) != 0:
        return False
    freq = config.get("moe_layer_freq")
    if isinstance(freq, list):
        return layer < len(freq) and bool(freq[layer])
    return layer % max(1, _int(config, "moe_layer_freq", 1)) == 0


def _sliding(d: Dims, window: int) -> LayerCache:
    return LayerCache(kind="sliding", token_elements=2 * d.n_kv_heads * d.head_dim, window=window)


def _layer_types(config: Mapping[str, Any]) -> list[str]:
    types = config.get("layer_types")
    return [str(t) for t in types] if isinstance(types, list) else []


# --- families -------------------------------------------------------------------


def _llama(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """llama, mistral, qwen2/3, their MoE variants, mixtral, and families not
    modelled here. llama and ministral3 attend over a sliding window in the
    layers `layer_types` marks "sliding_attention"."""
    bias = _flag(config, "attention_bias")
    attention = _attention(
        d,
        qkv_bias=bias or name in ("qwen2", "qwen2_moe"),
        o_bias=bias,
        qk_norm=name in ("qwen3", "qwen3_moe"),
    )
    dense = _glu(d.hidden, _dense_size(config), bias=_flag(config, "mlp_bias"))
    moe = _moe(config, d.hidden)
    types, window = _layer_types(config), _int(config, "sliding_window")
    windowed = name in ("llama", "ministral3") and window > 0
    layers: list[Layer] = []
    for i in range(d.n_layers):
        mlp = moe if _is_moe_layer(config, i, name) else dense
        sliding = windowed and i < len(types) and types[i] == "sliding_attention"
        cache = _sliding(d, window) if sliding else full_attention(d.n_kv_heads, d.head_dim)
        layers.append(Layer(attention + mlp + 2 * d.hidden, cache))
    return layers


def _glm4_moe(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Grouped-query attention (biased q/k/v, optional q/k norms); MoE after the
    first `first_k_dense_replace` layers."""
    bias = _flag(config, "attention_bias")
    attention = _attention(d, qkv_bias=bias, qk_norm=_flag(config, "use_qk_norm"))
    dense, moe = _glu(d.hidden, _dense_size(config)), _moe(config, d.hidden, router_bias=True)
    first_dense = _int(config, "first_k_dense_replace")
    return [
        Layer(
            attention + (moe if i >= first_dense else dense) + 2 * d.hidden,
            full_attention(d.n_kv_heads, d.head_dim),
        )
        for i in range(d.n_layers)
    ]


def _deepseek(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Multi-head latent attention: queries through a low-rank projection, keys
    and values from a `kv_lora_rank` latent plus a shared rope key, which is
    what deepseek_v3 (and kimi, glm4_moe_lite) cache; deepseek_v2 caches the
    decompressed keys and values of every head; deepseek_v32 also caches its
    indexer's key (with as many zeros as values). MoE where `first_k_dense_replace`
    and `moe_layer_freq` put it."""
    h, heads = d.hidden, d.n_heads
    q_lora, kv_lora = _int(config, "q_lora_rank"), _int(config, "kv_lora_rank")
    nope, rope = _int(config, "qk_nope_head_dim"), _int(config, "qk_rope_head_dim")
    v = _int(config, "v_head_dim")
    if q_lora:
        attention = h * q_lora + q_lora + q_lora * heads * (nope + rope)
    else:
        attention = h * heads * (nope + rope)
    attention += h * (kv_lora + rope) + kv_lora + heads * kv_lora * (nope + v) + heads * v * h
    if _flag(config, "attention_bias"):
        attention += (q_lora if q_lora else 0) + kv_lora + rope + h
    per_token = heads * (nope + rope + v) if name == "deepseek_v2" else kv_lora + rope
    if name == "deepseek_v32":
        index_heads, index_dim = (
            _int(config, "index_n_heads", 64),
            _int(config, "index_head_dim", 128),
        )
        attention += q_lora * index_heads * index_dim + h * index_dim + 2 * index_dim
        attention += h * index_heads
        per_token += 2 * index_dim
    cache = LayerCache(
        kind="latent" if name != "deepseek_v2" else "attention", token_elements=per_token
    )
    dense = _glu(h, _dense_size(config))
    moe = _moe(config, h, router_bias=name != "deepseek_v2")
    return [
        Layer(attention + (moe if _is_moe_layer(config, i, name) else dense) + 2 * h, cache)
        for i in range(d.n_layers)
    ]


def _gpt_oss(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Biased attention with sinks, every layer MoE (biased experts and router);
    "sliding_attention" layers keep `sliding_window` tokens (by default the
    layers alternate, sliding first)."""
    attention = _attention(d, qkv_bias=True, o_bias=True, sinks=True)
    moe = _moe(config, d.hidden, router_bias=True, expert_bias=True)
    types = _layer_types(config) or ["sliding_attention", "full_attention"] * (d.n_layers // 2)
    window = _int(config, "sliding_window", 128)
    return [
        Layer(
            attention + moe + 2 * d.hidden,
            _sliding(d, window)
            if i < len(types) and types[i] == "sliding_attention"
            else full_attention(d.n_kv_heads, d.head_dim),
        )
        for i in range(d.n_layers)
    ]


def _qwen3_next(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Every `full_attention_interval`-th layer is gated full attention, the rest
    Gated DeltaNet linear attention, whose cache is a convolution state (kernel - 1
    steps of q, k and v) and a float32 recurrent state (value heads x value dim x
    key dim)."""
    h = d.hidden
    nk, nv = _int(config, "linear_num_key_heads", 16), _int(config, "linear_num_value_heads", 64)
    dk, dv = _int(config, "linear_key_head_dim", 192), _int(config, "linear_value_head_dim", 128)
    kernel = _int(config, "linear_conv_kernel_dim", 4)
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    linear = h * (2 * key_dim + 2 * value_dim + 2 * nv) + conv_dim * kernel + 2 * nv + dv
    linear += value_dim * h
    bias = _flag(config, "attention_bias")
    full = _attention(d, q_gate=True, qkv_bias=bias, o_bias=bias, qk_norm=True)
    linear_cache = LayerCache(
        kind="recurrent",
        state_elements=(kernel - 1) * conv_dim,
        float32_state_elements=nv * dv * dk,
    )
    interval = max(1, _int(config, "full_attention_interval", 4))
    dense, moe = _glu(h, _dense_size(config)), _moe(config, h)
    layers: list[Layer] = []
    for i in range(d.n_layers):
        is_linear = (i + 1) % interval != 0
        is_moe = _is_moe_layer(config, i, name)
        mixer, cache = (
            (linear, linear_cache)
            if is_linear
            else (full, full_attention(d.n_kv_heads, d.head_dim))
        )
        layers.append(Layer(mixer + (moe if is_moe else dense) + 2 * h, cache))
    return layers


def _gemma3(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Attention with q/k norms, four norms per layer; every
    `sliding_window_pattern`-th layer global, the others keep `sliding_window`
    tokens."""
    params = _attention(d, qk_norm=True) + _glu(d.hidden, _dense_size(config)) + 4 * d.hidden
    pattern = max(1, _int(config, "sliding_window_pattern", 6))
    window = _int(config, "sliding_window", 512)
    return [
        Layer(
            params,
            _sliding(d, window)
            if (i + 1) % pattern != 0
            else full_attention(d.n_kv_heads, d.head_dim),
        )
        for i in range(d.n_layers)
    ]


# nemotron_h's block names, as `layers_block_type` / `layer_types` spell them.
_NEMOTRON_BLOCKS = {
    "full_attention": "*",
    "attention": "*",
    "linear_attention": "M",
    "mamba": "M",
    "conv": "M",
    "moe": "E",
    "mlp": "-",
}


def nemotron_pattern(config: Mapping[str, Any]) -> str:
    """nemotron_h's blocks, one character each: M Mamba-2, * attention, - MLP, E MoE."""
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        return pattern
    if isinstance(pattern, list):
        return "".join(str(c) for c in pattern)
    blocks = config.get("layers_block_type") or config.get("layer_types")
    if isinstance(blocks, list):
        return "".join(_NEMOTRON_BLOCKS.get(str(b), "?") for b in blocks)
    return ""


def _mamba2_mixer(
    config: Mapping[str, Any], h: int, *, heads_key: str, head_dim_key: str, bias_key: str
) -> Layer:
    """A Mamba-2 mixer (the keys name its heads, their width and its projections'
    bias): its cache is a convolution state (kernel - 1 steps of x, B and C) and a
    float32 SSM state (heads x head dim x state size)."""
    heads, head_dim = _int(config, heads_key), _int(config, head_dim_key)
    state = _int(config, "ssm_state_size") or _int(config, "state_size")
    groups, kernel = _int(config, "n_groups", 1), _int(config, "conv_kernel", 4)
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state
    projection = inner + conv_dim + heads
    bias = _flag(config, bias_key)
    params = h * projection + conv_dim * kernel + 3 * heads + inner + inner * h
    params += (projection + h if bias else 0) + (conv_dim if _flag(config, "use_conv_bias") else 0)
    cache = LayerCache(
        kind="recurrent",
        state_elements=(kernel - 1) * conv_dim,
        float32_state_elements=heads * head_dim * state,
    )
    return Layer(params, cache)


def _nemotron_h(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Blocks by `hybrid_override_pattern`: Mamba-2 (M), attention (*), a ReLU²
    MLP (-) or a MoE of ReLU² experts (E), each behind one norm. MLP and MoE
    blocks cache nothing."""
    h = d.hidden
    mlp_bias = _flag(config, "mlp_bias")

    def mlp(size: int) -> int:
        return 2 * h * size + (size + h if mlp_bias else 0)

    experts = _int(config, "n_routed_experts")
    latent = _int(config, "moe_latent_size")
    moe = experts * 2 * (latent or h) * _int(config, "moe_intermediate_size") + experts * (h + 1)
    if config.get("n_shared_experts") is not None:
        moe += mlp(_int(config, "moe_shared_expert_intermediate_size"))
    if latent:
        moe += 2 * h * latent + (latent + h if mlp_bias else 0)
    bias = _flag(config, "attention_bias")
    blocks = {
        "M": _mamba2_mixer(
            config,
            h,
            heads_key="mamba_num_heads",
            head_dim_key="mamba_head_dim",
            bias_key="mamba_proj_bias",
        ),
        "*": Layer(
            _attention(d, qkv_bias=bias, o_bias=bias), full_attention(d.n_kv_heads, d.head_dim)
        ),
        "-": Layer(mlp(_dense_size(config)), LayerCache(kind="none")),
        "E": Layer(moe, LayerCache(kind="none")),
    }
    layers = [blocks.get(block, blocks["-"]) for block in nemotron_pattern(config)[: d.n_layers]]
    return [Layer(layer.params + h, layer.cache) for layer in layers]


def _mamba(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    """Mamba blocks behind a norm; the cache is a convolution state and an SSM
    state (inner x state size), both in the activation dtype."""
    h = d.hidden
    inner, state = _int(config, "intermediate_size"), _int(config, "state_size")
    kernel = _int(config, "conv_kernel", 4)
    rank = _int(config, "time_step_rank") or math.ceil(h / 16)  # "auto"
    params = h + h * 2 * inner + inner * kernel + inner * (rank + 2 * state) + rank * inner
    params += inner + inner * state + inner + inner * h
    params += (2 * inner + h if _flag(config, "use_bias") else 0) + (
        inner if _flag(config, "use_conv_bias") else 0
    )
    cache = LayerCache(kind="recurrent", state_elements=(kernel - 1) * inner + inner * state)
    return [Layer(params, cache)] * d.n_layers


def _mamba2(config: Mapping[str, Any], d: Dims, name: str) -> list[Layer]:
    mixer = _mamba2_mixer(
        config, d.hidden, heads_key="num_heads", head_dim_key="head_dim", bias_key="use_bias"
    )
    return [Layer(mixer.params + d.hidden, mixer.cache)] * d.n_layers


_FAMILIES: dict[str, Callable[[Mapping[str, Any], Dims, str], list[Layer]]] = {
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek,
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_next,
    "gemma3_text": _gemma3,
    "nemotron_h": _nemotron_h,
    "mamba": _mamba,
    "mamba2": _mamba2,
}


def estimate_layers(config: Mapping[str, Any], text: Mapping[str, Any], d: Dims) -> Sequence[Layer]:
    """Each layer's parameters and cache. `config` names the model type; `text`
    holds the language model's settings (the config itself, or merged with a
    vision-language model's `text_config`)."""
    name = family(config)
    return _FAMILIES.get(name, _llama)(text, d, name)
