"""The part of a model one runner holds: a range of its transformer layers."""

from typing import Self

from pydantic import model_validator

from exo.shared.types.frozen import FrozenModel


class LayerRange(FrozenModel):
    """Layers [start, end) of a model with `total` layers. The first range also
    holds the token embedding, the last one the final norm and the output head."""

    start: int
    end: int
    total: int

    @model_validator(mode="after")
    def _inside_the_model(self) -> Self:
        if not 0 <= self.start < self.end <= self.total:
            raise ValueError(
                f"layer range [{self.start}, {self.end}) is not inside the model's {self.total} layers"
            )
        return self

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.total

    def __str__(self) -> str:
        return f"layers [{self.start}, {self.end}) of {self.total}"
