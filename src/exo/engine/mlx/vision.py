"""Images read as input embeddings.

mlx-lm serves a vision-language model's language model (it loads such a folder
as text only); what it lacks is the vision tower and the projector that turn an
image into features in the language model's embedding space. mlx-vlm has them:
`VisionEncoder` loads its model of the same folder lazily, shares the mlx-lm
model's token embedding, and evaluates only the vision weights, so the language
model is in memory once. A request's prompt then reads as input embeddings
wherever it holds an image (`ImagePrompt`): each image's span (its placeholders
and what lies between them) with the features in place, as mlx-vlm's own
`get_input_embeddings` merges them, and the token embedding elsewhere.

Images are decoded and preprocessed here, by the model's image processor, only
when a request reads them: an image whose tokens the prefix cache restored
costs nothing.
"""

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from PIL import Image

from exo.engine.mlx.load import prepare_for_backend
from exo.shared.prompt_images import (
    IMAGE_MARKERS,
    PromptImage,
    image_placeholder,
    model_ids,
    vision_family,
)

_VISION_WEIGHTS = ("vision_tower", "multi_modal_projector")


def vision_placeholder(model_dir: Path) -> int | None:
    """A vision model's image token (None: a model exo gives no images to)."""
    config = json.loads((model_dir / "config.json").read_text())
    return image_placeholder(config) if vision_family(config) is not None else None


def _as_mx(value: Any) -> Any:
    """A processor's output as MLX takes it (mlx-vlm's give MLX arrays already)."""
    return value if isinstance(value, mx.array) else mx.array(value)


def _embedding_module(model: nn.Module) -> nn.Module:
    """The token embedding of an mlx-lm model (`...embed_tokens`)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "embed_tokens":
            return cast(nn.Module, module)
    raise ValueError("the language model has no token embedding (embed_tokens)")


class VisionEncoder:
    """A vision model's image side, beside the mlx-lm `language_model` loaded
    from the same folder."""

    def __init__(self, model_dir: Path, language_model: nn.Module) -> None:
        # Imported here: only runners of vision models pay for mlx-vlm (and its
        # transformers processors).
        from mlx_vlm.utils import load_model, load_processor

        config = json.loads((model_dir / "config.json").read_text())
        family = vision_family(config)
        if family is None:
            raise ValueError(f"{model_dir.name} is not a vision model exo gives images to")
        self.placeholder = image_placeholder(config)
        self._marker = IMAGE_MARKERS[family]
        vlm: Any = load_model(model_dir, lazy=True)
        embedding = _embedding_module(language_model)
        # mlx-vlm's language model is never run: it keeps the shared embedding
        # (which get_input_embeddings reads) and none of its layers.
        inner = vlm.language_model.model
        inner.embed_tokens = embedding
        inner.layers = []
        self._embed = embedding
        self._vlm = prepare_for_backend(
            vlm, config, evaluate=lambda name: name.startswith(_VISION_WEIGHTS)
        )
        # mlx-vlm's processor (its model modules, imported above, register their
        # own with transformers): the pixels exactly as mlx-vlm feeds them.
        self._processor: Any = load_processor(model_dir, add_detokenizer=False)
        parameters = cast(list[tuple[str, mx.array]], tree_flatten(self._vlm.parameters()))
        # What it holds beside the language model (the shared embedding is that's).
        self.nbytes = sum(
            array.nbytes for name, array in parameters if name.startswith(_VISION_WEIGHTS)
        )

    def text(self, ids: Sequence[int]) -> mx.array:
        """Token embeddings of `ids` (no image in them)."""
        return self._embed(mx.array(list(ids)))

    def image_span(self, ids: Sequence[int], image: PromptImage) -> mx.array:
        """Input embeddings of an image's span (`ids`: its tokens as the model
        reads them), the image's features at its placeholders."""
        with Image.open(io.BytesIO(image.data)) as opened:
            pixels = opened.convert("RGB")
        batch = dict(self._processor(text=[self._marker], images=[pixels], return_tensors="np"))
        features = int((_as_mx(batch.pop("input_ids")) == self.placeholder).sum().item())
        expected = sum(1 for token in ids if token == self.placeholder)
        if features != expected:
            raise ValueError(
                f"the image has {features} features but {expected} placeholders in the prompt"
            )
        batch.pop("attention_mask", None)
        pixel_values = _as_mx(batch.pop("pixel_values"))
        inputs = mx.array(list(ids))[None]
        merged = self._vlm.get_input_embeddings(
            input_ids=inputs,
            pixel_values=pixel_values,
            mask=mx.ones(inputs.shape),
            **{key: _as_mx(value) for key, value in batch.items()},
        )
        return merged.inputs_embeds[0]


class ImagePrompt:
    """One request's prompt with images (`tokens`: image keys at their
    placeholders): the ids the model reads, and the input embeddings of any
    part of it."""

    def __init__(
        self, encoder: VisionEncoder, tokens: Sequence[int], images: Sequence[PromptImage]
    ) -> None:
        for image in images:
            if not 0 <= image.start < image.end <= len(tokens) - 1:
                raise ValueError("an image lies outside the prompt (or at its last token)")
        self._encoder = encoder
        self.ids = model_ids(tokens, encoder.placeholder)
        self._images = sorted(images, key=lambda image: image.start)
        self._spans: dict[int, mx.array] = {}  # by image index, once computed

    def embeddings(self, start: int, end: int) -> mx.array | None:
        """Input embeddings of prompt tokens [start, end); None when no image lies
        there (the model embeds the ids itself)."""
        pieces: list[mx.array] = []
        position = start
        for index, image in enumerate(self._images):
            if image.end <= start or image.start >= end:
                continue
            first, last = max(image.start, start), min(image.end, end)
            if first > position:
                pieces.append(self._encoder.text(self.ids[position:first]))
            span = self._span(index)
            pieces.append(span[first - image.start : last - image.start])
            position = last
        if not pieces:
            return None
        if position < end:
            pieces.append(self._encoder.text(self.ids[position:end]))
        return mx.concatenate(pieces)[None]

    def _span(self, index: int) -> mx.array:
        if index not in self._spans:
            image = self._images[index]
            self._spans[index] = self._encoder.image_span(self.ids[image.start : image.end], image)
        return self._spans[index]
