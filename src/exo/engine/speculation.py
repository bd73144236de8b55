"""Drafts for speculative decoding: the tokens a reply will likely write next,
guessed from what it copies, so that one forward pass checks several of them
(`batch.py` verifies them, `sampling.SamplingStep.verify` accepts or refuses).

A coding agent's model copies most of what it writes: an edit repeats lines of
a file in the prompt, a tool call repeats paths and names from earlier turns.
Two sources, both lookups in token sequences (no model runs), and a third for
text that copies nothing:

- **Predicted output** (OpenAI's `prediction`): the text the client expects the
  reply to be. While the reply follows it token for token, the draft is its
  continuation; after the reply departs from it, the reply's last tokens are
  looked up in it again (the first occurrence after where the reply last
  followed it), so an edit in the middle of a file costs a few steps only.
- **Prompt lookup**: the reply's last `NGRAM_LONGEST` .. `NGRAM_SHORTEST` tokens
  (longest first) are looked up in the prompt and the reply so far; the draft is
  what followed their most recent earlier occurrence.
- **A draft model** (`--draft-model`, `mlx/draft_model.py`), where neither finds
  a draft: a small model of the same tokenizer writes the next tokens greedily.

How much is drafted adapts per request: the draft grows while drafts are
accepted whole and shrinks to what was accepted otherwise; a request whose
acceptance stays low stops drafting for a while (longer each time), so text that
copies nothing pays for few refused drafts.

A verify step feeds every row of the batch as many tokens as its longest draft
(the others padded), and each fed token costs: `verify_width` weighs the tokens
the rows' drafts are expected to gain (from each request's acceptance so far)
against the step's cost, and picks how far to verify, or a plain step.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A draft model's drafts of one request: up to `limit` tokens to follow a
# sequence (its prompt and reply so far); none where it has none (yet).
ModelDrafts = Callable[[Sequence[int], int], Sequence[int]]

# N-gram lengths looked up, longest first. A 1-gram matches almost anywhere and
# is rarely followed by the same text.
NGRAM_LONGEST = 4
NGRAM_SHORTEST = 2
# Draft lengths: where a request starts, and the bounds of its adaptation.
DRAFT_START = 4
DRAFT_MIN = 2
DRAFT_MAX = 8
# Acceptance: a moving average of the accepted share of each draft; below
# `LOW_ACCEPTANCE` (after `_SETTLE` drafts) drafting pauses for `PAUSE_STEPS`
# decode steps, twice as long at each further pause, up to `PAUSE_MAX`.
LOW_ACCEPTANCE = 0.3
PAUSE_STEPS = 8
PAUSE_MAX = 256
_SETTLE = 3
_AVERAGE_WEIGHT = 0.3  # of the newest draft in the moving average
_FIRST_ACCEPTANCE = 0.7  # a request's estimate before its first draft
# A step's cost, in units of a one-row decode step: each further row of the
# batch, and each further token a row feeds. Measured on a 2-core x86 CPU with
# the 135M built-in model (1 row, 8 tokens: 1.9x a plain step; 4 rows: 1.8x, and
# 8 tokens each 5.6x). A GPU reads the weights once for many more tokens, so
# there drafts cost less than this assumes: the choice is a cautious one.
ROW_COST = 0.2
DRAFT_TOKEN_COST = 0.15


def step_cost(rows: int, width: int) -> float:
    """A decode step of `rows` rows feeding `width` tokens each, in one-row steps."""
    return 1 + ROW_COST * (rows - 1) + DRAFT_TOKEN_COST * rows * (width - 1)


def verify_width(drafts: Sequence[tuple[int, float]]) -> int:
    """How many tokens each row of a batch step should feed (1: a plain step),
    for rows' drafts given as (length, the request's acceptance estimate): the
    width with the most tokens expected per unit of cost. A draft's i-th token
    counts when it and those before it are accepted (estimate ** i). Cutting
    the refused tokens out of the batch cache after it costs next to nothing
    (`batch_order.realign`)."""
    rows = len(drafts)
    best, best_rate = 1, rows / step_cost(rows, 1)
    for width in range(2, 2 + max((length for length, _ in drafts), default=0)):
        expected = sum(
            1 + sum(acceptance**i for i in range(1, min(length, width - 1) + 1))
            for length, acceptance in drafts
        )
        if (rate := expected / step_cost(rows, width)) > best_rate:
            best, best_rate = width, rate
    return best


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    predicted: bool  # from the request's predicted output


@dataclass
class SpeculationStats:
    """A reply's drafting, as its usage reports it."""

    drafted: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    prediction_tokens: int = 0

    def took(self, draft: "Draft") -> None:
        """The reply kept one more of `draft`'s tokens the model accepted."""
        self.accepted += 1
        if draft.predicted:
            self.prediction_accepted += 1

    @property
    def prediction_rejected(self) -> int:
        """Tokens of the predicted output the reply did not take from it."""
        return max(0, self.prediction_tokens - self.prediction_accepted)


class _NgramIndex:
    """Where each n-gram of a growing sequence last ended (its continuation's start)."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_ends`

    def index(self, sequence: Sequence[int], upto: int) -> None:
        """Index the n-grams ending at positions up to `upto` (inclusive)."""
        for end in range(max(self._indexed, 1), upto + 1):
            for n in range(NGRAM_SHORTEST, NGRAM_LONGEST + 1):
                if end >= n:
                    self._ends[tuple(sequence[end - n : end])] = end
        self._indexed = max(self._indexed, upto + 1)

    def continuation(self, sequence: Sequence[int]) -> int | None:
        """Where the latest earlier occurrence of `sequence`'s longest indexed
        suffix ended, or None."""
        for n in range(NGRAM_LONGEST, NGRAM_SHORTEST - 1, -1):
            if len(sequence) >= n and (end := self._ends.get(tuple(sequence[-n:]))) is not None:
                return end
        return None


class _Prediction:
    """The reply's position in its predicted output, while it follows it."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self._starts: dict[tuple[int, ...], list[int]] = {}
        for n in range(NGRAM_SHORTEST, NGRAM_LONGEST + 1):
            for end in range(n, len(self.tokens) + 1):
                self._starts.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        self.cursor: int | None = 0  # the next predicted token, while in step
        self._last = 0  # where the reply last followed it

    def follow(self, token: int) -> None:
        cursor = self.cursor
        if cursor is not None and cursor < len(self.tokens) and self.tokens[cursor] == token:
            self.cursor = self._last = cursor + 1
        else:
            self.cursor = None

    def resync(self, reply: Sequence[int]) -> None:
        """After the reply departed: find its last tokens again, nearest after
        where it last followed."""
        for n in range(NGRAM_LONGEST, NGRAM_SHORTEST - 1, -1):
            ends = self._starts.get(tuple(reply[-n:])) if len(reply) >= n else None
            if ends:
                self.cursor = next((end for end in ends if end >= self._last), ends[0])
                return


class Drafter:
    """One request's drafts; `draft` before each decode step, `record` after."""

    def __init__(
        self,
        prompt: Sequence[int],
        prediction: Sequence[int] = (),
        model: ModelDrafts | None = None,
    ) -> None:
        """`model`: the draft model's drafts, where the prompt and prediction have none."""
        self._model = model
        self._sequence = list(prompt)
        self._reply_start = len(prompt)
        self._index = _NgramIndex()
        self._prediction = _Prediction(prediction) if prediction else None
        self.stats = SpeculationStats(prediction_tokens=len(prediction))
        self.length = DRAFT_START
        self.acceptance = _FIRST_ACCEPTANCE  # the accepted share of drafts, averaged
        self._drafts = 0
        self._paused = 0
        self._pause = PAUSE_STEPS

    def wants_draft(self) -> bool:
        """Whether this decode step drafts (asked once per step): not while
        paused for low acceptance."""
        if self._paused:
            self._paused -= 1
            return False
        return True

    def draft(self, reply: Sequence[int], limit: int) -> Draft | None:
        """Up to `limit` tokens to follow `reply` (the tokens generated so far,
        of which this drafter has seen a prefix), or None."""
        self._catch_up(reply)
        limit = min(limit, self.length)
        if limit <= 0:
            return None
        if (predicted := self._predicted(limit)) is not None:
            return predicted
        sequence = self._sequence
        self._index.index(sequence, len(sequence) - 1)
        start = self._index.continuation(sequence)
        tokens = tuple(sequence[start : start + limit]) if start is not None else ()
        if not tokens and self._model is not None:
            tokens = tuple(self._model(sequence, limit))[:limit]
        return Draft(tokens, predicted=False) if tokens else None

    def record(self, draft: Draft, accepted: int) -> None:
        """How many of `draft`'s tokens the model accepted (a prefix of them);
        those the reply keeps are counted as it takes them (`stats.took`)."""
        self.stats.drafted += len(draft.tokens)
        share = accepted / len(draft.tokens)
        self.length = (
            min(DRAFT_MAX, self.length + 2) if share == 1 else max(DRAFT_MIN, accepted + 1)
        )
        self._drafts += 1
        self.acceptance += _AVERAGE_WEIGHT * (share - self.acceptance)
        if self._drafts >= _SETTLE and self.acceptance < LOW_ACCEPTANCE:
            self._paused, self._pause = self._pause, min(PAUSE_MAX, self._pause * 2)
            self.acceptance, self._drafts = _FIRST_ACCEPTANCE, 0

    def _catch_up(self, reply: Sequence[int]) -> None:
        seen = len(self._sequence) - self._reply_start
        for token in reply[seen:]:
            self._sequence.append(token)
            if self._prediction is not None:
                self._prediction.follow(token)

    def _predicted(self, limit: int) -> Draft | None:
        prediction = self._prediction
        if prediction is None:
            return None
        if prediction.cursor is None:
            prediction.resync(self._sequence[self._reply_start :])
        if prediction.cursor is None:
            return None
        tokens = tuple(prediction.tokens[prediction.cursor : prediction.cursor + limit])
        return Draft(tokens, predicted=True) if tokens else None
