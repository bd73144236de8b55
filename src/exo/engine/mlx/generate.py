"""Text generation: one loop over a `LocalModel`, the KV prefix cache consulted
first. The loop is the same whether the whole model runs here or this process is
one rank of a split instance, where every rank runs it in lockstep
(`lockstep.py`):

1. the prefix cache restores the longest cached prefix of the prompt (or misses);
2. the rest of the prompt but its last token is prefilled in chunks, with
   progress reports and a cancellation check between chunks;
3. the last prompt token is forwarded on its own and the first token drawn:
   a decode loop would start the second step before handing out the first (TTFT);
4. caches that cannot be cut back store a checkpoint of the prompt then (as
   they do at the system prompt's end during prefill), off the TTFT path;
5. decode; token ids become text deltas, cut at EOS or a stop string;
6. the KV of prompt + reply is stored, so the next turn reuses the reply too.

Tokens are drawn in one place, a `SamplingStep` (`sampling.py`) made from the
request's params where the logits are: here, or on a pipeline's last rank. A
request's constraint is a token mask there (`constrained.py`); once its grammar
is complete the mask allows only EOS, which ends the reply.

With `params.logprobs` each text delta carries the sampled tokens behind it:
every generated token exactly once (those of held-back text and of a stop
string too), EOS never.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.constrained import compile_constraint, request_sampling
from exo.engine.mlx.cpu_few_rows import eager_rows
from exo.engine.mlx.multimodal_rope import ImageInputs
from exo.engine.mlx.prefix_cache import (
    KVPrefixCache,
    LayerCache,
    PrefixMatch,
    cached_length,
    resume,
)
from exo.engine.mlx.sampling import PendingToken, SampledToken, SamplingStep
from exo.engine.mlx.vision import ImagePrompt, VisionEncoder
from exo.engine.speculation import SpeculationStats
from exo.engine.stop_sequences import StopMatcher
from exo.shared.prompt_images import PromptImage, is_image_key, model_ids
from exo.shared.types.tasks import FinishReason, GenerationParams, SampledLogprob, Usage

PREFILL_STEP_TOKENS = 512
# Decode runs on its own stream, as mlx_lm's `generate_step` does, so the next
# step is computed while the current token is turned into text.
DECODE_STREAM = mx.new_thread_local_stream(mx.default_device())
# Give MLX's buffer cache back every this many decoded tokens (as mlx_lm does).
_CLEAR_CACHE_TOKENS = 256


class GenerationCancelled(Exception):
    """The request was cancelled (client went away)."""


@dataclass(frozen=True)
class TextDelta:
    text: str
    # With `params.logprobs`: the tokens behind `text` (text may be empty when
    # they end in a stop string).
    logprobs: tuple[SampledLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # which of `params.stop` ended the reply


GenerationOutput = TextDelta | Finished


class LocalModel:
    """The forward passes of a model this process calls, as the generation loop
    runs them: the whole model, or this rank's part of a split one
    (`tensor.RankZeroLogits`, `pipeline.PipelineStage`). The tokenizer compiles
    requests' constraints; `relay` wraps each request's `SamplingStep` (a
    pipeline's ranks take the tokens its last rank draws).

    `eager_rows`: up to how many rows (requests decoding together) a forward
    pass runs as it is built, not when its result is awaited (0: never). What
    decode makes of it, said here only: up to this many rows a step has nothing
    to overlap, so a decode loop hands out the tokens a step drew before it
    builds the next step (each token goes out in the step that computed it). A
    reply's last token is then never fed in: the stored reply stops one token
    short, and the next turn reads that token along with its new ones (cheaper
    than a closing step spent on it). Beyond it, a loop builds the next step on
    the drawn tokens before reading them back, so turning tokens into text
    overlaps the model; a reply that ends has had one more step computed for
    it, which is dropped, and its stored reply keeps its last token. A split
    instance's ranks set it unbounded: their messages and collectives must not
    cross a step computed ahead.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        relay: Callable[[SamplingStep], SamplingStep] = lambda step: step,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eager_rows = eager_rows(model)  # the CPU kernel's
        self._relay = relay
        self._sampling: SamplingStep | None = None

    def sampling_for(self, params: GenerationParams, tokens: Sequence[int]) -> SamplingStep:
        """A request's sampling step; raises for an uncompilable constraint."""
        return self._relay(request_sampling(params, tokens, self.tokenizer))

    def make_cache(self) -> list[LayerCache]:
        return make_prompt_cache(self.model)

    @contextmanager
    def request(self, tokens: Sequence[int], params: GenerationParams) -> Iterator[None]:
        """One request's span, its `SamplingStep` set; the other calls happen inside it."""
        self._sampling = self.sampling_for(params, tokens)
        try:
            yield
        finally:
            self._sampling = None

    @property
    def sampling(self) -> SamplingStep:
        if self._sampling is None:
            raise RuntimeError("tokens are drawn only within a request")
        return self._sampling

    def prefill(
        self,
        tokens: Sequence[int],
        layers: list[LayerCache],
        embeddings: mx.array | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """Read `tokens` into the cache (as `embeddings`, where a prompt holds
        images, and with `images`' positions where the model places image tokens
        in 2-D: `vision.ImagePrompt`)."""
        inputs = mx.array(list(tokens))[None]
        extra: dict[str, Any] = {}
        if embeddings is not None:
            extra["input_embeddings"] = embeddings
        if images is not None:
            extra["images"] = images
        self.model(inputs, cache=layers, **extra)
        mx.eval([layer.state for layer in layers])

    def next_token(self, token: int, layers: list[LayerCache]) -> SampledToken:
        logits = self.model(mx.array([[token]]), cache=layers)[:, -1, :]
        return self.sampling.sample(logits)

    def decode(
        self, token: int, layers: list[LayerCache], max_tokens: int
    ) -> Iterator[SampledToken]:
        sampling = self.sampling

        def step(previous: mx.array) -> PendingToken:
            with mx.stream(DECODE_STREAM):
                return sampling.draw(self.model(previous[None], cache=layers)[:, -1, :])

        current = step(mx.array([token]))
        current.async_eval()
        for n in range(max_tokens):
            if self.eager_rows:  # out before the next step: see the class docstring
                yield current.resolve()
            upcoming = step(current.token) if n + 1 < max_tokens else None
            if upcoming is not None:
                upcoming.async_eval()
            if not self.eager_rows:
                yield current.resolve()
            if n % _CLEAR_CACHE_TOKENS == 0:
                mx.clear_cache()
            if upcoming is None:
                return
            current = upcoming


class TextGenerator:
    """Generates text for one request at a time through a `LocalModel`."""

    def __init__(
        self,
        forward: LocalModel,
        tokenizer: TokenizerWrapper,
        prefix_cache: KVPrefixCache | None,
        prefill_step_tokens: int = PREFILL_STEP_TOKENS,
        vision: VisionEncoder | None = None,
        image_placeholder: int | None = None,
    ) -> None:
        """`vision`: a vision model's image side, where this process reads the
        prompt's images (whole model, a pipeline's first rank).
        `image_placeholder`: a vision model's image token, which the other ranks
        read its prompts' image keys as (`model_ids`), knowing the images'
        places only; with neither, a request with images fails."""
        self.forward = forward
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.prefill_step_tokens = prefill_step_tokens
        self.vision = vision
        self.image_placeholder = vision.placeholder if vision else image_placeholder

    def generate(
        self,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        is_cancelled: Callable[[], bool] = lambda: False,
        on_progress: Callable[[int, int], None] = lambda done, total: None,
        images: Sequence[PromptImage] = (),
    ) -> Iterator[GenerationOutput]:
        match, layers = self.start(tokens, params)
        prompt = self.image_prompt(tokens, images)
        with self.forward.request(prompt.ids if prompt else self.model_ids(tokens), params):
            chunks = self.prefill_chunks(
                tokens[:-1],
                match.usable,
                layers,
                self.checkpoint_at(system_prompt_length, layers),
                prompt,
            )
            done, total = match.usable, len(tokens) - 1
            on_progress(done, total)
            while done < total:
                if is_cancelled():
                    raise GenerationCancelled
                done = next(chunks)
                on_progress(done, total)
            generated: list[int] = []
            stream = TextStream(self.tokenizer, params, len(tokens), match.usable)
            for sampled in self._steps(tokens, layers, params.max_tokens, generated):
                yield from stream.feed(sampled)
                if stream.finished:
                    break
                if is_cancelled():
                    raise GenerationCancelled
            if not stream.finished:
                yield from stream.end()
            self.store_reply(tokens, generated, layers)

    def start(
        self, tokens: Sequence[int], params: GenerationParams
    ) -> tuple[PrefixMatch, list[LayerCache]]:
        """Check a request, then restore the longest cached prefix of its prompt:
        the cache's decision and the cache objects to prefill the rest into."""
        if not tokens:
            raise ValueError("the prompt has no tokens")
        if is_image_key(tokens[-1]):
            raise ValueError("the prompt ends inside an image")
        if params.constraint is not None:
            # Fails the task before any work.
            compile_constraint(self.tokenizer, params.constraint)
        return resume(self.prefix_cache, tokens, self.forward.make_cache)

    def image_prompt(
        self, tokens: Sequence[int], images: Sequence[PromptImage]
    ) -> ImagePrompt | None:
        """A prompt with images, as the model reads it; None without images."""
        if not images:
            return None
        if self.image_placeholder is None:
            raise ValueError("this model reads text only: it was loaded without a vision tower")
        return ImagePrompt(tokens, images, self.image_placeholder, self.vision)

    def model_ids(self, tokens: Sequence[int]) -> Sequence[int]:
        """The ids the model reads for `tokens` (what sampling penalizes and
        drafts come from): a prompt's image keys as the image token."""
        if self.image_placeholder is None or not any(map(is_image_key, tokens)):
            return tokens
        return model_ids(tokens, self.image_placeholder)

    def checkpoint_at(self, system_prompt_length: int, layers: list[LayerCache]) -> int:
        """Where prefill stores a checkpoint: the system prompt's end, for caches
        that cannot be cut back (0: none)."""
        if self.prefix_cache is not None and self.prefix_cache.needs_checkpoints(layers):
            return system_prompt_length
        return 0

    def prefill_chunks(
        self,
        tokens: Sequence[int],
        done: int,
        layers: list[LayerCache],
        checkpoint: int = 0,
        images: ImagePrompt | None = None,
    ) -> Iterator[int]:
        """Prefill `tokens` from `done` (those were restored) a chunk per step,
        yielding how many are done after each. Caches that cannot be cut back are
        stored on the way at `checkpoint` (the system prompt's end), which other
        conversations with that system prompt restore. A prompt with `images`
        reads them as input embeddings."""
        total = len(tokens)
        while done < total:
            end = min(done + self.prefill_step_tokens, total)
            end = checkpoint if done < checkpoint < end else end
            if images is None:
                self.forward.prefill(tokens[done:end], layers)
            else:
                self.forward.prefill(
                    images.ids[done:end],
                    layers,
                    images.embeddings(done, end),
                    images.inputs(done, end),
                )
            done = end
            if done == checkpoint and self.prefix_cache is not None:
                self.prefix_cache.store(tokens[:done], layers)
            yield done

    def _steps(
        self,
        tokens: Sequence[int],
        layers: list[LayerCache],
        max_tokens: int,
        generated: list[int],
    ) -> Iterator[SampledToken]:
        """The first token, then the rest (each noted in `generated`). Caches that
        cannot be cut back store a checkpoint of the prompt in between (before the
        assistant turn, which the next turn's template may rewrite); the others keep
        the prompt with the reply, after decode."""
        first = self.forward.next_token(tokens[-1], layers)
        generated.append(first.token)
        yield first
        self.store_prompt_checkpoint(tokens, layers)
        if max_tokens > 1:
            for sampled in self.forward.decode(first.token, layers, max_tokens - 1):
                generated.append(sampled.token)
                yield sampled

    def store_prompt_checkpoint(self, tokens: Sequence[int], layers: list[LayerCache]) -> None:
        """For caches that cannot be cut back: keep the prompt's state before the
        reply (the next turn's template may rewrite the assistant turn)."""
        if self.prefix_cache is not None and self.prefix_cache.needs_checkpoints(layers):
            self.prefix_cache.store(tokens, layers)

    def store_reply(
        self, tokens: Sequence[int], generated: Sequence[int], layers: list[LayerCache]
    ) -> None:
        """Keep the KV of the prompt and of the reply the cache objects hold, so the
        next turn, which echoes the reply, reuses it."""
        held = cached_length(layers)
        if self.prefix_cache is None or held is None or held < len(tokens):
            return
        sequence = [*tokens, *generated][:held]
        self.prefix_cache.store(sequence, layers)


class TextStream:
    """One reply's generated tokens -> text deltas (with their logprobs), ended
    at EOS, a stop string or `max_tokens`, then the finish reason and usage."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        params: GenerationParams,
        prompt_tokens: int,
        cached_tokens: int,
        speculation: SpeculationStats | None = None,
    ) -> None:
        self._detokenizer = tokenizer.detokenizer  # a fresh one per access
        self._speculation = speculation  # the reply's drafting, for its usage
        self._stops = StopMatcher(tuple(params.stop))
        self._eos = set(tokenizer.eos_token_ids)
        self._max_tokens = params.max_tokens
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens
        self._finish: FinishReason = "length"
        self._produced = 0
        # Logprobs of tokens whose text is not out yet (the detokenizer or the stop
        # matcher holds it back): they go with the next delta.
        self._unsent: list[SampledLogprob] = []
        self.finished = False

    def feed(self, sampled: SampledToken) -> list[GenerationOutput]:
        """What one more token lets out; the last output is `Finished` once
        this token ends the reply."""
        if self.finished:
            raise RuntimeError("the reply has ended")
        self._produced += 1
        if sampled.token in self._eos:
            self._finish = "stop"
            return self.end()
        if (logprob := sampled.reported()) is not None:
            self._unsent.append(logprob)
        self._detokenizer.add_token(sampled.token)
        text, hit_stop_string = self._stops.feed(self._detokenizer.last_segment)
        outputs: list[GenerationOutput] = []
        if text:
            outputs.append(TextDelta(text=text, logprobs=tuple(self._unsent)))
            self._unsent.clear()
        if hit_stop_string or self._produced >= self._max_tokens:
            outputs.extend(self.end())
        return outputs

    def end(self) -> list[GenerationOutput]:
        """The held-back text and the finish, once."""
        if self.finished:
            return []
        self.finished = True
        stops = self._stops
        tail = ""
        if stops.matched is None:
            self._detokenizer.finalize()
            tail, _ = stops.feed(self._detokenizer.last_segment)
            tail += stops.flush()
        if stops.matched is not None:
            self._finish = "stop"
        outputs: list[GenerationOutput] = []
        if tail or self._unsent:
            outputs.append(TextDelta(text=tail, logprobs=tuple(self._unsent)))
        outputs.append(
            Finished(
                finish_reason=self._finish,
                usage=self._usage(),
                stop_sequence=stops.matched,
            )
        )
        return outputs

    def _usage(self) -> Usage:
        speculation = self._speculation or SpeculationStats()
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._produced,
            cached_tokens=self._cached_tokens,
            drafted_tokens=speculation.drafted,
            accepted_draft_tokens=speculation.accepted,
            accepted_prediction_tokens=speculation.prediction_accepted,
            rejected_prediction_tokens=speculation.prediction_rejected,
        )
