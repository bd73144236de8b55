"""A draft model: a small model with the served model's tokenizer, which drafts
the next tokens of a reply that copies nothing (where `speculation.Drafter`'s
prompt lookup and predicted output find no draft), for the served model to
verify as it verifies every draft (`batch.ContinuousBatcher._verify`).

Each request keeps a `DraftRow`: the draft model's KV of its own (one row), a
copy of the request's prompt and reply so far. Before each draft the row is
brought up to date: where the reply refused the row's last draft, its cache is
cut back to the tokens they share (it knows the tokens it holds), and the
tokens the reply added since are read. A long prompt is read a chunk per decode
step (`CATCH_UP_TOKENS`), so no step of the served model waits for more than a
chunk of the small one; the row drafts once it has caught up. A draft is the
small model's greedy tokens, built as one lazy graph and read back once.

Only runners that hold the whole model draft with one: a split instance's ranks
would each need the draft model and to draft exactly alike.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.load import load_for_inference, parameter_bytes

# Prompt tokens a row reads per decode step before it drafts.
CATCH_UP_TOKENS = 256
# A row's KV in the draft model grows with its context: a request with a longer
# context drafts from its prompt and prediction only.
MAX_CONTEXT_TOKENS = 32768


class DraftModelRefused(ValueError):
    """The draft model cannot draft for the served model."""


def tokenizer_mismatch(served: TokenizerWrapper, draft: TokenizerWrapper) -> str | None:
    """Why `draft`'s tokens are not `served`'s (None: they are the same)."""
    served_vocab, draft_vocab = served.vocab_size, draft.vocab_size
    if served.get_vocab() != draft.get_vocab():
        return f"their vocabularies differ ({served_vocab} and {draft_vocab} tokens)"
    if set(served.eos_token_ids) != set(draft.eos_token_ids):
        return "their end-of-sequence tokens differ"
    return None


class DraftModel:
    """A loaded draft model, checked against the served model's tokenizer."""

    def __init__(self, model: nn.Module, name: str = "the draft model") -> None:
        caches = make_prompt_cache(model)
        if not all(cache.is_trimmable() for cache in caches):
            raise DraftModelRefused(
                f"{name} keeps caches that cannot be cut back (sliding windows or "
                "state), so its refused drafts could not be undone"
            )
        self.model = model
        self.name = name
        self.nbytes = parameter_bytes(model)

    @classmethod
    def load(cls, model_dir: Path, served: TokenizerWrapper) -> "DraftModel":
        """The draft model in `model_dir`, refused when its tokenizer is not `served`'s."""
        model, tokenizer = load_for_inference(model_dir)
        if (why := tokenizer_mismatch(served, tokenizer)) is not None:
            raise DraftModelRefused(
                f"{model_dir.name} cannot draft for this model: {why}; a draft model "
                "must share the served model's tokenizer (a smaller model of its family)"
            )
        return cls(model, model_dir.name)

    def row(self) -> "DraftRow":
        return DraftRow(self)


class DraftRow:
    """One request's drafts from the draft model (see the module docstring)."""

    def __init__(self, draft_model: DraftModel) -> None:
        self._model = draft_model.model
        self._name = draft_model.name
        self._cache: list[Any] = make_prompt_cache(self._model)
        self._held: list[int] = []  # the tokens in the cache
        self._failed = False

    def __call__(self, sequence: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens to follow `sequence` (the prompt and the reply so
        far); none while the row catches up, or where it cannot draft."""
        if self._failed or limit <= 0 or not 0 < len(sequence) <= MAX_CONTEXT_TOKENS:
            return ()
        try:
            return self._draft(sequence, limit)
        except Exception as error:  # drafts only save time: the reply goes on without
            self._failed = True
            logger.opt(exception=error).warning(f"{self._name} stopped drafting for a request")
            return ()

    def _draft(self, sequence: Sequence[int], limit: int) -> tuple[int, ...]:
        held = self._held
        shared = 0
        for mine, theirs in zip(held, sequence, strict=False):
            if mine != theirs:
                break
            shared += 1
        if shared == len(sequence):  # never: the last token is always fed below
            shared -= 1
        if shared < len(held):
            for cache in self._cache:
                cache.trim(len(held) - shared)
            del held[shared:]
        pending = list(sequence[shared:])
        if len(pending) - 1 > CATCH_UP_TOKENS:
            chunk = pending[:CATCH_UP_TOKENS]
            self._model(mx.array([chunk]), cache=self._cache)
            mx.eval([cache.state for cache in self._cache])
            held += chunk
            return ()
        drafted: list[mx.array] = []
        inputs = mx.array([pending])
        for _ in range(limit):
            token = mx.argmax(self._model(inputs, cache=self._cache)[:, -1, :], axis=-1)
            drafted.append(token)
            inputs = token[None]
        mx.eval(drafted)
        tokens = tuple(cast(list[int], mx.concatenate(drafted).tolist()))
        # Fed: the pending tokens and every drafted one but the last.
        held += pending + list(tokens[:-1])
        return tokens
