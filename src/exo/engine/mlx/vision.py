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

Qwen-VL families place image tokens in 2-D (M-RoPE): a prompt's chunk that
holds image tokens is also given their positions (`ImagePrompt.inputs`, on
every rank of a pipeline: the others need them as much) and, for Qwen3-VL, the
deepstack features its first decoder layers add (`multimodal_rope.py`).
"""

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from PIL import Image

from exo.engine.image_positions import PromptPositions
from exo.engine.mlx.load import prepare_for_backend
from exo.engine.mlx.multimodal_rope import ImageInputs, deepstack_layers
from exo.shared.prompt_images import (
    GRID_FAMILIES,
    IMAGE_MARKERS,
    PromptImage,
    image_placeholder,
    model_ids,
    upright_rgb,
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
        self.family = family
        self.deepstack_layers = deepstack_layers(config)
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

    def no_features(self, ids: Sequence[int]) -> mx.array:
        """Zero deepstack features for `ids` (text: nothing added)."""
        like = self.text(ids[:1])
        return mx.zeros((len(ids), like.shape[-1]), dtype=like.dtype)

    def image_span(
        self, ids: Sequence[int], image: PromptImage
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        """Input embeddings of an image's span (`ids`: its tokens as the model
        reads them), the image's features at its placeholders; and its deepstack
        features (Qwen3-VL: one (tokens, hidden) per layer taking them)."""
        with Image.open(io.BytesIO(image.data)) as opened:
            pixels = upright_rgb(opened)
        batch = dict(self._processor(text=[self._marker], images=[pixels], return_tensors="np"))
        features = int((_as_mx(batch.pop("input_ids")) == self.placeholder).sum().item())
        expected = sum(1 for token in ids if token == self.placeholder)
        if features != expected:
            raise ValueError(
                f"the image has {features} features but {expected} placeholders in the prompt"
            )
        if self.family in GRID_FAMILIES:
            _, height, width = (int(n) for n in _as_mx(batch["image_grid_thw"])[0].tolist())
            merge = int(self._processor.image_processor.merge_size)
            if image.grid != (height // merge, width // merge):
                raise ValueError(
                    f"the image's tokens are a {height // merge} x {width // merge} grid, "
                    f"the prompt placed them as {image.grid}"
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
        deepstack = merged.deepstack_visual_embeds
        layers = tuple(deepstack[n] for n in range(len(deepstack))) if deepstack is not None else ()
        return merged.inputs_embeds[0], layers


class ImagePrompt:
    """One request's prompt with images (`tokens`: image keys at their
    placeholders): the ids the model reads, and what any part of it reads
    besides them (see the module docstring). `encoder`: where this rank reads
    the images (a whole model, a pipeline's first rank); elsewhere only their
    places in the prompt are known."""

    def __init__(
        self,
        tokens: Sequence[int],
        images: Sequence[PromptImage],
        placeholder: int,
        encoder: VisionEncoder | None = None,
    ) -> None:
        for image in images:
            if not 0 <= image.start < image.end <= len(tokens) - 1:
                raise ValueError("an image lies outside the prompt (or at its last token)")
        self._encoder = encoder
        self.ids = model_ids(tokens, placeholder)
        self._images = sorted(images, key=lambda image: image.start)
        gridded = [image.grid is not None for image in self._images]
        if any(gridded) and not all(gridded):
            raise ValueError("some of the prompt's images have token grids and some not")
        self._positions = PromptPositions(self._images) if all(gridded) and gridded else None
        # By image index, once computed: its span's embeddings and deepstack features.
        self._spans: dict[int, tuple[mx.array, tuple[mx.array, ...]]] = {}

    def embeddings(self, start: int, end: int) -> mx.array | None:
        """Input embeddings of prompt tokens [start, end); None when no image lies
        there, or this rank does not read images (the model embeds the ids)."""
        if self._encoder is None:
            return None
        encoder = self._encoder
        return self._pieces(start, end, encoder.text, lambda span: span[0])

    def inputs(self, start: int, end: int) -> ImageInputs | None:
        """What a forward pass of prompt tokens [start, end) reads besides their
        embeddings: their positions where the model places image tokens in 2-D and
        one lies there (with the deepstack features, on the rank reading images)."""
        if self._positions is None or not self._positions.has_image(start, end):
            return None
        deepstack: list[mx.array] = []
        if self._encoder is not None:
            for layer in range(self._encoder.deepstack_layers):
                added = self._pieces(
                    start,
                    end,
                    self._encoder.no_features,
                    lambda span, layer=layer: span[1][layer],
                )
                if added is not None:
                    deepstack.append(added)
        return ImageInputs(self._positions.span(start, end), tuple(deepstack))

    def _pieces(
        self,
        start: int,
        end: int,
        text: Callable[[Sequence[int]], mx.array],
        of_span: Callable[[tuple[mx.array, tuple[mx.array, ...]]], mx.array],
    ) -> mx.array | None:
        """Tokens [start, end) as (1, tokens, hidden): each image's part of
        `of_span` of its span, `text` of the ids elsewhere; None without an image."""
        pieces: list[mx.array] = []
        position = start
        for index, image in enumerate(self._images):
            if image.end <= start or image.start >= end:
                continue
            first, last = max(image.start, start), min(image.end, end)
            if first > position:
                pieces.append(text(self.ids[position:first]))
            span = of_span(self._span(index))
            pieces.append(span[first - image.start : last - image.start])
            position = last
        if not pieces:
            return None
        if position < end:
            pieces.append(text(self.ids[position:end]))
        return mx.concatenate(pieces)[None]

    def _span(self, index: int) -> tuple[mx.array, tuple[mx.array, ...]]:
        if self._encoder is None:
            raise ValueError("this rank does not read images")
        if index not in self._spans:
            image = self._images[index]
            self._spans[index] = self._encoder.image_span(self.ids[image.start : image.end], image)
        return self._spans[index]
