"""Picking the next token of one request: its whole sampling surface, one step at a time.

A generation loop makes one `SamplingStep` per request and hands it each row of
logits the model produces; the step returns the token (and, when the request
asks, its log-probability and the most likely alternatives). The step keeps what
the penalties need from the tokens it has drawn, so the loop passes only logits.

One step, in this order:

1. Logits processors edit the logits (float32): `logit_bias` (added), the
   repetition penalty (over the last `repetition_context_size` tokens of prompt
   and reply: a positive logit is divided by the penalty, a negative one
   multiplied), presence and frequency penalties (OpenAI's: minus
   `presence_penalty` for a token that is already in the reply, minus
   `frequency_penalty` times its count there), then the extra processors a
   caller plugs in, last (a grammar mask has the final word).
2. Log-probabilities (only when asked): the log-softmax of the processed
   logits. A token's `logprob` and `top_logprobs` are these: the model's
   distribution after the processors, before temperature and before the
   top-k / top-p / min-p cut, so they do not depend on how adventurous the
   sampling is (as OpenAI reports them).
3. The choice: `temperature == 0` is argmax. Otherwise top-k, then top-p
   (nucleus, of what top-k kept), then min-p (drop tokens below `min_p` times
   the top token's probability), all on the untempered distribution (the order
   of llama.cpp's default chain), then a draw from the rest at `temperature`.
   Top-p sorts only the most likely `TOP_P_CANDIDATES` tokens (a full sort of
   a 49k vocabulary costs ~6 ms a token on a CPU, ~20 ms under load): the
   nucleus lies among them whenever their mass reaches `top_p` (checked, a
   sync, only when top-k does not bound it already), else the whole vocabulary
   is sorted. Either way the kept tokens are mlx-lm's `apply_top_p`'s, but
   for tokens whose mass above lies within float32 rounding of `top_p`.

Randomness: every request draws from its own key (`seed`, or a random one),
split once per token, never from MLX's global random state, so a seeded reply
is the same whatever other requests run beside it.

`draw` builds the step lazily (the token is an unevaluated array a loop can feed
straight into the model's next forward pass and evaluate asynchronously);
`sample` draws and waits for the values.
"""

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from exo.shared.types.tasks import GenerationParams, SampledLogprob, TokenAlternative

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's shape: (the prompt and the tokens drawn so far, int32 of shape (n,);
logits of shape (1, vocab), float32) -> the edited logits."""

_KEY_SPACE = 2**64
# Top-p's candidates: the nucleus of a peaked distribution has a few dozen tokens;
# a flat one (high temperature text) may need a full sort.
TOP_P_CANDIDATES = 1024


@dataclass(frozen=True, slots=True)
class SampledToken:
    token: int
    # Only with `params.logprobs` (the normalization costs a pass over the vocabulary).
    logprob: float | None
    # Most likely first, `params.top_logprobs` of them; tokens a processor ruled
    # out (log-probability -inf) are left out.
    top_logprobs: tuple[TokenAlternative, ...]

    def reported(self) -> SampledLogprob | None:
        """What a reply reports of this token: None unless logprobs were asked for."""
        if self.logprob is None:
            return None
        return SampledLogprob(
            token=self.token, logprob=self.logprob, top_logprobs=self.top_logprobs
        )


@dataclass(frozen=True, slots=True)
class PendingToken:
    """A token drawn but not evaluated yet."""

    token: mx.array  # shape (1,), int32: the next forward pass's input as is
    logprob: mx.array | None  # shape (1,)
    alternatives: tuple[mx.array, mx.array] | None  # (token ids, logprobs), unsorted

    @staticmethod
    def of(sampled: SampledToken) -> "PendingToken":
        """A token drawn elsewhere (a pipeline's last rank) as if drawn here."""
        top = sampled.top_logprobs
        return PendingToken(
            token=mx.array([sampled.token], dtype=mx.int32),
            logprob=None if sampled.logprob is None else mx.array([sampled.logprob]),
            alternatives=(
                (mx.array([t.token for t in top]), mx.array([t.logprob for t in top]))
                if top
                else None
            ),
        )

    def async_eval(self) -> None:
        mx.async_eval(*self._arrays())

    def resolve(self) -> SampledToken:
        mx.eval(*self._arrays())
        top: tuple[TokenAlternative, ...] = ()
        if self.alternatives is not None:
            ids = cast(list[int], self.alternatives[0].tolist())
            logprobs = cast(list[float], self.alternatives[1].tolist())
            ranked = sorted(zip(logprobs, ids, strict=True), key=lambda pair: (-pair[0], pair[1]))
            top = tuple(TokenAlternative(token=t, logprob=lp) for lp, t in ranked if lp > -math.inf)
        logprob = None if self.logprob is None else cast(float, self.logprob.item())
        return SampledToken(cast(int, self.token.item()), logprob, top)

    def _arrays(self) -> list[mx.array]:
        logprob = [] if self.logprob is None else [self.logprob]
        return [self.token, *logprob, *(self.alternatives or ())]

    @staticmethod
    def async_eval_all(pending: Sequence["PendingToken"]) -> None:
        """Start evaluating several requests' tokens as one graph (one batch step)."""
        mx.async_eval(*(array for token in pending for array in token._arrays()))

    @staticmethod
    def resolve_all(pending: Sequence["PendingToken"]) -> list[SampledToken]:
        """`resolve` of several requests' tokens, waiting once for all of them."""
        mx.eval(*(array for token in pending for array in token._arrays()))
        return [token.resolve() for token in pending]


class SamplingStep:
    """The sampling state of one request. `prompt_tokens` feed the repetition
    penalty's window and the processors; `processors` run after the built-in
    ones, in order."""

    def __init__(
        self,
        params: GenerationParams,
        prompt_tokens: Sequence[int] = (),
        processors: Sequence[LogitsProcessor] = (),
    ) -> None:
        self.params = params
        self._processors = tuple(processors)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._key = mx.random.key(seed % _KEY_SPACE)
        penalty = params.repetition_penalty
        self._repetition_penalty = penalty if penalty is not None and penalty != 1.0 else None
        window = list(prompt_tokens)[-params.repetition_context_size :]
        self._recent = mx.array(window, dtype=mx.int32)
        # What the processors are shown: the prompt, then every token drawn.
        self._seen = mx.array(list(prompt_tokens) if processors else [], dtype=mx.int32)
        # How often each vocabulary token occurs in the reply (sized at the first step).
        self._counts: mx.array | None = None
        bias = params.logit_bias
        self._bias = (
            (mx.array(list(bias), dtype=mx.int32), mx.array(list(bias.values()), dtype=mx.float32))
            if bias
            else None
        )

    @property
    def plain_greedy(self) -> bool:
        """Whether the token is the argmax of the model's logits plus at most a
        `logit_bias`, and nothing is recorded: a batch's rows like this share one
        argmax (`greedy_rows`)."""
        params = self.params
        return (
            params.temperature == 0
            and not params.logprobs
            and self._repetition_penalty is None
            and not params.presence_penalty
            and not params.frequency_penalty
            and not self._processors
        )

    def sample(self, logits: mx.array) -> SampledToken:
        return self.draw(logits).resolve()

    def draw(self, logits: mx.array) -> PendingToken:
        """The next token from one row of logits (shape (vocab,), (1, vocab) or
        (1, 1, vocab)), recorded as part of the reply."""
        vocab = logits.shape[-1]
        if logits.size != vocab:
            raise ValueError(f"expected one row of logits, got shape {logits.shape}")
        processed = self._process(logits.reshape(1, vocab).astype(mx.float32))
        if not self.params.logprobs:
            # The choice needs no normalization; the shift keeps top-p's exp in range.
            shifted = (
                processed
                if self.params.temperature == 0
                else processed - mx.max(processed, axis=-1, keepdims=True)
            )
            token = self._choose(shifted)
            self._record(token, vocab)
            return PendingToken(token, None, None)
        logprobs = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
        token = self._choose(logprobs)
        self._record(token, vocab)
        return PendingToken(
            token=token,
            logprob=mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0],
            alternatives=self._alternatives(logprobs),
        )

    def bias(self, vocab: int) -> tuple[mx.array, mx.array] | None:
        """`logit_bias` as (token ids, values), checked against the vocabulary."""
        if self._bias is not None and max(self.params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names a token id >= {vocab}, the model's vocabulary")
        return self._bias

    def _process(self, logits: mx.array) -> mx.array:
        params = self.params
        vocab = logits.shape[-1]
        if (bias := self.bias(vocab)) is not None:
            logits = logits.at[:, bias[0]].add(bias[1])
        if self._repetition_penalty is not None and self._recent.size:
            penalty = self._repetition_penalty
            recent = mx.zeros((vocab,), mx.float32).at[self._recent].add(1.0) > 0
            penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
            logits = mx.where(recent, penalized, logits)
        if self._counts is not None:
            logits = (
                logits
                - params.frequency_penalty * self._counts
                - params.presence_penalty * (self._counts > 0)
            )
        for processor in self._processors:
            logits = processor(self._seen, logits)
        return logits

    def _choose(self, scores: mx.array) -> mx.array:
        """The token, int32 of shape (1,), from logits up to a shift."""
        if self.params.temperature == 0:
            return mx.argmax(scores, axis=-1).astype(mx.int32)
        self._key, key = mx.random.split(self._key)
        return _categorical(self._filter(scores), key, self._inverse_temperature())

    def _filter(self, scores: mx.array) -> mx.array:
        """Top-k, top-p and min-p of logits up to a shift: the tokens they rule out
        at -inf."""
        params = self.params
        if 0 < params.top_k < scores.shape[-1]:
            scores = apply_top_k(scores, params.top_k)
        if params.top_p < 1.0:
            scores = top_p_filter(
                scores, params.top_p, bounded=0 < params.top_k <= TOP_P_CANDIDATES
            )
        if params.min_p > 0:
            scores = apply_min_p(scores, params.min_p)
        return scores

    def _inverse_temperature(self) -> mx.array:
        return mx.array(1 / self.params.temperature, mx.float32)

    def verify(self, logits: mx.array, draft: Sequence[int]) -> list[SampledToken]:
        """Speculative decoding's check of drafted tokens: `logits` of shape
        (len(draft) + 1, vocab), row i the model's prediction after `draft[:i]`.
        The tokens drawn, recorded as part of the reply: the drafted ones accepted
        (a prefix of `draft`), then one the model chose (where the first refused
        draft token was, or after the whole draft).

        Each row goes through this step as a `draw` would, in order, so penalties
        and a constraint mask see the tokens accepted before it (a token the
        mask refuses has probability 0: the draft ends there). Greedy: a drafted
        token is accepted when it is the argmax. Sampling: with the probability
        the sampling distribution gives it (the draft is deterministic, so this
        is the standard speculative-sampling rule min(1, p/q) with q = 1), and on
        refusal the token is drawn from that distribution without the refused
        token; either way each token's distribution is what `draw` would have
        sampled from, and a seed reproduces the reply."""
        if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
            raise ValueError(f"expected {len(draft) + 1} rows of logits, got shape {logits.shape}")
        if self.plain_greedy:
            vocab = logits.shape[-1]
            if (bias := self.bias(vocab)) is not None:
                logits = logits.astype(mx.float32).at[:, bias[0]].add(bias[1])
            chosen = cast(list[int], mx.argmax(logits, axis=-1).tolist())
            taken = next(
                (i for i, (d, c) in enumerate(zip(draft, chosen[:-1], strict=True)) if d != c),
                len(draft),
            )
            return [SampledToken(token, None, ()) for token in chosen[: taken + 1]]
        tokens: list[SampledToken] = []
        for i in range(len(draft) + 1):
            pending = self._verify_row(logits[i : i + 1], draft[i] if i < len(draft) else None)
            token = pending.resolve()
            tokens.append(token)
            if i == len(draft) or token.token != draft[i]:
                break
        return tokens

    def _verify_row(self, logits: mx.array, drafted: int | None) -> PendingToken:
        """One row of `verify`: `drafted` accepted or another token drawn."""
        vocab = logits.shape[-1]
        processed = self._process(logits.astype(mx.float32))
        logprobs = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
        scores = (
            logprobs
            if self.params.logprobs
            else processed - mx.max(processed, axis=-1, keepdims=True)
        )
        if drafted is None:
            token = self._choose(scores)
        elif self.params.temperature == 0:
            token = mx.argmax(scores, axis=-1).astype(mx.int32)
        else:
            self._key, key = mx.random.split(self._key)
            accept_key, redraw_key = mx.random.split(key)
            filtered = self._filter(scores)
            probabilities = mx.softmax(filtered * self._inverse_temperature(), axis=-1)
            accepted = mx.random.uniform(key=accept_key) < probabilities[0, drafted]
            if cast(bool, accepted.item()):
                token = mx.array([drafted], dtype=mx.int32)
            else:
                refused = filtered.at[:, drafted].add(-mx.inf)
                token = _categorical(refused, redraw_key, self._inverse_temperature())
        self._record(token, vocab)
        if not self.params.logprobs:
            return PendingToken(token, None, None)
        return PendingToken(
            token=token,
            logprob=mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0],
            alternatives=self._alternatives(logprobs),
        )

    def _record(self, token: mx.array, vocab: int) -> None:
        params = self.params
        if params.presence_penalty or params.frequency_penalty:
            counts = self._counts if self._counts is not None else mx.zeros((vocab,), mx.float32)
            self._counts = counts.at[token].add(1.0)
        if self._repetition_penalty is not None:
            window = params.repetition_context_size
            self._recent = mx.concatenate([self._recent, token])[-window:]
        if self._processors:
            self._seen = mx.concatenate([self._seen, token])

    def _alternatives(self, logprobs: mx.array) -> tuple[mx.array, mx.array] | None:
        count = min(self.params.top_logprobs, logprobs.shape[-1])
        if count == 0:
            return None
        ids = mx.argpartition(-logprobs, kth=count - 1, axis=-1)[:, :count]
        return ids[0], mx.take_along_axis(logprobs, ids, axis=-1)[0]


def greedy_rows(logits: mx.array, steps: Sequence[SamplingStep]) -> list[PendingToken]:
    """The tokens of a batch's rows (logits of shape (rows, vocab)) whose steps are
    all `plain_greedy`: their biases added in one scatter, one argmax for all."""
    biased = [
        (row, bias) for row, step in enumerate(steps) if (bias := step.bias(logits.shape[-1]))
    ]
    if biased:
        rows = mx.concatenate([mx.full(ids.shape, row, mx.int32) for row, (ids, _) in biased])
        ids = mx.concatenate([ids for _, (ids, _) in biased])
        values = mx.concatenate([values for _, (_, values) in biased])
        logits = logits.astype(mx.float32).at[rows, ids].add(values)
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    return [PendingToken(tokens[i : i + 1], None, None) for i in range(len(steps))]


@mx.compile
def _categorical(scores: mx.array, key: mx.array, inverse_temperature: mx.array) -> mx.array:
    """A draw from softmax(scores * inverse_temperature) with `key`, as int32.
    Compiled (as mlx-lm's sampler is): the Gumbel noise, scaling and argmax
    over the vocabulary fuse into fewer passes than one per operation."""
    return mx.random.categorical(scores * inverse_temperature, key=key).astype(mx.int32)


def top_p_filter(scores: mx.array, top_p: float, bounded: bool) -> mx.array:
    """`apply_top_p(scores, top_p)` (scores of shape (1, vocab), logits up to a
    shift), sorting only the top `TOP_P_CANDIDATES` tokens when the nucleus lies
    among them. `bounded`: top-k left no more finite scores than that, so it does."""
    vocab = scores.shape[-1]
    count = min(TOP_P_CANDIDATES, vocab)
    probs = mx.exp(scores)
    total = mx.sum(probs, axis=-1, keepdims=True)
    ids = mx.argpartition(-scores, kth=count - 1, axis=-1)[:, :count]
    candidates = -mx.sort(-mx.take_along_axis(scores, ids, axis=-1), axis=-1)
    # As in apply_top_p: a token is kept while the mass above it is below top_p.
    mass_above = mx.cumsum(mx.exp(candidates), axis=-1, inclusive=False)
    kept = (mass_above < top_p * total).sum(axis=-1, keepdims=True)
    if not bounded and count < vocab and cast(int, kept.item()) == count:
        return apply_top_p(scores, top_p)  # the nucleus may reach past the candidates
    threshold = mx.take_along_axis(candidates, kept - 1, axis=-1)
    return mx.where(scores < threshold, -mx.inf, scores)
