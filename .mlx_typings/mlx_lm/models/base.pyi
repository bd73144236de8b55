from typing import Any

import mlx.core as mx

def create_attention_mask(
    h: mx.array, cache: Any | None = ..., window_size: int | None = ..., return_array: bool = ...
) -> mx.array | str | None: ...
def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = ...,
) -> mx.array: ...
