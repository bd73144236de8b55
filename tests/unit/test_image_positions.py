"""M-RoPE positions of prompts with images (`engine/image_positions.py`): the
same as mlx-vlm's `get_rope_index` (which Hugging Face's mirrors) computes for
the whole prompt, whichever chunks they are asked for in."""

from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_vlm.models.qwen2_5_vl.language import LanguageModel

from exo.engine.image_positions import PromptPositions
from exo.shared.prompt_images import PromptImage

START, END, PAD = 900, 901, 902  # vision start / end, the image token
MERGE = 2


def _layout(parts: list[str | tuple[int, int]]) -> tuple[list[int], list[PromptImage]]:
    """Token ids of `parts` (text: one token a character; (rows, columns): an
    image between its start and end tokens) and the images' spans."""
    ids: list[int] = []
    images: list[PromptImage] = []
    for part in parts:
        if isinstance(part, str):
            ids += [ord(c) for c in part]
            continue
        rows, columns = part
        ids.append(START)
        images.append(
            PromptImage(
                data=b"", digest="0", start=len(ids), end=len(ids) + rows * columns, grid=part
            )
        )
        ids += [PAD] * (rows * columns)
        ids.append(END)
    return ids, images


def _theirs(ids: list[int], images: list[PromptImage]) -> tuple[list[list[int]], int]:
    """mlx-vlm's positions (3 axes) and rope delta for the whole prompt."""
    config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=MERGE),
        image_token_id=PAD,
        video_token_id=PAD + 1,
        vision_start_token_id=START,
    )
    grids = (
        mx.array(
            [[1, image.grid[0] * MERGE, image.grid[1] * MERGE] for image in images if image.grid]
        )
        if images
        else None
    )
    fake: Any = SimpleNamespace(config=config)
    positions, delta = LanguageModel.get_rope_index(fake, mx.array([ids]), grids)
    if positions.ndim == 2:  # text only: one position a token
        positions = mx.broadcast_to(positions[None], (3, *positions.shape))
    axes = cast(list[list[int]], positions[:, 0, :].tolist())
    return [[int(p) for p in axis] for axis in axes], int(cast(Any, delta).reshape(-1)[0].item())


LAYOUTS: list[list[str | tuple[int, int]]] = [
    ["Describe ", (3, 4), " please."],
    ["a", (2, 2), "bb", (4, 1), "ccc", (1, 5), "end"],
    [(6, 2), "tail after a tall image"],
    ["text only, no image at all"],
]


@pytest.mark.parametrize("parts", LAYOUTS)
def test_positions_and_deltas_are_mlx_vlms(parts: list[str | tuple[int, int]]) -> None:
    ids, images = _layout(parts)
    axes, delta = _theirs(ids, images)
    positions = PromptPositions(images)
    span = positions.span(0, len(ids))
    assert [list(axis) for axis in span.axes] == axes
    # The delta after the last token is the rope delta decode goes on with.
    assert span.deltas[-1] == delta == positions.delta_after(len(ids))
    # A text token's delta is its position minus its index.
    for index, token in enumerate(ids):
        if token != PAD:
            assert axes[0][index] - index == span.deltas[index]


@pytest.mark.parametrize("parts", LAYOUTS[:2])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunks_give_the_whole_prompts_positions(
    parts: list[str | tuple[int, int]], chunk: int
) -> None:
    ids, images = _layout(parts)
    positions = PromptPositions(images)
    whole = positions.span(0, len(ids))
    axes: tuple[list[int], list[int], list[int]] = ([], [], [])
    deltas: list[int] = []
    for start in range(0, len(ids), chunk):
        part = positions.span(start, min(start + chunk, len(ids)))
        for mine, theirs in zip(axes, part.axes, strict=True):
            mine += theirs
        deltas += part.deltas
    assert axes == whole.axes and deltas == whole.deltas


def test_an_image_token_delta_is_where_text_would_go_on() -> None:
    """After an image's last token the delta is the text's; within it, the next
    text token would go past the largest position so far."""
    ids, images = _layout(["ab", (2, 3), "c"])
    (image,) = images
    span = PromptPositions(images).span(0, len(ids))
    inside = span.deltas[image.start : image.end]
    base = image.start  # no image before it
    expected = []
    for offset in range(6):
        row, column = divmod(offset, 3)
        highest = max(row, 2 if row else column)
        expected.append(base + highest + 1 - (image.start + offset + 1))
    assert inside == expected
    assert span.deltas[image.end] == 3 - 6  # max(rows, columns) - tokens


def test_has_image_and_bad_grids() -> None:
    ids, images = _layout(["ab", (2, 2), "c"])
    positions = PromptPositions(images)
    (image,) = images
    assert positions.has_image(0, image.start + 1)
    assert not positions.has_image(0, image.start)
    assert not positions.has_image(image.end, len(ids))
    with pytest.raises(ValueError, match="grid"):
        PromptPositions([image.model_copy(update={"grid": (3, 3)})])
    with pytest.raises(ValueError, match="no token grid"):
        PromptPositions([image.model_copy(update={"grid": None})])
