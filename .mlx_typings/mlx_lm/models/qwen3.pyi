from typing import Any

import mlx.core as mx
import mlx.nn as nn

class ModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs: ...

class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None: ...
    def __call__(self, inputs: mx.array, cache: list[Any] | None = ...) -> mx.array: ...
