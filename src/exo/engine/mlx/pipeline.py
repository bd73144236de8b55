"""Pipeline ranks: rank r holds layers [start_r, end_r) of the model (`shard.py`),
and a forward pass goes from rank to rank around the ring (`ring.py`):

    rank 0 ──► rank 1 ──► … ──► rank N-1 ──┐
      ▲                                     │ (the tokens drawn)
      └─────────────────────────────────────┘

Every rank runs the same serving loop on the same requests, rank 0 deciding
(`lockstep.py`); what differs on a pipeline rank is what a forward pass is
(`PipelineStage`) and who draws the tokens (`RingDraw`):

- rank 0 embeds the tokens and runs its layers, sends the hidden states on
  (`FORWARD`, one row per request of the batch) and returns; rank r runs its
  layers on what it receives and sends them on; the last rank runs its layers,
  the final norm and the head: the logits. A prompt is read in chunks, and as a
  rank returns once it has sent a chunk, rank r works on chunk k while rank r-1
  is already on chunk k+1.
- the last rank draws each row's token with the request's own `SamplingStep`
  (constraint mask, penalties, seed, logprobs) and sends it (`TOKEN`, with its
  logprobs when asked for) to rank 0, which hands it on to the ranks before the
  last. Every rank then feeds the same tokens back and decides alike where a
  reply ends and what the prefix cache stores. A draw that fails (a request's
  own fault, e.g. a `logit_bias` outside the vocabulary) fails alike everywhere:
  the last rank sends the error instead.
"""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from exo.engine.mlx.multimodal_rope import ForwardPositions, ImageInputs, PositionTracker
from exo.engine.mlx.prefix_cache import LayerCache
from exo.engine.mlx.ring import Header, Link, Op, PipelineError, sampled_of, token_message
from exo.engine.mlx.ring_agreements import STEP_SECONDS
from exo.engine.mlx.sampling import PendingToken, SampledToken, SamplingStep
from exo.engine.mlx.shard import ShardModel


class PipelineStage(nn.Module):
    """This rank's part of every forward pass, called as the whole model is: the
    logits on the last rank; elsewhere a placeholder, as the last rank draws.

    Its caches are its layers' and, last, a counter: a KV cache of one scalar
    per token, fed as an attention layer's is. How many tokens the caches hold
    decides what the prefix cache stores (`prefix_cache.cached_length`), and a rank
    whose layers all keep a fixed-size state (linear attention, SSM) could not
    tell otherwise; every rank must decide alike. Each scalar is the token's
    position delta for a model with multimodal positions (`positions`, see
    `multimodal_rope.py`), 0 otherwise."""

    def __init__(
        self, shard: ShardModel, link: Link, positions: ForwardPositions | None = None
    ) -> None:
        super().__init__()
        self._shard = shard
        self._link = link
        object.__setattr__(self, "_tracker", PositionTracker(positions))

    def make_cache(self) -> list[LayerCache]:
        return [*self._shard.make_cache(), KVCache()]

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        images: ImageInputs | None = None,
    ) -> mx.array:
        """`input_embeddings`: on the first rank, a prompt with images as it
        reads; `images`: their positions (every rank) where the model places
        image tokens in 2-D."""
        if cache is None:
            raise PipelineError("a pipeline stage runs on its caches")
        *cache, counter = cache
        with cast(PositionTracker, self._tracker).forward(counter, inputs, images):
            return self._run(inputs, cache, input_embeddings)

    def _run(
        self, inputs: mx.array, cache: list[Any], input_embeddings: mx.array | None
    ) -> mx.array:
        link, shard = self._link, self._shard
        if link.rank == 0:
            out = shard.run(inputs, cache, input_embeddings)
        else:
            _, hidden = link.expect(Op.FORWARD, STEP_SECONDS)
            if hidden is None or hidden.shape[:2] != inputs.shape[:2]:
                raise PipelineError(
                    f"rank {link.left} sent hidden states for {None if hidden is None else hidden.shape[:2]}"
                    f" (rows, tokens), rank {link.rank} expected {inputs.shape[:2]}"
                )
            out = shard.run(hidden, cache)
        if link.is_last:
            return out  # every position's logits: a verify step checks a draft
        link.send(Header.for_payload(Op.FORWARD, out), out)
        return mx.zeros((out.shape[0], 1, 1))


class DrawFailed(Exception):
    """The last rank could not draw a request's token (the request's fault)."""


class RingDraw(SamplingStep):
    """A request's draws on a pipeline rank: the last rank draws with the
    request's own step and sends each token around; the others take them."""

    def __init__(self, step: SamplingStep, link: Link) -> None:
        # No state of its own: `step` holds it (and only the last rank's is used).
        self.params = step.params
        self._step = step
        self._link = link

    @property
    def plain_greedy(self) -> bool:
        return False  # one draw, and one message, per row

    def draw(self, logits: mx.array) -> PendingToken:
        link = self._link
        if link.is_last:
            try:
                sampled = self._step.sample(logits)
            except Exception as error:
                self._send_failure(error)
                raise
            link.send(*token_message(sampled))
            return PendingToken.of(sampled)
        return PendingToken.of(self._receive()[0])

    def verify(self, logits: mx.array, draft: Sequence[int]) -> list[SampledToken]:
        """A draft's check (`SamplingStep.verify`) on the last rank, its tokens sent
        around one `TOKEN` each, every one carrying how many there are."""
        link = self._link
        if link.is_last:
            try:
                tokens = self._step.verify(logits, draft)
            except Exception as error:
                self._send_failure(error)
                raise
            for token in tokens:
                header, payload = token_message(token)
                link.send(replace(header, total=len(tokens)), payload)
            return tokens
        tokens = []
        while True:
            token, count = self._receive()
            tokens.append(token)
            if len(tokens) >= count:
                return tokens

    def _receive(self) -> tuple[SampledToken, int]:
        """A token the last rank drew, and how many its message says it sent."""
        link = self._link
        header, payload = link.expect(Op.TOKEN, STEP_SECONDS)
        if link.rank < link.size - 2:  # on to the ranks before the last
            link.send(header, payload)
        if header.flag:
            raise DrawFailed(np.array(payload).tobytes().decode(errors="replace"))
        return sampled_of(header, payload), max(1, header.total)

    def _send_failure(self, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}".encode()
        payload = mx.array(np.frombuffer(message, dtype=np.uint8))
        self._link.send(Header.for_payload(Op.TOKEN, payload, flag=1), payload)
