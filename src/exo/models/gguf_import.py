"""Import a llama-architecture GGUF file as an MLX model folder.

The result is what `mlx_lm.load` reads: `config.json`, `model.safetensors`
(affine-quantized triples kept as they are), `tokenizer.json` and
`tokenizer_config.json` with the chat template.

MLX reads and writes the tensors; it is imported only when a file is imported,
so a node starts without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    import mlx.core as mx

GGUF_GROUP_SIZE = 32
IMPORT_MARKER = "exo_import.json"
IMPORT_FORMAT = 1  # bump when the folder layout changes, so old imports are redone

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp pre-tokenizer names -> what runs before the GPT-2 byte-level regex.
_DIGITS = {"type": "Digits", "individual_digits": True}
_PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    "gpt-2": [],
    "gpt2": [],
    "smollm": [_DIGITS],
    "starcoder": [_DIGITS],
    "refact": [_DIGITS],
}
# llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TOKEN_TYPES = {2, 3, 4}


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (unsupported architecture or tensors)."""


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta.get(key)
    if value is None:
        return None
    import mlx.core as mx

    if isinstance(value, mx.array):
        return value.item()
    return value


def _hf_module_name(gguf_name: str) -> str:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`."""
    if gguf_name.startswith("blk."):
        _, layer, tensor = gguf_name.split(".", 2)
        if tensor not in _LAYER_TENSORS:
            raise GGUFImportError(f"unsupported tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_TENSORS[tensor]}"
    if gguf_name not in _GLOBAL_TENSORS:
        raise GGUFImportError(f"unsupported tensor {gguf_name!r}")
    return _GLOBAL_TENSORS[gguf_name]


def _unpermute_rope_rows(array: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> half-split RoPE).

    Rows are output features, so the same permutation applies to packed
    quantized weights, scales and biases alike.
    """
    rows = array.shape[0]
    rest = array.shape[1:]
    head_dim = rows // n_heads
    return array.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def convert_tensors(
    tensors: dict[str, mx.array], n_heads: int, n_kv_heads: int
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """Rename GGUF tensors to MLX/HF names; returns weights and per-module quantization."""
    weights: dict[str, mx.array] = {}
    quantization: dict[str, dict[str, int]] = {}
    for name, array in tensors.items():
        module_path, _, part = name.rpartition(".")
        module = _hf_module_name(module_path)
        if module_path.endswith("attn_q"):
            array = _unpermute_rope_rows(array, n_heads)
        elif module_path.endswith("attn_k"):
            array = _unpermute_rope_rows(array, n_kv_heads)
        weights[f"{module}.{part}"] = array
        if part == "scales":
            packed = tensors[f"{module_path}.weight"]
            in_features = array.shape[-1] * GGUF_GROUP_SIZE
            bits = packed.shape[-1] * 32 // in_features
            quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return weights, quantization


def _attention_heads(meta: dict[str, Any]) -> tuple[int, int]:
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    return n_heads, int(_scalar(meta, "llama.attention.head_count_kv") or n_heads)


def build_config(
    meta: dict[str, Any],
    weights: dict[str, mx.array],
    quantization: dict[str, dict[str, int]],
) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"architecture {arch!r} is not supported (only 'llama')")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    n_heads, n_kv_heads = _attention_heads(meta)
    vocab = len(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "head_dim": hidden // n_heads,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantization:
        # The most common setting is the default; others are per-module overrides.
        settings = [json.dumps(q, sort_keys=True) for q in quantization.values()]
        default = json.loads(max(set(settings), key=settings.count))
        per_module: dict[str, Any] = {m: q for m, q in quantization.items() if q != default}
        for name in weights:
            module, _, part = name.rpartition(".")
            if part == "weight" and module not in quantization and weights[name].ndim == 2:
                per_module[module] = False
        config["quantization"] = {**default, **per_module}
    return config


def build_tokenizer_files(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`tokenizer.json` and `tokenizer_config.json` for a GPT-2 style BPE vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(f"tokenizer model {model!r} is not supported (only 'gpt2' BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"].tolist()
    merges: list[str] = meta["tokenizer.ggml.merges"]
    specials = [i for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        # Another split than the one the model was trained with would degrade it quietly.
        raise GGUFImportError(
            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    pre_tokenizers: list[dict[str, Any]] = [*_PRE_TOKENIZERS[pre], byte_level]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": {**byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }

    def token_text(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[int(idx)] if idx is not None else None

    eos = token_text("tokenizer.ggml.eos_token_id")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": token_text("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_text("tokenizer.ggml.padding_token_id") or eos,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": meta.get("tokenizer.chat_template"),
        "additional_special_tokens": [tokens[i] for i in specials],
    }
    return tokenizer_json, tokenizer_config


def _import_digest(path: Path, generation_config: dict[str, Any] | None) -> str:
    """Identifies an import: the source file, its options and this importer's format."""
    stat = path.stat()
    options = json.dumps(generation_config or {}, sort_keys=True)
    key = f"{IMPORT_FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{options}"
    return hashlib.sha256(key.encode()).hexdigest()


def is_imported(
    model_dir: Path, gguf_path: Path, generation_config: dict[str, Any] | None = None
) -> bool:
    marker = model_dir / IMPORT_MARKER
    if not marker.exists() or not gguf_path.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text()).get("source_digest")
    except (OSError, json.JSONDecodeError):
        return False
    return recorded == _import_digest(gguf_path, generation_config)


def import_gguf(
    gguf_path: Path, model_dir: Path, generation_config: dict[str, Any] | None = None
) -> Path:
    """Import `gguf_path` into `model_dir`; idempotent and atomic (temp dir + rename).

    `generation_config` (sampling defaults such as temperature) is written as
    `generation_config.json`, as Hugging Face model folders do.
    """
    if is_imported(model_dir, gguf_path, generation_config):
        logger.info(f"model already imported at {model_dir}")
        return model_dir
    if not gguf_path.is_file():
        raise GGUFImportError(f"GGUF file not found: {gguf_path}")
    if model_dir.exists() and not (model_dir / IMPORT_MARKER).exists():
        raise GGUFImportError(
            f"{model_dir} exists and was not imported by exo; remove it or choose another model id"
        )
    logger.info(f"importing {gguf_path.name} into {model_dir}")
    import mlx.core as mx

    try:
        tensors, meta = mx.load(str(gguf_path), return_metadata=True)  # pyright: ignore[reportGeneralTypeIssues]
        assert isinstance(tensors, dict) and isinstance(meta, dict)
        weights, quantization = convert_tensors(tensors, *_attention_heads(meta))
        config = build_config(meta, weights, quantization)
        tokenizer_json, tokenizer_config = build_tokenizer_files(meta)
    except (ValueError, RuntimeError) as error:
        raise GGUFImportError(f"cannot read {gguf_path} as a GGUF model: {error}") from error
    except (KeyError, TypeError) as error:
        raise GGUFImportError(
            f"{gguf_path} lacks GGUF metadata this import needs: {error}"
        ) from error

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = model_dir.parent / f".{model_dir.name}.importing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        if generation_config:
            (staging / "generation_config.json").write_text(json.dumps(generation_config))
        (staging / IMPORT_MARKER).write_text(
            json.dumps(
                {
                    "source": gguf_path.name,
                    "source_digest": _import_digest(gguf_path, generation_config),
                }
            )
        )
        for f in staging.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(f"imported {config['num_hidden_layers']} layers into {model_dir}")
    return model_dir
