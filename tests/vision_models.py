"""Tiny random-weight vision-language models for tests.

`make_tiny_vision_model` writes one of `VISION_FAMILIES` as a Hugging Face
checkpoint of that family has it: a `config.json` with text and vision
configs, weights named as the hub's checkpoints name them (`language_model.*`,
`vision_tower.*`, `multi_modal_projector.*`, convolutions in PyTorch's layout),
the tokenizer of `tokenizer_source` with the family's special tokens added, a
chat template that renders image parts as the family does, and the processor
and image-processor configs. mlx-lm loads the folder as a text model (dropping
the vision weights), mlx-vlm loads it whole, and transformers' processors
expand an image marker in a prompt into the image tokens the vision tower's
features replace.

The language model is `tests/model_factory.py`'s tiny one of the family
(hidden 64, 2 layers); the vision tower has one layer and sees 32-pixel images
in 4-pixel patches, which the projector reduces to at most 16 image tokens.
The projector's weights are scaled so that the logits depend on the image."""

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from tests.model_factory import _random_weights, tiny_config

VISION_FAMILIES: tuple[str, ...] = ("gemma3", "mistral3")

_TEXT_LAYERS = 2
_IMAGE_SIZE = 32  # pixels a side: the processors resize every image to at most this
_PATCH = 4
_VISION_HIDDEN = 32
_VISION_HEADS = 2
_VISION_INTERMEDIATE = 64
_VISION_LAYERS = 1
_GEMMA3_IMAGE_TOKENS = 16  # the 8 x 8 patches average-pooled 2 x 2
_MISTRAL3_MERGE = 2  # mistral3 merges 2 x 2 patches into one token: 4 x 4 for a square image
# Room for the added special tokens: the vocabulary grows by this much.
_VOCAB_HEADROOM = 64
# Scales of the projectors' outputs, so that image features are about as large
# as the (scaled) text embeddings and two images give clearly different logits.
_PROJECTION_SCALE = 2.0

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Gemma 3's template, shortened: a system message joins the first user turn;
# an image part becomes the image marker.
_GEMMA3_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{ content | trim }}
{%- else -%}{%- for part in content -%}
{%- if part['type'] == 'image' -%}{{ '<start_of_image>' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = render(message['content']) + '\\n\\n' -%}
{%- else -%}
{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}
{{- ns.system + render(message['content']) + '<end_of_turn>\\n' -}}
{%- set ns.system = '' -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

# Mistral Small 3.1's template, shortened. As there, the prompt ends with
# `[/INST]` whether or not `add_generation_prompt` asks for more.
_MISTRAL3_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}
{%- if part['type'] == 'image' -%}{{ '[IMG]' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{{- '[SYSTEM_PROMPT]' + render(message['content']) + '[/SYSTEM_PROMPT]' -}}
{%- elif message['role'] == 'user' -%}
{{- '[INST]' + render(message['content']) + '[/INST]' -}}
{%- elif message['role'] == 'assistant' -%}
{{- render(message['content']) + eos_token -}}
{%- endif -%}
{%- endfor -%}
"""


@dataclass(frozen=True)
class _Family:
    text_family: str  # the `tests.model_factory` family of the language model
    architecture: str
    special_tokens: tuple[str, ...]  # added to the tokenizer, in this order
    image_marker: str  # what the chat template writes for an image
    image_token: str  # the token whose embeddings the image features replace
    chat_template: str
    end_of_turn: str  # a second end-of-sequence token ("" for none)
    processor_class: str
    # tokenizer_config.json entries the processor reads off the tokenizer
    tokenizer_tokens: dict[str, str]
    configs: Callable[[dict[str, Any], dict[str, int]], tuple[dict[str, Any], dict[str, Any]]]


def _gemma3_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json's family part and the files the processors read."""
    config: dict[str, Any] = {
        "text_config": {**text, "mm_tokens_per_image": _GEMMA3_IMAGE_TOKENS},
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": _VISION_HIDDEN,
            "intermediate_size": _VISION_INTERMEDIATE,
            "num_hidden_layers": _VISION_LAYERS,
            "num_attention_heads": _VISION_HEADS,
            "patch_size": _PATCH,
            "image_size": _IMAGE_SIZE,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
            "vision_use_head": False,
        },
        "mm_tokens_per_image": _GEMMA3_IMAGE_TOKENS,
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"],
        # mlx-vlm divides image features by the square root of this (and the
        # language model multiplies all embeddings by that of the text's).
        "hidden_size": text["hidden_size"],
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    }
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": _GEMMA3_IMAGE_TOKENS}
    image_processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE},
        "do_resize": True,
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": None,
        "do_pan_and_scan": None,
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "image_seq_length": _GEMMA3_IMAGE_TOKENS,
    }
    return config, {"processor_config.json": processor, "preprocessor_config.json": image_processor}


def _mistral3_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    config: dict[str, Any] = {
        "text_config": text,
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": _VISION_HIDDEN,
            "intermediate_size": _VISION_INTERMEDIATE,
            "num_hidden_layers": _VISION_LAYERS,
            "num_attention_heads": _VISION_HEADS,
            "head_dim": _VISION_HIDDEN // _VISION_HEADS,
            "patch_size": _PATCH,
            "image_size": _IMAGE_SIZE,
            "num_channels": 3,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
        },
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": _MISTRAL3_MERGE,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": False,
        "vision_feature_layer": -1,
    }
    processor = {
        "processor_class": "PixtralProcessor",
        "patch_size": _PATCH,
        "spatial_merge_size": _MISTRAL3_MERGE,
        "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
    }
    image_processor = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "patch_size": {"height": _PATCH, "width": _PATCH},
        "size": {"longest_edge": _IMAGE_SIZE},
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
    }
    return config, {"processor_config.json": processor, "preprocessor_config.json": image_processor}


_FAMILIES: dict[str, _Family] = {
    "gemma3": _Family(
        text_family="gemma3_text",
        architecture="Gemma3ForConditionalGeneration",
        special_tokens=(
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ),
        image_marker="<start_of_image>",
        image_token="<image_soft_token>",
        chat_template=_GEMMA3_TEMPLATE,
        end_of_turn="<end_of_turn>",
        processor_class="Gemma3Processor",
        # Gemma3Processor reads `tokenizer.boi_token`, `image_token_id` ...
        tokenizer_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        configs=_gemma3_configs,
    ),
    "mistral3": _Family(
        text_family="mistral",
        architecture="Mistral3ForConditionalGeneration",
        special_tokens=(
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[IMG]",
            "[IMG_BREAK]",
            "[IMG_END]",
        ),
        image_marker="[IMG]",
        image_token="[IMG]",
        chat_template=_MISTRAL3_TEMPLATE,
        end_of_turn="",
        processor_class="PixtralProcessor",
        tokenizer_tokens={},
        configs=_mistral3_configs,
    ),
}


def image_marker(family: str) -> str:
    """What `family`'s chat template writes for an image part."""
    return _family(family).image_marker


def image_token(family: str) -> str:
    """The token of `family` whose embeddings the image features replace."""
    return _family(family).image_token


def make_tiny_vision_model(
    family: str, target: Path, tokenizer_source: Path, seed: int = 0
) -> Path:
    """A random-weight vision-language model of `family` (one of
    `VISION_FAMILIES`) using `tokenizer_source`'s tokenizer, written to
    `target` as the family's Hugging Face checkpoints are."""
    spec = _family(family)
    target.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(target, tokenizer_source, spec)
    vocab_size = _vocab_size(tokenizer_source)
    text = tiny_config(spec.text_family, tokenizer_source, _TEXT_LAYERS)
    del text["architectures"]
    text["vocab_size"] = vocab_size
    config_part, processor_files = spec.configs(text, ids)
    eos = [text["eos_token_id"]] + ([ids[spec.end_of_turn]] if spec.end_of_turn else [])
    config: dict[str, Any] = {
        "model_type": family,
        "architectures": [spec.architecture],
        **config_part,
        "vocab_size": vocab_size,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    weights = {
        f"language_model.{name}": array
        for name, array in _random_weights(text, seed, varied=True).items()
    }
    weights.update(_vision_weights(family, config, seed))
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name, content in processor_files.items():
        (target / name).write_text(json.dumps(content, indent=2))
    (target / "chat_template.jinja").write_text(spec.chat_template)
    return target


def _family(family: str) -> _Family:
    if family not in _FAMILIES:
        raise ValueError(f"no tiny {family!r}: choose one of {', '.join(VISION_FAMILIES)}")
    return _FAMILIES[family]


def _vocab_size(tokenizer_source: Path) -> int:
    source = json.loads((tokenizer_source / "config.json").read_text())
    return int(source["vocab_size"]) + _VOCAB_HEADROOM


def _write_tokenizer(target: Path, source: Path, spec: _Family) -> dict[str, int]:
    """Writes `source`'s tokenizer with `spec`'s special tokens added after its
    vocabulary; returns their ids."""
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    added: list[dict[str, Any]] = tokenizer["added_tokens"]
    next_id = 1 + max(max(tokenizer["model"]["vocab"].values()), *(token["id"] for token in added))
    ids: dict[str, int] = {}
    for offset, content in enumerate(spec.special_tokens):
        ids[content] = next_id + offset
        added.append(
            {
                "id": next_id + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    if next_id + len(ids) > _vocab_size(source):
        raise ValueError("the added tokens overflow the vocabulary's headroom")
    (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))

    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    key = (
        "extra_special_tokens"
        if isinstance(tokenizer_config.get("extra_special_tokens"), list)
        else "additional_special_tokens"
    )
    tokenizer_config[key] = [*tokenizer_config.get(key, []), *spec.special_tokens]
    tokenizer_config["chat_template"] = spec.chat_template
    tokenizer_config["processor_class"] = spec.processor_class
    tokenizer_config.update(spec.tokenizer_tokens)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return ids


def _vision_weights(family: str, config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """The vision tower's and projector's parameters of mlx-vlm's model built
    from `config`, varied and named as in the family's hub checkpoints."""
    module: Any = importlib.import_module(f"mlx_vlm.models.{family}")
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed + 1)
    model: nn.Module = module.Model(model_config)
    weights: dict[str, mx.array] = {}
    parameters: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    for name, array in parameters.items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        array = _vary_vision(name, array)
        if array.ndim == 4:  # convolutions: MLX's (out, h, w, in) to PyTorch's (out, in, h, w)
            array = array.transpose(0, 3, 1, 2)
        if family == "mistral3":  # the hub's names, which mlx-vlm's sanitize maps back
            name = name.replace("vision_tower.vision_model.", "vision_tower.")
        weights[name] = array
    mx.eval(weights)
    return weights


def _vary_vision(name: str, array: mx.array) -> mx.array:
    if name.endswith("mm_input_projection_weight"):  # gemma3's projection (all ones)
        return mx.random.normal(array.shape) * _PROJECTION_SCALE * array.shape[0] ** -0.5
    if name.endswith("linear_2.weight"):  # mistral3's projector's output
        return mx.random.normal(array.shape) * _PROJECTION_SCALE * array.shape[1] ** -0.5
    if bool(mx.all(array == array.reshape(-1)[0]).item()):
        # Norms (1) and biases (0), made to vary so that a weight not loaded shows
        return array + 0.1 * mx.random.normal(array.shape)
    return array
