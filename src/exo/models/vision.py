"""Vision-language models on the node: which families take images, and turning a
rendered prompt with images into token ids (the node imports neither MLX nor
torch, so it expands each image marker the chat template wrote into the image's
placeholder tokens itself, as the family's processor does; the runner checks
its count against the features mlx-vlm's processor and vision tower make).

A family takes images where mlx-lm serves its language model, which reads the
image features as input embeddings (`engine/mlx/vision.py` runs mlx-vlm's
vision tower and projector and hands the embeddings to the mlx-lm model).
Qwen2-VL / Qwen2.5-VL / Qwen3-VL also place an image's tokens at 2-D positions
(M-RoPE): the node sends each image's grid of tokens with it, and the runner
computes their positions (`engine/image_positions.py`).
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL.Image import Image

from exo.models.chat_tokenizer import ChatTokenizer
from exo.shared.prompt_images import (
    IMAGE_MARKERS,
    VISION_FAMILIES,
    PromptImage,
    image_key,
    image_placeholder,
    vision_family,
)


@dataclass(frozen=True)
class Picture:
    """An image of a request, decoded: its pixels (RGB), their digest, and the
    file as sent (what a runner is given)."""

    image: Image
    digest: str
    data: bytes


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class _Gemma3:
    """A fixed number of soft tokens between begin and end markers, set apart
    by blank lines (transformers' and mlx-vlm's Gemma3Processor)."""

    def __init__(self, model_dir: Path) -> None:
        config = _json(model_dir / "config.json")
        processor = _json(model_dir / "processor_config.json")
        preprocessor = _json(model_dir / "preprocessor_config.json")
        if preprocessor.get("do_pan_and_scan"):
            raise ValueError("pan-and-scan image crops (do_pan_and_scan) are not supported")
        self._count = int(processor.get("image_seq_length", config.get("mm_tokens_per_image", 256)))

    def expansion(self, image: Image) -> tuple[str, int]:
        soft = "<image_soft_token>" * self._count
        return f"\n\n<start_of_image>{soft}<end_of_image>\n\n", self._count


class _Mistral3:
    """Rows of image tokens, each but the last ended by a break token, the last
    by an end token; the image is scaled down to fit the longest edge, in whole
    patches (transformers' Pixtral image processor, mlx-vlm's Mistral3Processor)."""

    def __init__(self, model_dir: Path) -> None:
        processor = _json(model_dir / "processor_config.json")
        preprocessor = _json(model_dir / "preprocessor_config.json")
        self._patch = int(processor.get("patch_size", 16)) * int(
            processor.get("spatial_merge_size", 1)
        )
        self._longest = int(preprocessor.get("size", {}).get("longest_edge", 1024))
        self._token = str(processor.get("image_token", "[IMG]"))
        self._break = str(processor.get("image_break_token", "[IMG_BREAK]"))
        self._end = str(processor.get("image_end_token", "[IMG_END]"))

    def expansion(self, image: Image) -> tuple[str, int]:
        width, height = image.size
        ratio = max(height / self._longest, width / self._longest)
        if ratio > 1:
            height, width = int(height // ratio), int(width // ratio)
        rows, columns = (height - 1) // self._patch + 1, (width - 1) // self._patch + 1
        text = self._break.join(self._token * columns for _ in range(rows)) + self._end
        return text, rows * columns


class _QwenVL:
    """The image resized to whole merged patches within the pixel bounds
    (`smart_resize` of transformers' and mlx-vlm's Qwen-VL image processors),
    one token per merged patch: `rows x columns` copies of the image token."""

    def __init__(self, model_dir: Path, family: str) -> None:
        raw = _json(model_dir / "preprocessor_config.json")
        raw.update(_json(model_dir / "processor_config.json").get("image_processor") or {})
        # mlx-vlm's defaults (its processors read these keys, in this order).
        patch = int(raw.get("patch_size", 16 if family.startswith("qwen3") else 14))
        self._merge = int(raw.get("merge_size", 2))
        self._factor = patch * self._merge
        size = raw.get("size") or {}
        self._min_pixels = int(raw.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self._max_pixels = int(
            raw.get("max_pixels") or size.get("longest_edge") or 14 * 14 * 4 * 1280
        )

    def grid(self, image: Image) -> tuple[int, int]:
        """(rows, columns) of the image's tokens."""
        width, height = image.size
        if max(height, width) / min(height, width) > 200:
            raise ValueError(
                f"an image of {width} x {height} pixels is too narrow: its sides' ratio "
                "must be under 200"
            )
        factor = self._factor
        rows, columns = round(height / factor), round(width / factor)
        if rows * columns * factor * factor > self._max_pixels:
            beta = math.sqrt(height * width / self._max_pixels)
            rows = max(1, math.floor(height / beta / factor))
            columns = max(1, math.floor(width / beta / factor))
        elif rows * columns * factor * factor < self._min_pixels:
            beta = math.sqrt(self._min_pixels / (height * width))
            rows, columns = math.ceil(height * beta / factor), math.ceil(width * beta / factor)
        return rows, columns

    def expansion(self, image: Image) -> tuple[str, int]:
        rows, columns = self.grid(image)
        return "<|image_pad|>" * (rows * columns), rows * columns


class ImagePrompts:
    """A vision model's image side on the node: a rendered prompt with images
    becomes token ids, each image's placeholders written as its image key."""

    def __init__(self, model_dir: Path, tokenizer: ChatTokenizer) -> None:
        config = _json(model_dir / "config.json")
        family = vision_family(config)
        if family is None:
            raise ValueError(f"{model_dir.name} is not a vision model exo gives images to")
        self.family = family
        self._marker = IMAGE_MARKERS[family]
        self._expand: _Gemma3 | _Mistral3 | _QwenVL
        if family == "gemma3":
            self._expand = _Gemma3(model_dir)
        elif family == "mistral3":
            self._expand = _Mistral3(model_dir)
        else:
            self._expand = _QwenVL(model_dir, family)
        self._placeholder = image_placeholder(config)
        self._tokenizer = tokenizer

    def tokens(self, text: str, pictures: Sequence[Picture]) -> tuple[list[int], list[PromptImage]]:
        """`text` (rendered by the chat template: one image marker per picture,
        in order) as token ids with the pictures' spans."""
        pieces = text.split(self._marker)
        if len(pieces) - 1 != len(pictures):
            raise ValueError(
                f"the chat template placed {len(pieces) - 1} images for {len(pictures)} sent"
            )
        expanded, counts = [pieces[0]], []
        for picture, after in zip(pictures, pieces[1:], strict=True):
            expansion, count = self._expand.expansion(picture.image)
            expanded += [expansion, after]
            counts.append(count)
        ids = list(self._tokenizer.encode("".join(expanded), add_special_tokens=False))
        positions = [i for i, token in enumerate(ids) if token == self._placeholder]
        if len(positions) != sum(counts):
            raise ValueError("the prompt's text holds image tokens of its own")
        images: list[PromptImage] = []
        taken = 0
        for picture, count in zip(pictures, counts, strict=True):
            mine = positions[taken : taken + count]
            for position in mine:
                ids[position] = image_key(picture.digest)
            grid = self._expand.grid(picture.image) if isinstance(self._expand, _QwenVL) else None
            images.append(
                PromptImage(
                    data=picture.data,
                    digest=picture.digest,
                    start=mine[0],
                    end=mine[-1] + 1,
                    grid=grid,
                )
            )
            taken += count
        return ids, images


def image_prompts_for(
    model_dir: Path,
    model: str,
    tokenizer: ChatTokenizer,
    sharding: str | None,
    first_rank_layers: int | None = None,
) -> ImagePrompts | str:
    """What reads a served model's images, or why it cannot take any.
    `sharding`: how its instance is split ("pipeline", "tensor"; None: whole);
    `first_rank_layers`: how many layers a pipeline's first rank holds."""
    config = json.loads((model_dir / "config.json").read_text())
    if "vision_config" not in config:
        return f"{model} reads text only (it has no vision tower): send it no images"
    if vision_family(config) is None:
        families = ", ".join(VISION_FAMILIES.values())
        return (
            f"{model} has a vision tower, but exo gives images only to these families: {families}"
        )
    if sharding == "tensor":
        return (
            f"{model} is split by tensors, and a tensor-split instance reads text only; "
            "place it whole or split by layers (pipeline) to send it images"
        )
    deepstack = len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ())
    if first_rank_layers is not None and first_rank_layers < deepstack:
        return (
            f"{model} adds image features to its first {deepstack} layers, which this "
            f"instance's first rank does not all hold ({first_rank_layers}): it reads text only"
        )
    try:
        return ImagePrompts(model_dir, tokenizer)
    except ValueError as error:
        return f"{model} takes no images: {error}"
