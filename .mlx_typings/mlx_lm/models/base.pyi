from typing import Any

import mlx.core as mx

def create_attention_mask(
    h: mx.array, cache: Any | None = ..., window_size: int | None = ..., return_array: bool = ...
) -> mx.array | str | None: ...
