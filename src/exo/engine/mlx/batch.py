"""Continuous batching: the requests a runner holds decode together (a whole
model's, or every rank's of a split instance, in lockstep: `lockstep.py`).

Each `step()` is a bounded piece of work: prompt reading worth one prefill chunk
(a chunk of the oldest request still reading its prompt, or the short prompts
of several read together in one forward pass, right-padded as mlx-lm's
`BatchGenerator` reads them, for models whose caches keep no state), then one
decode step of every request in the
batch. A new request's prompt is thus read between decode steps, and its first
token never waits for other replies to end.

A request whose prompt is read joins the batch with its last prompt token as
its next input: the decode step draws its first token along with the other
rows' next ones (one forward pass for a burst of new requests, not one each),
and that step's tokens are read back at once so the first token goes out
without waiting for a further step. Caches that cannot be cut back need a
checkpoint of the prompt before the reply: such a request draws its first
token on its own, as the one-at-a-time loop does, and stores it first.

Per request, as in the one-at-a-time loop (`generate.TextGenerator`, whose
prefill, checkpoints and cache stores this reuses): its prefix-cache restore and
store, its `SamplingStep` (params, seed, penalties, constraint mask), its stop
rules and text stream. Shared: one forward pass per decode step over the
batch's KV cache (mlx-lm's batch caches: rows left-padded to a common length and
masked). A request joins the batch once its first token is drawn (its own cache
merged in) and leaves it when its reply ends (its row extracted and stored in
the prefix cache, then filtered out).

Failures: what one row does alone (drawing its token: sampling, penalties,
constraint mask; turning it into text: detokenizer, stop strings; storing its
KV) fails that row only, which leaves the batch unstored while the others go
on. A failure of what the rows share (the forward pass, reading the step's
tokens back, the batch cache) fails every row in the batch, whose cache may
hold a half-done step and is dropped; requests still reading their prompts,
and those that come later, start a new one.

Decode computes one step ahead, as the one-at-a-time loop does: a step's forward
pass is queued on the tokens the previous step drew before those are read back,
so turning tokens into text overlaps the model. A row that ends at EOS or a stop
string has had one more step computed for it, which is dropped; that step puts
its last token's KV in the cache, so the stored reply keeps its end-of-turn
token. A batch of up to the model's `eager_rows` is the exception: its tokens
are read back in the step that drew them (`LocalModel.eager_rows` says why and
what becomes of a reply's last token).

Speculative decoding (`engine/speculation.py`): a request may draft the tokens
it will likely write next (from its prompt, or the predicted output it was sent
with). A decode step where a draft is worth its cost (`verify_width`) is a
verify step: every row feeds its next input and its draft in one forward pass,
its `SamplingStep` accepts a prefix of the draft and draws one more token, and
the batch cache is cut back to what each row kept (`batch_order.realign`:
without copying what the rows hold). Such a step reads its tokens back within
it, as the next drafts depend on them. Only models whose caches can be cut
back per row speculate (`can_speculate`).
"""

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from exo.engine.mlx.batch_order import RowOrder, extract, realign
from exo.engine.mlx.draft_model import DraftModel
from exo.engine.mlx.generate import (
    DECODE_STREAM,
    Finished,
    GenerationOutput,
    TextGenerator,
    TextStream,
)
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache, needs_checkpoints
from exo.engine.mlx.sampling import PendingToken, SampledToken, SamplingStep, greedy_rows
from exo.engine.mlx.vision import ImagePrompt
from exo.engine.speculation import Draft, Drafter, verify_width
from exo.shared.prompt_images import PromptImage, is_image_key
from exo.shared.types.tasks import GenerationParams

# How many requests decode together at most (the node's admission control
# usually bounds it first: `--max-concurrent`).
MAX_BATCH = 32


@dataclass(frozen=True)
class PromptProgress:
    done: int
    total: int


@dataclass(frozen=True)
class GenerationFailed:
    error: Exception


BatchOutput = GenerationOutput | PromptProgress | GenerationFailed
Outputs = list[tuple[str, BatchOutput]]  # a step's, by task id


class Batch(Protocol):
    """What the loop serves tasks with (`ContinuousBatcher`, `OneAtATime`)."""

    @property
    def max_batch(self) -> int: ...

    @property
    def idle(self) -> bool: ...

    @property
    def prefix_cache(self) -> KVPrefixCache | None: ...

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> PromptProgress | None:
        """Take a request; its progress so far, or None when it reports it as it
        reads its prompt. Raises (and takes nothing) for an invalid request.
        `images`: where `tokens` holds images (`shared/prompt_images.py`)."""
        ...

    def cancel(self, task_id: str) -> bool: ...

    def step(self) -> list[tuple[str, BatchOutput]]: ...


def prompts_read_together(layers: Sequence[LayerCache]) -> bool:
    """Whether a model with these caches (all its layers') reads short prompts
    together: only where no cache keeps a state (`ContinuousBatcher`)."""
    return not needs_checkpoints(layers)


def can_speculate(layers: Sequence[LayerCache]) -> bool:
    """Whether a model with these caches (all its layers') verifies drafts: each
    row's refused draft tokens must be cut from the batch cache, which mlx-lm's
    `BatchKVCache` can do (`ContinuousBatcher._verify`); rotating, quantized and
    state-keeping caches cannot."""
    return all(type(layer) is KVCache for layer in layers)


def can_batch(layers: Sequence[LayerCache]) -> bool:
    """Whether every layer's cache has a batched form (mlx-lm's `merge`)."""
    return all(callable(getattr(layer, "merge", None)) for layer in layers)


@dataclass(eq=False)  # one object per request: sets of rows go by identity
class _Request:
    task_id: str
    tokens: Sequence[int]
    params: GenerationParams
    layers: list[LayerCache]  # its own cache, until it joins the batch
    sampling: SamplingStep
    stream: TextStream
    # Its caches cannot be cut back: its prompt is read on its own (with the
    # system prompt's checkpoint) and a checkpoint stored before its reply.
    checkpoints: bool
    # Its prompt's images, read as embeddings (where this rank reads them); a
    # prompt with images is read on its own on every rank.
    images: ImagePrompt | None
    read: int = 0  # prompt tokens in its cache (restored or prefilled)
    generated: list[int] = field(default_factory=list[int])
    # In the batch: the token its next decode step feeds in, and the token drawn
    # by the last step (queued, not read back yet).
    input: mx.array | None = None
    pending: PendingToken | None = None
    drafter: Drafter | None = None  # speculative decoding on
    # Where its tokens sit in its span of the batch cache (`batch_order`).
    order: RowOrder = None


class ContinuousBatcher:
    """Serves many requests at once on a `LocalModel`; see the module docstring."""

    def __init__(
        self,
        generator: TextGenerator,
        max_batch: int = MAX_BATCH,
        prompts_together: bool = True,
        speculate: bool = False,
        draft_model: DraftModel | None = None,
    ) -> None:
        """`prompts_together`: short prompts may be read in one forward pass,
        right-padded. Not for models whose caches keep a state (SSM, linear
        attention): whether padding is kept out of it is each mlx-lm model's to
        get right, and not all do (mlx-lm 0.32.2's nemotron_h Mamba layers take
        the state at the last, padded, position). A split instance's ranks
        decide it alike, from the whole model's caches (`prompts_read_together`).

        `speculate`: requests that ask for it (`params.speculation`) decode with
        drafts (`engine/speculation.py`), verified in the batch's steps; only
        for models whose caches allow it (`can_speculate`, of the whole model's
        caches on every rank of a split instance); with `draft_model`, text that
        copies nothing is drafted by it (a whole model's runner only)."""
        self._generator = generator
        self._draft_model = draft_model if speculate else None
        self._model = generator.forward
        self.max_batch = max_batch
        self._prompts_together = prompts_together
        self._speculate = speculate
        self._reading: deque[_Request] = deque()
        self._chunks: dict[str, Iterator[int]] = {}  # prefill, by task id
        self._rows: list[_Request] = []
        self._cache: list[LayerCache] = []

    @classmethod
    def for_caches(
        cls,
        generator: TextGenerator,
        caches: Sequence[LayerCache],
        draft_model: DraftModel | None = None,
    ) -> "ContinuousBatcher":
        """A batcher doing what a model with these caches (all its layers', the
        whole model's on a split instance's ranks) allows: short prompts read
        together, speculative decoding (with `draft_model`'s drafts too)."""
        return cls(
            generator,
            prompts_together=prompts_read_together(caches),
            speculate=can_speculate(caches),
            draft_model=draft_model,
        )

    @property
    def prefix_cache(self) -> KVPrefixCache | None:
        return self._generator.prefix_cache

    @property
    def idle(self) -> bool:
        return not self._reading and not self._rows

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> PromptProgress:
        """Take a request; it reads its prompt in later steps. Raises (and takes
        nothing) when the request is invalid, e.g. an uncompilable constraint."""
        generator = self._generator
        match, layers = generator.start(tokens, params)
        prompt = generator.image_prompt(tokens, images)
        ids = prompt.ids if prompt is not None else generator.model_ids(tokens)
        drafter = None
        if self._speculate and params.speculation:
            model = self._draft_model.row() if self._draft_model is not None else None
            drafter = Drafter(ids, params.prediction, model)
        request = _Request(
            task_id=task_id,
            tokens=tokens,
            params=params,
            layers=layers,
            sampling=self._model.sampling_for(params, ids),
            stream=TextStream(
                generator.tokenizer,
                params,
                len(tokens),
                match.usable,
                drafter.stats if drafter is not None else None,
            ),
            checkpoints=generator.prefix_cache is not None
            and generator.prefix_cache.needs_checkpoints(layers),
            images=prompt,
            read=match.usable,
            drafter=drafter,
        )
        self._chunks[task_id] = generator.prefill_chunks(
            tokens[:-1],
            match.usable,
            layers,
            generator.checkpoint_at(system_prompt_length, layers),
            prompt,
        )
        self._reading.append(request)
        return PromptProgress(match.usable, len(tokens) - 1)

    def cancel(self, task_id: str) -> bool:
        """Drop a request (its cache is not stored); whether it was here."""
        for request in self._reading:
            if request.task_id == task_id:
                self._reading.remove(request)
                self._chunks.pop(task_id, None)
                return True
        for row in self._rows:
            if row.task_id == task_id:
                self._leave({row})
                return True
        return False

    def step(self) -> Outputs:
        """Prompt reading worth up to one prefill chunk (a chunk of the oldest
        request, or the short prompts of several), then one decode step: what they
        let out, by task id. A failure fails the requests it touched, never the
        batcher (see the module docstring)."""
        outputs: Outputs = []
        budget = self._generator.prefill_step_tokens
        while self._reading and len(self._rows) < self.max_batch and budget > 0:
            group = self._short_prompts(budget)
            if group:
                budget -= max(1, sum(len(r.tokens) - 1 - r.read for r in group))
                for _ in group:
                    self._chunks.pop(self._reading.popleft().task_id, None)
                try:
                    outputs.extend(self._read_together(group))
                except Exception as error:
                    outputs.extend((r.task_id, GenerationFailed(error)) for r in group)
                continue
            request = self._reading[0]
            before = request.read
            try:
                outputs.extend((request.task_id, o) for o in self._read(request))
            except Exception as error:
                if self._reading and self._reading[0] is request:  # else `_read` took it
                    self._reading.popleft()
                self._chunks.pop(request.task_id, None)
                outputs.append((request.task_id, GenerationFailed(error)))
            budget -= max(1, request.read - before)
        if self._rows:
            try:
                self._decode(outputs)
            except Exception as error:
                # What the rows share failed, and the batch cache may hold a
                # half-done step: every row still replying fails.
                outputs.extend(
                    (row.task_id, GenerationFailed(error))
                    for row in self._rows
                    if not row.stream.finished
                )
                self._rows, self._cache = [], []
        return outputs

    def _short_prompts(self, budget: int) -> list[_Request]:
        """The oldest reading requests whose prompts' rest fits in `budget`
        together (and in the batch), to read in one forward pass; none when the
        oldest one's does not (it is read a chunk at a time)."""
        group: list[_Request] = []
        if not self._prompts_together:
            return group
        room, total = self.max_batch - len(self._rows), 0
        for request in self._reading:
            rest = len(request.tokens) - 1 - request.read
            alone = request.checkpoints or any(map(is_image_key, request.tokens))
            if len(group) == room or alone or total + rest > budget:
                break
            group.append(request)
            total += rest
        return group

    def _read_together(self, group: list[_Request]) -> Outputs:
        """The rest of each prompt but its last token, all in one forward pass
        (right-padded to the longest; each row's cache, restored or empty, merged
        into a batch cache left-padded to the longest), then they join the batch."""
        rests = [list(r.tokens[r.read : -1]) for r in group]
        lengths = [len(rest) for rest in rests]
        longest = max(lengths)
        merged = [
            type(layers[0]).merge(list(layers))
            for layers in zip(*(r.layers for r in group), strict=True)
        ]
        if longest:
            padding = [longest - length for length in lengths]
            for layer in merged:
                layer.prepare(lengths=lengths, right_padding=padding)
            inputs = mx.array([rest + [0] * pad for rest, pad in zip(rests, padding, strict=True)])
            self._model.model(inputs, cache=merged)
            for layer in merged:
                layer.finalize()
            mx.eval([layer.state for layer in merged])
        outputs: Outputs = []
        for request in group:
            request.read = len(request.tokens) - 1
            request.layers = []
            request.input = mx.array([request.tokens[-1]], dtype=mx.int32)
            outputs.append((request.task_id, PromptProgress(request.read, request.read)))
        self._add_rows(group, merged)
        return outputs

    def _read(self, request: _Request) -> list[BatchOutput]:
        """The next prefill chunk of `request`; once its prompt is read, it joins
        the batch (a request storing a prompt checkpoint draws its first token
        first, and may end there)."""
        tokens, layers = request.tokens, request.layers
        outputs: list[BatchOutput] = []
        done = next(self._chunks[request.task_id], None)
        if done is not None:
            request.read = done
            outputs.append(PromptProgress(done, len(tokens) - 1))
            if done < len(tokens) - 1:
                return outputs
        self._reading.popleft()
        del self._chunks[request.task_id]
        if not request.checkpoints:
            request.input = mx.array([tokens[-1]], dtype=mx.int32)
            self._join(request)
            return outputs
        logits = self._model.model(mx.array([[tokens[-1]]]), cache=layers)[:, -1, :]
        first = request.sampling.sample(logits)
        request.read = len(tokens)
        request.generated.append(first.token)
        outputs.extend(request.stream.feed(first))
        self._generator.store_prompt_checkpoint(tokens, layers)
        if request.stream.finished:
            self._generator.store_reply(tokens, request.generated, layers)
        else:
            request.input = mx.array([first.token], dtype=mx.int32)
            self._join(request)
        return outputs

    def _join(self, request: _Request) -> None:
        merged = [type(layer).merge([layer]) for layer in request.layers]
        request.layers = []
        self._add_rows([request], merged)

    def _add_rows(self, requests: list[_Request], cache: list[LayerCache]) -> None:
        """`requests` join the batch; `cache` holds their rows, in their order."""
        if not self._rows:
            self._cache = cache
        else:
            for mine, theirs in zip(self._cache, cache, strict=True):
                mine.extend(theirs)
        self._rows.extend(requests)

    def _decode(self, outputs: Outputs) -> None:
        """One decode step of the batch. Its outputs go to `outputs` as they come,
        so that those before a shared failure (which raises) are kept; a row's own
        failure is its `GenerationFailed` there, and it leaves the batch."""
        # A row whose queued token is its last by `max_tokens` ends before the
        # step: no forward pass is spent on it.
        last = [row for row in self._rows if self._ends_with_pending(row)]
        if last:
            failed = self._read_back(last, outputs)
            self._leave({row for row in last if row not in failed}, outputs)
            self._leave(failed)
        if not self._rows:
            return
        drafting = {row for row in self._rows if row.drafter and row.drafter.wants_draft()}
        if drafting:
            drafts = self._drafts(drafting, outputs)
            if any(drafts):
                self._verify(drafts, outputs)
                return
            if not self._rows:
                return
        rows = self._rows
        inputs = mx.concatenate([row.input for row in rows if row.input is not None])
        with mx.stream(DECODE_STREAM):
            logits = self._model.model(inputs[:, None], cache=self._cache)[:, -1, :]
            drawn = self._draw(rows, logits)
        failed = set[_Request]()
        for row, pending in zip(rows, drawn, strict=True):
            if isinstance(pending, Exception):
                outputs.append((row.task_id, GenerationFailed(pending)))
                failed.add(row)
        PendingToken.async_eval_all([p for p in drawn if isinstance(p, PendingToken)])
        # Rows that fed their last prompt token: their first token is read back
        # now. So are a batch's of up to `eager_rows` (`LocalModel.eager_rows`).
        eager = len(rows) <= self._model.eager_rows
        new = {row for row in rows if eager or not row.generated}
        failed |= self._read_back([row for row in rows if row not in failed], outputs)
        for row, pending in zip(rows, drawn, strict=True):
            if isinstance(pending, PendingToken):
                row.pending, row.input = pending, pending.token
        # A row the first read-back ended (a batch that just shrank to eager size)
        # leaves as in step-ahead mode: its last token fed, the extra one dropped.
        fresh = [row for row in rows if row in new and row not in failed]
        fresh = [row for row in fresh if not row.stream.finished]
        if fresh:
            failed |= self._read_back(fresh, outputs)
        self._leave({row for row in rows if row.stream.finished and row not in failed}, outputs)
        self._leave(failed)

    def _drafts(self, drafting: set[_Request], outputs: Outputs) -> list[Draft | None]:
        """Each row's draft for this step, if it is `drafting`: by the tokens it
        has drawn, so queued tokens are read back first (losing the overlap of a
        step computed ahead), and rows they end leave."""
        queued = [row for row in self._rows if row.pending is not None]
        if queued:
            failed = self._read_back(queued, outputs)
            self._leave(
                {row for row in queued if row.stream.finished and row not in failed}, outputs
            )
            self._leave(failed)
        drafts: list[Draft | None] = []
        expected: list[tuple[int, float]] = []  # (length, acceptance) per row
        for row in self._rows:
            # Never past `max_tokens`: the draft and the token after it fit.
            room = row.params.max_tokens - len(row.generated) - 1
            drafter = row.drafter if row in drafting else None
            draft = drafter.draft(row.generated, room) if drafter is not None else None
            drafts.append(draft)
            expected.append(
                (len(draft.tokens), drafter.acceptance) if draft and drafter else (0, 0)
            )
        width = verify_width(expected)
        return [
            Draft(draft.tokens[: width - 1], draft.predicted) if draft and width > 1 else None
            for draft in drafts
        ]

    def _verify(self, drafts: list[Draft | None], outputs: Outputs) -> None:
        """One decode step that checks the rows' drafts: each row feeds its next
        input and its draft (padded to the longest) in one forward pass, and
        `SamplingStep.verify` takes the draft tokens the model agrees with and
        one more. Every row's tokens are read back within the step (the next
        drafts depend on them). Each row's cache then keeps exactly the tokens
        it fed that its reply kept, as a plain step's would: the batch cache is
        cut back by the fewest refused positions, and each row's further ones
        leave its span (`batch_order.realign`)."""
        rows = self._rows
        width = 1 + max(len(draft.tokens) if draft else 0 for draft in drafts)
        inputs = []
        for row, draft in zip(rows, drafts, strict=True):
            row_inputs = [row.generated[-1] if row.generated else row.tokens[-1]]
            row_inputs += draft.tokens if draft else ()
            inputs.append(row_inputs + [0] * (width - len(row_inputs)))
        with mx.stream(DECODE_STREAM):
            logits = self._model.model(mx.array(inputs), cache=self._cache)
        kept: list[int] = []
        failed = set[_Request]()
        for index, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            drafted = draft.tokens if draft else ()
            try:
                tokens = self._verify_row(row, logits[index, : len(drafted) + 1], drafted)
            except Exception as error:
                outputs.append((row.task_id, GenerationFailed(error)))
                failed.add(row)
                kept.append(width)
                continue
            if draft is not None and row.drafter is not None:
                row.drafter.record(draft, len(tokens) - 1)
            fed = 0
            for token in tokens:
                if draft is not None and row.drafter is not None and fed < len(tokens) - 1:
                    row.drafter.stats.took(draft)  # before `feed`: its usage may end the reply
                row.generated.append(token.token)
                fed += 1
                try:
                    outputs.extend((row.task_id, output) for output in row.stream.feed(token))
                except Exception as error:
                    outputs.append((row.task_id, GenerationFailed(error)))
                    failed.add(row)
                    break
                if row.stream.finished:
                    break
            row.input = mx.array(row.generated[-1:], dtype=mx.int32)
            kept.append(fed)
        refused = [width - n for n in kept]
        fewest = min(refused)
        if fewest:
            for layer in self._cache:
                layer.trim(fewest)
        batch_layers = cast(list[BatchKVCache], self._cache)  # `can_speculate`'s
        extra = [n - fewest for n in refused]
        orders = realign(batch_layers, extra, [row.order for row in rows])
        for row, order in zip(rows, orders, strict=True):
            row.order = order
        self._leave({row for row in rows if row.stream.finished and row not in failed}, outputs)
        self._leave(failed)

    @staticmethod
    def _verify_row(row: _Request, logits: mx.array, drafted: Sequence[int]) -> list[SampledToken]:
        if drafted:
            return row.sampling.verify(logits, drafted)
        return [row.sampling.draw(logits[-1:]).resolve()]

    @staticmethod
    def _draw(rows: list[_Request], logits: mx.array) -> list[PendingToken | Exception]:
        """Each row's next token from its row of `logits`, or what its drawing raised."""
        if all(row.sampling.plain_greedy for row in rows):
            try:
                return list(greedy_rows(logits, [row.sampling for row in rows]))
            except Exception:
                pass  # a row's own (its `logit_bias`): drawn one by one below, it fails alone
        drawn: list[PendingToken | Exception] = []
        for i, row in enumerate(rows):
            try:
                drawn.append(row.sampling.draw(logits[i : i + 1]))
            except Exception as error:
                drawn.append(error)
        return drawn

    @staticmethod
    def _ends_with_pending(row: _Request) -> bool:
        return row.pending is not None and len(row.generated) + 1 >= row.params.max_tokens

    @staticmethod
    def _read_back(rows: list[_Request], outputs: Outputs) -> set[_Request]:
        """The rows' queued tokens, read back (one wait) and turned into text, to
        `outputs`; the rows whose text failed (their `GenerationFailed` is there)."""
        queued = [row for row in rows if row.pending is not None]
        sampled = PendingToken.resolve_all([row.pending for row in queued if row.pending])
        failed = set[_Request]()
        for row, token in zip(queued, sampled, strict=True):
            row.pending = None
            row.generated.append(token.token)
            try:
                outputs.extend((row.task_id, output) for output in row.stream.feed(token))
            except Exception as error:
                outputs.append((row.task_id, GenerationFailed(error)))
                failed.add(row)
        return failed

    def _leave(self, rows: set[_Request], outputs: Outputs | None = None) -> None:
        """Take `rows` out of the batch. With `outputs` (the step's), their replies
        ended there: their KV is stored in the prefix cache first, and a row whose
        store fails has its `Finished` replaced by `GenerationFailed`."""
        if not rows:
            return
        if outputs is not None and self._generator.prefix_cache is not None:
            for index, row in enumerate(self._rows):
                if row in rows:
                    try:
                        layers = [
                            extract(cast(BatchKVCache, layer), index, row.order)
                            if row.order is not None
                            else layer.extract(index)
                            for layer in self._cache
                        ]
                        self._generator.store_reply(row.tokens, row.generated, layers)
                    except Exception as error:
                        outputs[:] = [
                            (task_id, output)
                            for task_id, output in outputs
                            if not (task_id == row.task_id and isinstance(output, Finished))
                        ]
                        outputs.append((row.task_id, GenerationFailed(error)))
        keep = [i for i, row in enumerate(self._rows) if row not in rows]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = []
            return
        for layer in self._cache:
            layer.filter(keep)
