"""Which part of a model a weight belongs to, by its name: a layer, the input
side (embedding, and a vision model's image side) or the output side (final
norm, head). Placement and downloads
pick a rank's files by it; a pipeline rank picks the weights it holds."""

import re
from typing import Literal

# `model.layers.N.` and the prefixes vision-language and SSM models put before it.
_LAYER_TENSOR = re.compile(
    r"^(?:model\.|language_model\.model\.|model\.language_model\.|backbone\.)?layers\.(\d+)\."
)
# A vision-language model's image side: read with the input (a first rank's).
_VISION_TENSOR = re.compile(
    r"^(?:model\.)?(?:vision_tower|vision_model|visual|multi_modal_projector|mm_projector)\."
)
# Non-layer tensors used after the last layer: final norm and output head.
_HEAD_TENSOR = re.compile(r"(?:^|\.)(?:norm|norm_f|final_layernorm|ln_f|lm_head|output)(?:\.|$)")

ModelPart = int | Literal["embedding", "head", "unused"]


def tensor_part(name: str, n_layers: int) -> ModelPart:
    """The layer index, or the non-layer part, a tensor belongs to. Layers past
    `n_layers` (e.g. multi-token-prediction layers) are not loaded: "unused"."""
    if _VISION_TENSOR.match(name):
        return "embedding"
    match = _LAYER_TENSOR.match(name)
    if match:
        layer = int(match.group(1))
        return layer if layer < n_layers else "unused"
    if "embed" not in name and _HEAD_TENSOR.search(name):
        return "head"
    return "embedding"
