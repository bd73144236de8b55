"""Grammar-constrained sampling: a token mask from llguidance, applied to the
logits before sampling, so the reply is valid by construction.

    compiled = compile_constraint(tokenizer, constraint)   # cached per (tokenizer, grammar)
    matcher = compiled.matcher()                            # one per request
    generate_step(prompt, model, logits_processors=[matcher], ...)

or, for a request, `request_sampling(params, prompt, tokenizer)`: its
`SamplingStep`, with the matcher of `params.constraint` as its last processor.

Only sampling is touched: the matcher needs the tokenizer and the tokens
sampled so far, nothing of the model. So it runs where the logits are sampled
(the one rank of a local model, the last rank of a pipeline); other ranks never
see it.

Per step, llguidance writes the allowed tokens as a bitmask (one bit per token)
into a numpy buffer the matcher reuses; numpy unpacks it to one byte per token,
which goes to MLX once, and disallowed logits become -inf (~10 us to fill,
~40 us to build and apply on a CPU, for a 49k vocabulary). Once the grammar is
complete, only EOS is allowed, so generation ends.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast
from weakref import WeakKeyDictionary

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.constraint_grammar import (
    ConstraintError,
    constraint_grammar,
    describe_grammar_error,
)
from exo.engine.mlx.sampling import SamplingStep
from exo.shared.types.constraints import Constraint
from exo.shared.types.tasks import GenerationParams

# An agent's tool set compiles in ~10 ms; a runner sees few distinct ones.
_COMPILED_PER_TOKENIZER = 32


class ConstraintMatcher:
    """One request's position in the grammar: an mlx-lm logits processor
    `(tokens, logits) -> logits` that masks the tokens the grammar does not allow.

    Each call after the first consumes `tokens[-1]`, the token sampled from the
    previous mask (unless `advance` already did), so it fits `generate_step`
    and a loop that samples the first token itself alike."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._awaiting_token = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._awaiting_token:
            # The forward pass does not need the mask: start it before waiting
            # for the token it follows, so the mask is built while it runs.
            mx.async_eval(logits)
            self.advance(cast(int, tokens[-1].item()))
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        self._awaiting_token = True
        return mx.where(self._allowed(logits.shape[-1]), logits, -mx.inf)

    def advance(self, token: int) -> None:
        """Consume `token`, sampled from the last mask."""
        self._awaiting_token = False
        if not self._matcher.consume_token(token):
            raise RuntimeError(
                f"token {token} was sampled outside the grammar: {self._matcher.get_error()}"
            )

    def is_finished(self) -> bool:
        """Whether the tokens consumed so far complete the grammar: only EOS may follow."""
        return self._matcher.is_stopped()

    def _allowed(self, vocab_size: int) -> mx.array:
        # One byte per token, a fresh array (the bitmask buffer is refilled next step);
        # the words are little-endian, so bit i of word w is token 32 * w + i.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        if bits.size < vocab_size:  # a head wider than the tokenizer: those rows are no tokens
            bits = np.pad(bits, (0, vocab_size - bits.size))
        return mx.array(bits[:vocab_size], dtype=mx.bool_)


class CompiledConstraint:
    """A constraint compiled for one tokenizer; each request gets its own matcher."""

    def __init__(self, pristine: llguidance.LLMatcher, vocab_size: int) -> None:
        self._pristine = pristine
        self._vocab_size = vocab_size

    def matcher(self) -> ConstraintMatcher:
        return ConstraintMatcher(self._pristine.deep_copy(), self._vocab_size)


class _TokenizerGrammars:
    """llguidance's view of one tokenizer (~0.4 s to build) and the grammars
    compiled against it, least recently used first."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        hf_tokenizer = tokenizer._tokenizer
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
        )
        self.special_tokens: dict[str, int] = {
            token.content: token_id
            for token_id, token in hf_tokenizer.added_tokens_decoder.items()
            if token.special
        }
        self.compiled: OrderedDict[str, CompiledConstraint] = OrderedDict()
        self.lock = threading.Lock()


_grammars: WeakKeyDictionary[TokenizerWrapper, _TokenizerGrammars] = WeakKeyDictionary()
_grammars_lock = threading.Lock()


def compile_constraint(tokenizer: TokenizerWrapper, constraint: Constraint) -> CompiledConstraint:
    """Compile `constraint` for `tokenizer`, or reuse the compilation of an equal
    grammar. Raises `ConstraintError` when llguidance cannot compile it."""
    with _grammars_lock:
        grammars = _grammars.get(tokenizer)
        if grammars is None:
            grammars = _grammars[tokenizer] = _TokenizerGrammars(tokenizer)
    grammar = constraint_grammar(constraint, grammars.special_tokens)
    with grammars.lock:
        compiled = grammars.compiled.get(grammar)
        if compiled is not None:
            grammars.compiled.move_to_end(grammar)
            return compiled
    pristine = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
    if pristine.is_error():
        raise ConstraintError(describe_grammar_error(constraint, pristine.get_error()))
    compiled = CompiledConstraint(pristine, grammars.tokenizer.vocab_size)
    with grammars.lock:
        grammars.compiled[grammar] = compiled
        while len(grammars.compiled) > _COMPILED_PER_TOKENIZER:
            grammars.compiled.popitem(last=False)
    return compiled


def request_sampling(
    params: GenerationParams, prompt_tokens: Sequence[int], tokenizer: TokenizerWrapper
) -> SamplingStep:
    """One request's `SamplingStep`: its constraint's mask, if it has one, has the
    last word. Raises `ConstraintError` when the constraint cannot be compiled."""
    if params.constraint is None:
        return SamplingStep(params, prompt_tokens)
    matcher = compile_constraint(tokenizer, params.constraint).matcher()
    return SamplingStep(params, prompt_tokens, processors=[matcher])
