"""Text generation on one MLX model with the KV prefix cache consulted first."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.prefix_cache import KVPrefixCache, PrefixMatch
from exo.engine.stop_sequences import StopMatcher
from exo.shared.types.tasks import FinishReason, GenerationParams, Usage

PREFILL_STEP_TOKENS = 512


class GenerationCancelled(Exception):
    """The request was cancelled (client went away)."""


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class GenerationDone:
    finish_reason: FinishReason
    usage: Usage


GenerationOutput = TextDelta | GenerationDone


class TextGenerator:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        prefix_cache: KVPrefixCache | None,
        prefill_step_tokens: int = PREFILL_STEP_TOKENS,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_tokens = prefill_step_tokens

    def _prefill(
        self,
        tokens: Sequence[int],
        is_cancelled: Callable[[], bool],
        on_progress: Callable[[int, int], None],
    ) -> tuple[list, PrefixMatch]:
        """Restore the longest cached prefix, prefill all but the last prompt token, store."""
        cache = self.prefix_cache
        match = cache.lookup(tokens) if cache else PrefixMatch(None, 0, len(tokens))
        layers = (cache.restore(match) if cache else None) or make_prompt_cache(self.model)
        done = match.usable if layers is not None and match.is_hit else 0
        total = len(tokens) - 1
        on_progress(done, total)
        while done < total:
            if is_cancelled():
                raise GenerationCancelled
            chunk = tokens[done : min(done + self.prefill_step_tokens, total)]
            self.model(mx.array(list(chunk))[None], cache=layers)
            mx.eval([layer.state for layer in layers])
            done += len(chunk)
            on_progress(done, total)
        return layers, match

    def _first_token(
        self, last_prompt_token: int, layers: list, sampler: Callable[[mx.array], mx.array]
    ) -> int:
        logits = self.model(mx.array([[last_prompt_token]]), cache=layers)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return cast(int, sampler(logprobs).item())

    def _decode(
        self,
        first: int,
        tokens: Sequence[int],
        layers: list,
        match: PrefixMatch,
        params: GenerationParams,
        sampler: Callable[[mx.array], mx.array],
        system_prompt_length: int,
    ) -> Iterator[int]:
        """The first token, then the rest. The prompt's KV is stored once the first
        token is out (the cache then holds exactly the prompt), off the TTFT path."""
        yield first
        if self.prefix_cache is not None:
            self.prefix_cache.store(tokens, layers, match, system_prompt_length)
        if params.max_tokens > 1:
            rest = generate_step(
                mx.array([first]),
                self.model,
                max_tokens=params.max_tokens - 1,
                sampler=sampler,
                prompt_cache=layers,
            )
            for token, _ in rest:
                yield int(token)

    def generate(
        self,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        is_cancelled: Callable[[], bool] = lambda: False,
        on_progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> Iterator[GenerationOutput]:
        if not tokens:
            raise ValueError("the prompt has no tokens")
        layers, match = self._prefill(tokens, is_cancelled, on_progress)
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
        # The first token is computed on its own, not inside generate_step, which
        # would start the second step before handing out the first (TTFT).
        first = self._first_token(tokens[-1], layers, sampler)
        steps = self._decode(first, tokens, layers, match, params, sampler, system_prompt_length)
        yield from stream_text(self.tokenizer, steps, params, len(tokens), match, is_cancelled)


def stream_text(
    tokenizer: TokenizerWrapper,
    steps: Iterator[int],
    params: GenerationParams,
    prompt_tokens: int,
    match: PrefixMatch,
    is_cancelled: Callable[[], bool],
) -> Iterator[GenerationOutput]:
    """Generated token ids -> text deltas, stopping at EOS or a stop string, then
    the finish reason and usage. Stops pulling from `steps` once finished."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stops = StopMatcher(tuple(params.stop))
    eos = set(tokenizer.eos_token_ids)
    finish: FinishReason = "length"
    hit_stop_string = False
    produced = 0
    for token in steps:
        produced += 1
        if token in eos:
            finish = "stop"
            break
        detokenizer.add_token(token)
        text, hit_stop_string = stops.feed(detokenizer.last_segment)
        if text:
            yield TextDelta(text=text)
        if hit_stop_string:
            finish = "stop"
            break
        if is_cancelled():
            raise GenerationCancelled
    if not hit_stop_string:
        detokenizer.finalize()
        tail, _ = stops.feed(detokenizer.last_segment)
        tail += stops.flush()
        if tail:
            yield TextDelta(text=tail)
    yield GenerationDone(
        finish_reason=finish,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=produced,
            cached_tokens=match.usable if match.is_hit else 0,
        ),
    )
