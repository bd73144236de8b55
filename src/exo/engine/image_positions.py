"""Where a prompt's tokens sit for a model with multimodal rotary positions
(M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Such a model rotates each token by three positions, time, height and width,
each for its own share of the rotary frequencies. A text token sits at p on
all three (text alone is thus plain RoPE at p). An image's tokens are its grid
of merged patches in raster order, and sit at (p, p + row, p + column), p being
the position after the text before it; the text after the image goes on from
p + max(rows, columns). So after an image a token's position runs behind its
index in the prompt by a constant: each token's *delta*, the position the next
text token would take minus the index it would have, is what a runner keeps in
its cache beside the KV (`mlx/multimodal_rope.py`), so that decode and the text
of later turns need only the cache, while a forward pass that reads image tokens
is given the positions computed here (Hugging Face's and mlx-vlm's
`get_rope_index` for still images, by chunk).

Pure Python: every rank of a split instance computes the same positions from the
same prompt.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from exo.shared.prompt_images import PromptImage


@dataclass(frozen=True)
class PositionSpan:
    """The positions of prompt tokens [start, end): one list per axis (time,
    height, width), and each token's delta (see the module docstring)."""

    axes: tuple[list[int], list[int], list[int]]
    deltas: list[int]


class PromptPositions:
    """The M-RoPE positions of a prompt whose images have token grids
    (`PromptImage.grid`)."""

    def __init__(self, images: Sequence[PromptImage]) -> None:
        self._images = sorted(images, key=lambda image: image.start)
        # The delta in force before each image (what the text before it has).
        self._before: list[int] = []
        delta, end = 0, 0
        for image in self._images:
            if image.grid is None:
                raise ValueError("an image of the prompt has no token grid (rows, columns)")
            rows, columns = image.grid
            if image.start < end or image.end - image.start != rows * columns:
                raise ValueError(
                    f"an image's span [{image.start}, {image.end}) does not hold its "
                    f"{rows} x {columns} grid of tokens, or overlaps another"
                )
            self._before.append(delta)
            delta += max(rows, columns) - rows * columns
            end = image.end

    def has_image(self, start: int, end: int) -> bool:
        """Whether an image token lies in [start, end)."""
        return any(image.start < end and start < image.end for image in self._images)

    def span(self, start: int, end: int) -> PositionSpan:
        """The positions and deltas of tokens [start, end)."""
        axes: tuple[list[int], list[int], list[int]] = ([], [], [])
        deltas: list[int] = []
        index = start
        for image, delta in zip(self._images, self._before, strict=True):
            if index >= end:
                break
            if image.end <= index:
                continue
            for i in range(index, min(image.start, end)):  # text before the image
                for axis in axes:
                    axis.append(i + delta)
                deltas.append(delta)
            columns = image.grid[1] if image.grid else 1
            base = image.start + delta
            for i in range(max(index, image.start), min(image.end, end)):
                row, column = divmod(i - image.start, columns)
                axes[0].append(base)
                axes[1].append(base + row)
                axes[2].append(base + column)
                # The next text token's position if the image ended here: past
                # the largest position of the image so far.
                highest = max(row, columns - 1 if row else column)
                deltas.append(base + highest - i)
            index = max(index, min(image.end, end))
        final = self.delta_after(index)
        for i in range(index, end):  # text after the last image
            for axis in axes:
                axis.append(i + final)
            deltas.append(final)
        return PositionSpan(axes, deltas)

    def delta_after(self, index: int) -> int:
        """The delta of text at `index`, past every image that ends by then."""
        delta = 0
        for image, before in zip(self._images, self._before, strict=True):
            if image.end <= index:
                rows, columns = image.grid or (0, 0)
                delta = before + max(rows, columns) - rows * columns
        return delta
