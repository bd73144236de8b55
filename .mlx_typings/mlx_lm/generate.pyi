from collections.abc import Callable, Generator, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

class GenerationResponse:
    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None

def generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = ...,
    sampler: Callable[[mx.array], mx.array] | None = ...,
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]] | None = ...,
    prompt_cache: list[Any] | None = ...,
    prefill_step_size: int = ...,
) -> Generator[tuple[int, mx.array], None, None]: ...
def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    max_tokens: int = ...,
    **kwargs: Any,
) -> Iterator[GenerationResponse]: ...
