from collections.abc import Callable

import mlx.core as mx

def make_sampler(
    temp: float = ...,
    top_p: float = ...,
    min_p: float = ...,
    min_tokens_to_keep: int = ...,
    top_k: int = ...,
) -> Callable[[mx.array], mx.array]: ...
def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array: ...
def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array: ...
def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = ...) -> mx.array: ...
