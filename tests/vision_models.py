"""Tiny random-weight vision-language models for tests.

`make_tiny_vision_model` writes one of `VISION_FAMILIES` (or of
`MORE_VISION_FAMILIES`) as a Hugging Face checkpoint of that family has it: a
`config.json` with text and vision configs (Qwen2-VL's and Qwen2.5-VL's with
the text parameters at its top level), weights named as the hub's checkpoints
name them (`language_model.*`, `vision_tower.*`, `multi_modal_projector.*`;
Qwen2-VL's and Qwen2.5-VL's `model.*`, `visual.*`; Qwen3-VL's and its MoE's
`model.language_model.*`, `model.visual.*`, the MoE's experts fused as
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`), convolutions in
PyTorch's layout,
the tokenizer of `tokenizer_source` with the family's special tokens added
(those it already has, such as SmolLM2's `<|im_start|>` and `<|im_end|>`, kept
where they are), a chat template that renders image parts as the family does,
and the processor and image-processor configs. mlx-lm loads the folder as a
text model (dropping the vision weights), mlx-vlm loads it whole, and the
processors expand an image marker in a prompt into the image tokens the vision
tower's features replace.

The language model is `tests/model_factory.py`'s tiny one of the family
(hidden 64, 2 layers; the Qwen families' with M-RoPE sections [2, 3, 3]); the
vision tower has one layer and sees 32-pixel images in 4-pixel patches, which
the projector reduces to at most 16 image tokens (the Qwen families resize an
image to at most 32 x 32 pixels keeping its aspect, then merge 2 x 2 patches
into a token). The projector's weights are scaled so that the logits depend on
the image."""

import copy
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

VISION_FAMILIES: tuple[str, ...] = ("gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl")
# Families `make_tiny_vision_model` builds too but that `VISION_FAMILIES`'s
# (many, slow) parametrized tests leave out: Qwen2-VL and Qwen3-VL's MoE.
MORE_VISION_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen3_vl_moe")

_TEXT_LAYERS = 2
_IMAGE_SIZE = 32  # pixels a side: the processors resize every image to at most this
_PATCH = 4
_VISION_HIDDEN = 32
_VISION_HEADS = 2
_VISION_INTERMEDIATE = 64
_VISION_LAYERS = 1
_GEMMA3_IMAGE_TOKENS = 16  # the 8 x 8 patches average-pooled 2 x 2
_MISTRAL3_MERGE = 2  # mistral3 merges 2 x 2 patches into one token: 4 x 4 for a square image
# The Qwen families: a Conv3d over 2 frames (an image is repeated) of 4 x 4
# patches, 2 x 2 patches merged into one token. The image processor resizes an
# image to multiples of 8 pixels a side between these many pixels: a 40 x 32
# one to 32 x 24 (3 x 4 tokens), none to more than 16 tokens.
_QWEN_MERGE = 2
_QWEN_TEMPORAL_PATCH = 2
_QWEN_MIN_PIXELS = 4 * (_PATCH * _QWEN_MERGE) ** 2
_QWEN_MAX_PIXELS = _IMAGE_SIZE * _IMAGE_SIZE
# M-RoPE: the rotary frequencies of head_dim / 2 = 8 split between the
# temporal, height and width positions.
_QWEN_MROPE_SECTION = (2, 3, 3)
# Qwen2.5-VL's window attention: windows of 16 pixels (2 x 2 tokens); with one
# block, that block attends the whole image (as Qwen's full-attention blocks do).
_QWEN2_5_VL_WINDOW = 16
# Qwen3-VL's learned position embeddings, a square grid interpolated to the image's
_QWEN3_VL_POSITION_EMBEDDINGS = 64
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


# Qwen2.5-VL's and Qwen3-VL's template (ChatML), shortened: no default system
# message, no tools, no videos' or pictures' numbering.
_QWEN_VL_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}
{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""


def _as_they_are(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return weights


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
    # The hub's names of the language model's weights (given mlx-lm's) and of
    # the vision tower's and projector's (given mlx-vlm's)
    text_weight_name: Callable[[str], str]
    vision_weight_name: Callable[[str], str]
    # The language model's weights (named as mlx-lm's) in the hub's layout
    # where it differs (Qwen3-VL-MoE's fused experts)
    text_weights: Callable[[dict[str, mx.array]], dict[str, mx.array]] = _as_they_are


def _under_language_model(name: str) -> str:
    return f"language_model.{name}"


def _as_named(name: str) -> str:
    return name


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


def _qwen_vl_processor_files(processor_class: str) -> dict[str, Any]:
    """The image processor's config (and the video processor's, as Qwen3-VL
    has one): what mlx-vlm's Qwen processors and transformers' read. The
    pixel bounds are given both ways checkpoints give them (`min_pixels` and
    `max_pixels`, Qwen2.5-VL's; `size`, Qwen3-VL's)."""
    common = {
        "patch_size": _PATCH,
        "temporal_patch_size": _QWEN_TEMPORAL_PATCH,
        "merge_size": _QWEN_MERGE,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "processor_class": processor_class,
    }
    files: dict[str, Any] = {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            **common,
            "min_pixels": _QWEN_MIN_PIXELS,
            "max_pixels": _QWEN_MAX_PIXELS,
            "size": {"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": _QWEN_MAX_PIXELS},
        }
    }
    if processor_class == "Qwen3VLProcessor":
        files["video_preprocessor_config.json"] = {
            "video_processor_type": "Qwen3VLVideoProcessor",
            **common,
            # a frame's pixels times the frames of a temporal patch
            "size": {
                "shortest_edge": _QWEN_MIN_PIXELS * _QWEN_TEMPORAL_PATCH,
                "longest_edge": _QWEN_MAX_PIXELS * _QWEN_TEMPORAL_PATCH,
            },
            "fps": 2.0,
            "min_frames": 2,
            "max_frames": 8,
        }
    return files


def _qwen_vl_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen2_5_vl_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2.5-VL's config.json has the text parameters at its top level (and
    mlx-vlm copies them into its text config, mlx-lm reads them there)."""
    flat = {name: value for name, value in text.items() if name != "model_type"}
    config: dict[str, Any] = {
        **flat,
        "rope_scaling": {"type": "mrope", "mrope_section": list(_QWEN_MROPE_SECTION)},
        "vision_config": {
            "depth": _VISION_LAYERS,
            "hidden_size": _VISION_HIDDEN,
            "intermediate_size": _VISION_INTERMEDIATE,
            "num_heads": _VISION_HEADS,
            "hidden_act": "silu",
            "in_chans": 3,
            "out_hidden_size": text["hidden_size"],
            "patch_size": _PATCH,
            "spatial_patch_size": _PATCH,
            "spatial_merge_size": _QWEN_MERGE,
            "temporal_patch_size": _QWEN_TEMPORAL_PATCH,
            "window_size": _QWEN2_5_VL_WINDOW,
            "fullatt_block_indexes": list(range(_VISION_LAYERS)),
            "tokens_per_second": 2,
        },
        **_qwen_vl_token_ids(ids),
    }
    return config, _qwen_vl_processor_files("Qwen2_5_VLProcessor")


def _qwen2_vl_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2-VL's config.json, as Qwen2-VL-2B-Instruct's: the text parameters
    at its top level, as Qwen2.5-VL's; a vision tower of its own, with no
    window attention, sized by `embed_dim` and `mlp_ratio`, whose merger gives
    `hidden_size` (the language model's) features."""
    flat = {name: value for name, value in text.items() if name != "model_type"}
    config: dict[str, Any] = {
        **flat,
        "rope_scaling": {"type": "mrope", "mrope_section": list(_QWEN_MROPE_SECTION)},
        "vision_config": {
            "depth": _VISION_LAYERS,
            "embed_dim": _VISION_HIDDEN,
            "mlp_ratio": _VISION_INTERMEDIATE // _VISION_HIDDEN,
            "num_heads": _VISION_HEADS,
            "in_chans": 3,
            "hidden_size": text["hidden_size"],
            "patch_size": _PATCH,
            "spatial_merge_size": _QWEN_MERGE,
            "spatial_patch_size": _PATCH,
            "temporal_patch_size": _QWEN_TEMPORAL_PATCH,
        },
        **_qwen_vl_token_ids(ids),
    }
    return config, _qwen_vl_processor_files("Qwen2VLProcessor")


def _qwen3_vl_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    return _qwen3_vl_family_configs("qwen3_vl", text, ids)


def _qwen3_vl_moe_configs(
    text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """As Qwen3-VL's, the text config (`qwen3_moe`'s parameters) and the vision
    config named for the MoE, as Qwen3-VL-30B-A3B's are."""
    return _qwen3_vl_family_configs("qwen3_vl_moe", text, ids)


def _qwen3_vl_family_configs(
    family: str, text: dict[str, Any], ids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    config: dict[str, Any] = {
        "text_config": {
            **text,
            "model_type": f"{family}_text",
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": list(_QWEN_MROPE_SECTION),
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "model_type": family,
            "depth": _VISION_LAYERS,
            "hidden_size": _VISION_HIDDEN,
            "intermediate_size": _VISION_INTERMEDIATE,
            "num_heads": _VISION_HEADS,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "out_hidden_size": text["hidden_size"],
            "patch_size": _PATCH,
            "spatial_merge_size": _QWEN_MERGE,
            "temporal_patch_size": _QWEN_TEMPORAL_PATCH,
            "num_position_embeddings": _QWEN3_VL_POSITION_EMBEDDINGS,
            # One deepstack merger: its features are added to the image
            # tokens' hidden states after the first text layer.
            "deepstack_visual_indexes": [0],
        },
        "tie_word_embeddings": text["tie_word_embeddings"],
        **_qwen_vl_token_ids(ids),
    }
    return config, _qwen_vl_processor_files("Qwen3VLProcessor")


def _qwen3_vl_text_name(name: str) -> str:
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


def _fused_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's experts' projections (`switch_mlp.{gate,up,down}_proj.weight`,
    each `(experts, out, in)`) as Qwen3-VL-MoE's checkpoints store them:
    `experts.gate_up_proj` `(experts, hidden, 2 * intermediate)`, the gate's
    columns first, and `experts.down_proj` `(experts, intermediate, hidden)`."""
    fused: dict[str, mx.array] = {}
    for name, array in weights.items():
        if ".switch_mlp." not in name:
            fused[name] = array
            continue
        prefix, projection = name.removesuffix(".weight").split(".switch_mlp.")
        # (up_proj goes in with gate_proj)
        if projection == "down_proj":
            fused[f"{prefix}.experts.down_proj"] = array.swapaxes(1, 2)
        elif projection == "gate_proj":
            up = weights[f"{prefix}.switch_mlp.up_proj.weight"]
            fused[f"{prefix}.experts.gate_up_proj"] = mx.concatenate(
                [array.swapaxes(1, 2), up.swapaxes(1, 2)], axis=2
            )
    return fused


def _named_as_prefix(prefix: str) -> Callable[[str], str]:
    """mlx-vlm's `vision_tower.*` as `prefix*`."""
    return lambda name: prefix + name.removeprefix("vision_tower.")


_QWEN_VL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _qwen_vl(**family: Any) -> _Family:
    """A Qwen-VL family: ChatML with Qwen's vision tokens, `<|image_pad|>` its
    image marker and token."""
    return _Family(
        special_tokens=_QWEN_VL_TOKENS,
        image_marker="<|image_pad|>",
        image_token="<|image_pad|>",
        chat_template=_QWEN_VL_TEMPLATE,
        end_of_turn="<|im_end|>",
        tokenizer_tokens={},
        **family,
    )


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
        text_weight_name=_under_language_model,
        vision_weight_name=_as_named,
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
        text_weight_name=_under_language_model,
        # the hub's names, which mlx-vlm's sanitize maps back
        vision_weight_name=lambda name: name.replace("vision_tower.vision_model.", "vision_tower."),
    ),
    "qwen2_5_vl": _qwen_vl(
        text_family="qwen2",
        architecture="Qwen2_5_VLForConditionalGeneration",
        processor_class="Qwen2_5_VLProcessor",
        configs=_qwen2_5_vl_configs,
        text_weight_name=_as_named,  # model.*, lm_head.*
        vision_weight_name=_named_as_prefix("visual."),
    ),
    "qwen3_vl": _qwen_vl(
        text_family="qwen3",
        architecture="Qwen3VLForConditionalGeneration",
        processor_class="Qwen3VLProcessor",
        configs=_qwen3_vl_configs,
        text_weight_name=_qwen3_vl_text_name,  # model.language_model.*, lm_head.*
        vision_weight_name=_named_as_prefix("model.visual."),
    ),
    "qwen2_vl": _qwen_vl(
        text_family="qwen2",
        architecture="Qwen2VLForConditionalGeneration",
        processor_class="Qwen2VLProcessor",
        configs=_qwen2_vl_configs,
        # Qwen2-VL-2B-Instruct's names: model.*, visual.* (tied: no lm_head.*).
        # (Checkpoints saved by newer transformers nest them as Qwen3-VL's,
        # which mlx-lm reads but mlx-vlm's qwen2_vl sanitize does not.)
        text_weight_name=_as_named,
        vision_weight_name=_named_as_prefix("visual."),
    ),
    "qwen3_vl_moe": _qwen_vl(
        text_family="qwen3_moe",
        architecture="Qwen3VLMoeForConditionalGeneration",
        processor_class="Qwen3VLProcessor",
        configs=_qwen3_vl_moe_configs,
        text_weight_name=_qwen3_vl_text_name,  # model.language_model.*, lm_head.*
        vision_weight_name=_named_as_prefix("model.visual."),
        text_weights=_fused_experts,  # mlp.experts.gate_up_proj, mlp.experts.down_proj
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
    `VISION_FAMILIES` or `MORE_VISION_FAMILIES`) using `tokenizer_source`'s tokenizer, written to
    `target` as the family's Hugging Face checkpoints are."""
    spec = _family(family)
    target.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(target, tokenizer_source, spec)
    vocab_size = _vocab_size(tokenizer_source)
    text = tiny_config(spec.text_family, tokenizer_source, _TEXT_LAYERS)
    del text["architectures"]
    text["vocab_size"] = vocab_size
    config_part, processor_files = spec.configs(text, ids)
    # (SmolLM2's end of sequence is `<|im_end|>` already: Qwen's second is the first)
    eos = list(
        dict.fromkeys(
            [text["eos_token_id"], *([ids[spec.end_of_turn]] if spec.end_of_turn else [])]
        )
    )
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
        spec.text_weight_name(name): array
        for name, array in spec.text_weights(_random_weights(text, seed, varied=True)).items()
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
        families = ", ".join((*VISION_FAMILIES, *MORE_VISION_FAMILIES))
        raise ValueError(f"no tiny {family!r}: choose one of {families}")
    return _FAMILIES[family]


def _vocab_size(tokenizer_source: Path) -> int:
    source = json.loads((tokenizer_source / "config.json").read_text())
    return int(source["vocab_size"]) + _VOCAB_HEADROOM


def _write_tokenizer(target: Path, source: Path, spec: _Family) -> dict[str, int]:
    """Writes `source`'s tokenizer with `spec`'s special tokens added after its
    vocabulary (those it has already kept where they are); returns their ids."""
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    added: list[dict[str, Any]] = tokenizer["added_tokens"]
    existing = {token["content"]: token["id"] for token in added}
    next_id = 1 + max(max(tokenizer["model"]["vocab"].values()), *existing.values())
    ids: dict[str, int] = {}
    new: list[str] = []
    for content in spec.special_tokens:
        if content in existing:
            ids[content] = existing[content]
            continue
        ids[content] = next_id + len(new)
        new.append(content)
        added.append(
            {
                "id": ids[content],
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    if next_id + len(new) > _vocab_size(source):
        raise ValueError("the added tokens overflow the vocabulary's headroom")
    (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))

    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    key = (
        "extra_special_tokens"
        if isinstance(tokenizer_config.get("extra_special_tokens"), list)
        else "additional_special_tokens"
    )
    tokenizer_config[key] = [*tokenizer_config.get(key, []), *new]
    tokenizer_config["chat_template"] = spec.chat_template
    tokenizer_config["processor_class"] = spec.processor_class
    tokenizer_config.update(spec.tokenizer_tokens)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return ids


def _vision_weights(family: str, config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """The vision tower's and projector's parameters of mlx-vlm's model built
    from `config` (as `mlx_vlm.utils.load_model` builds it), varied and named
    as in the family's hub checkpoints."""
    module: Any = importlib.import_module(f"mlx_vlm.models.{family}")
    # A copy: the configs' `from_dict`s change the dictionaries they are given
    # (Qwen2.5-VL's adds a `text_config`, Qwen3-VL's renames `rope_type`).
    params = copy.deepcopy(config)
    params.setdefault("text_config", {})
    params.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(params)
    model_config.text_config = module.TextConfig.from_dict(params["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(params["vision_config"])
    mx.random.seed(seed + 1)
    model: nn.Module = module.Model(model_config)
    spec = _family(family)
    weights: dict[str, mx.array] = {}
    parameters: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    for name, array in parameters.items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        array = _vary_vision(name, array)
        if array.ndim == 4:  # convolutions: MLX's (out, h, w, in) to PyTorch's (out, in, h, w)
            array = array.transpose(0, 3, 1, 2)
        elif array.ndim == 5:  # Qwen's Conv3d: (out, t, h, w, in) to (out, in, t, h, w)
            array = array.transpose(0, 4, 1, 2, 3)
        weights[spec.vision_weight_name(name)] = array
    mx.eval(weights)
    return weights


def _vary_vision(name: str, array: mx.array) -> mx.array:
    if name.endswith("mm_input_projection_weight"):  # gemma3's projection (all ones)
        return mx.random.normal(array.shape) * _PROJECTION_SCALE * array.shape[0] ** -0.5
    if name.endswith("linear_2.weight") or (  # mistral3's projector's output
        # The Qwen families' mergers' outputs (Qwen3-VL's deepstack ones too)
        "merger" in name and name.endswith(("mlp.2.weight", "linear_fc2.weight"))
    ):
        return mx.random.normal(array.shape) * _PROJECTION_SCALE * array.shape[1] ** -0.5
    if bool(mx.all(array == array.reshape(-1)[0]).item()):
        # Norms (1) and biases (0), made to vary so that a weight not loaded shows
        return array + 0.1 * mx.random.normal(array.shape)
    return array
