"""Images in a prompt's tokens.

A vision model's prompt holds one placeholder token per image feature (the
processor expands the chat template's image marker into them), the same token
for every image. The prefix cache and the routing digests must tell images
apart, so in the token ids the node sends a runner each of an image's
placeholders is written as its *image key*: an id beyond any vocabulary,
derived from the hash of the image's decoded pixels. The same screenshot sent
again in the next agent turn then extends the cached prompt token for token,
and a different image at that place is a miss. Runners turn keys back into the
placeholder before the model sees them (`model_ids`).

Which families take images, and what their chat templates write for one, is
here too: the node expands the marker (`models/vision.py`), the runner reads
the image (`engine/mlx/vision.py`).
"""

from collections.abc import Sequence
from typing import Any

from PIL import Image, ImageOps
from pydantic import ConfigDict, Field

from exo.shared.types.frozen import FrozenModel

# config.json `model_type` -> the family's name, for messages and the README.
VISION_FAMILIES: dict[str, str] = {
    "gemma3": "Gemma 3",
    "mistral3": "Mistral 3 (Mistral Small 3.1 / 3.2)",
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL MoE",
}

# What the chat template writes for an image, by family: the processor expands it.
IMAGE_MARKERS: dict[str, str] = {
    "gemma3": "<start_of_image>",
    "mistral3": "[IMG]",
    "qwen2_vl": "<|image_pad|>",
    "qwen2_5_vl": "<|image_pad|>",
    "qwen3_vl": "<|image_pad|>",
    "qwen3_vl_moe": "<|image_pad|>",
}

# Families whose image tokens sit at 2-D positions (M-RoPE: `engine/image_positions.py`):
# a prompt's images carry their grids of tokens.
GRID_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


def vision_family(config: dict[str, Any]) -> str | None:
    """The family of a model folder's config.json that exo gives images to."""
    model_type = config.get("model_type")
    if model_type in VISION_FAMILIES and "vision_config" in config:
        return str(model_type)
    return None


def image_placeholder(config: dict[str, Any]) -> int:
    """The token id a vision model's image features take the place of."""
    for key in ("image_token_index", "image_token_id"):
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ValueError("the model's config.json names no image token")


# Above every vocabulary (the largest are ~260k tokens), within int32.
IMAGE_KEY_BASE = 1 << 30


class PromptImage(FrozenModel):
    """An image of a prompt: the file as the client sent it (the runner decodes
    and preprocesses it only when its tokens are not cached), its pixels' digest,
    and the span of prompt tokens from its first placeholder to its last."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    data: bytes
    digest: str
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    # (rows, columns) of its tokens, for families that place them in 2-D
    # (`GRID_FAMILIES`); the span then holds exactly rows x columns placeholders.
    grid: tuple[int, int] | None = None

    def without_data(self) -> "PromptImage":
        """Its place in the prompt only: what ranks that do not read images need."""
        return self.model_copy(update={"data": b""})


def image_key(digest: str) -> int:
    """The id an image's placeholders are written as (`digest`: hex)."""
    return IMAGE_KEY_BASE + int(digest[:15], 16) % IMAGE_KEY_BASE


def is_image_key(token: int) -> bool:
    return token >= IMAGE_KEY_BASE


def model_ids(tokens: Sequence[int], placeholder: int) -> list[int]:
    """The ids the model reads: image keys back to the placeholder token."""
    return [placeholder if token >= IMAGE_KEY_BASE else token for token in tokens]


def upright_rgb(image: Image.Image) -> Image.Image:
    """An opened image's pixels as a model sees them (and the node hashes them):
    turned as its EXIF orientation says, transparency laid over white, RGB."""
    image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
