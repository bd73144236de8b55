"""Continuous batching: the requests a whole-model runner holds decode together.

Each `step()` is a bounded piece of work: prompt reading worth one prefill chunk
(a chunk of the oldest request still reading its prompt, or the short prompts
of several read together in one forward pass, right-padded as mlx-lm's
`BatchGenerator` reads them), then one decode step of every request in the
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

Decode computes one step ahead, as the one-at-a-time loop does: a step's forward
pass is queued on the tokens the previous step drew before those are read back,
so turning tokens into text overlaps the model. A row that ends at EOS or a stop
string has had one more step computed for it, which is dropped; that step puts
its last token's KV in the cache, so the stored reply keeps its end-of-turn
token. A small batch on a CPU node is the exception: its forward runs as it is
built (`cpu_few_rows`), so its tokens are read back in the step that drew them,
and a stored reply stops before its last token (the next turn reads that one
token along with its new ones: cheaper than a closing step spent on it).
"""

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from exo.engine.mlx.constrained import request_sampling
from exo.engine.mlx.generate import (
    DECODE_STREAM,
    GenerationOutput,
    LocalModel,
    TextGenerator,
    TextStream,
)
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache, needs_checkpoints
from exo.engine.mlx.sampling import PendingToken, SamplingStep, greedy_rows
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


def can_batch(layers: Sequence[LayerCache]) -> bool:
    """Whether every layer's cache has a batched form (mlx-lm's `merge`)."""
    return all(callable(getattr(layer, "merge", None)) for layer in layers)


@dataclass
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
    read: int = 0  # prompt tokens in its cache (restored or prefilled)
    generated: list[int] = field(default_factory=list[int])
    # In the batch: the token its next decode step feeds in, and the token drawn
    # by the last step (queued, not read back yet).
    input: mx.array | None = None
    pending: PendingToken | None = None


class ContinuousBatcher:
    """Serves many requests at once on a `LocalModel`; see the module docstring."""

    def __init__(self, generator: TextGenerator, max_batch: int = MAX_BATCH) -> None:
        if not isinstance(generator.forward, LocalModel):
            raise TypeError("continuous batching runs on a model this process holds whole")
        self._generator = generator
        self._model = generator.forward
        self.max_batch = max_batch
        self._reading: deque[_Request] = deque()
        self._chunks: dict[str, Iterator[int]] = {}  # prefill, by task id
        self._rows: list[_Request] = []
        self._cache: list[LayerCache] = []

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
    ) -> PromptProgress:
        """Take a request; it reads its prompt in later steps. Raises (and takes
        nothing) when the request is invalid, e.g. an uncompilable constraint."""
        generator = self._generator
        match, layers = generator.start(tokens, params)
        request = _Request(
            task_id=task_id,
            tokens=tokens,
            params=params,
            layers=layers,
            sampling=request_sampling(params, tokens, generator.tokenizer),
            stream=TextStream(generator.tokenizer, params, len(tokens), match.usable),
            checkpoints=generator.prefix_cache is not None and needs_checkpoints(layers),
            read=match.usable,
        )
        self._chunks[task_id] = generator.prefill_chunks(
            tokens[:-1],
            match.usable,
            layers,
            generator.checkpoint_at(system_prompt_length, layers),
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
        for index, row in enumerate(self._rows):
            if row.task_id == task_id:
                self._leave([index], store=False)
                return True
        return False

    def step(self) -> list[tuple[str, BatchOutput]]:
        """Prompt reading worth up to one prefill chunk (a chunk of the oldest
        request, or the short prompts of several), then one decode step: what they
        let out, by task id. A failure fails the requests it touched, never the
        batcher."""
        outputs: list[tuple[str, BatchOutput]] = []
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
                self._reading.popleft()
                self._chunks.pop(request.task_id, None)
                outputs.append((request.task_id, GenerationFailed(error)))
            budget -= max(1, request.read - before)
        if self._rows:
            try:
                outputs.extend(self._decode())
            except Exception as error:
                # The batch cache may hold a half-done step: every row fails.
                outputs.extend((row.task_id, GenerationFailed(error)) for row in self._rows)
                self._rows, self._cache = [], []
        return outputs

    def _short_prompts(self, budget: int) -> list[_Request]:
        """The oldest reading requests whose prompts' rest fits in `budget`
        together (and in the batch), to read in one forward pass; none when the
        oldest one's does not (it is read a chunk at a time)."""
        group: list[_Request] = []
        room, total = self.max_batch - len(self._rows), 0
        for request in self._reading:
            rest = len(request.tokens) - 1 - request.read
            if len(group) == room or request.checkpoints or total + rest > budget:
                break
            group.append(request)
            total += rest
        return group

    def _read_together(self, group: list[_Request]) -> list[tuple[str, BatchOutput]]:
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
        outputs: list[tuple[str, BatchOutput]] = []
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

    def _decode(self) -> list[tuple[str, BatchOutput]]:
        outputs: list[tuple[str, BatchOutput]] = []
        # A row whose queued token is its last by `max_tokens` ends before the
        # step: no forward pass is spent on it.
        last = [i for i, row in enumerate(self._rows) if self._ends_with_pending(row)]
        if last:
            outputs.extend(self._read_back([self._rows[i] for i in last]))
            self._leave(last, store=True)
        if not self._rows:
            return outputs
        rows = self._rows
        inputs = mx.concatenate([row.input for row in rows if row.input is not None])
        with mx.stream(DECODE_STREAM):
            logits = self._model.model(inputs[:, None], cache=self._cache)[:, -1, :]
            if all(row.sampling.plain_greedy for row in rows):
                drawn = greedy_rows(logits, [row.sampling for row in rows])
            else:
                drawn = [row.sampling.draw(logits[i : i + 1]) for i, row in enumerate(rows)]
        PendingToken.async_eval_all(drawn)
        # Rows that fed their last prompt token: their first token is read back
        # now. So are a small batch's on a CPU node: its forward ran as it was
        # built (`cpu_few_rows`), and waiting a step would only delay the tokens.
        eager = len(rows) <= self._model.eager_rows
        new = [eager or not row.generated for row in rows]
        outputs.extend(self._read_back(rows))
        for row, pending in zip(rows, drawn, strict=True):
            row.pending, row.input = pending, pending.token
        # A row the first read-back ended (a batch that just shrank to eager size)
        # leaves as in step-ahead mode: its last token fed, the extra one dropped.
        fresh = [row for row, n in zip(rows, new, strict=True) if n and not row.stream.finished]
        if fresh:
            outputs.extend(self._read_back(fresh))
        ended = [i for i, row in enumerate(rows) if row.stream.finished]
        if ended:
            self._leave(ended, store=True)
        return outputs

    @staticmethod
    def _ends_with_pending(row: _Request) -> bool:
        return row.pending is not None and len(row.generated) + 1 >= row.params.max_tokens

    @staticmethod
    def _read_back(rows: list[_Request]) -> list[tuple[str, BatchOutput]]:
        """The rows' queued tokens, read back (one wait) and turned into text."""
        queued = [row for row in rows if row.pending is not None]
        sampled = PendingToken.resolve_all([row.pending for row in queued if row.pending])
        outputs: list[tuple[str, BatchOutput]] = []
        for row, token in zip(queued, sampled, strict=True):
            row.pending = None
            row.generated.append(token.token)
            outputs.extend((row.task_id, output) for output in row.stream.feed(token))
        return outputs

    def _leave(self, indices: list[int], store: bool) -> None:
        """Take rows out of the batch, storing their KV in the prefix cache first."""
        if store and self._generator.prefix_cache is not None:
            for index in indices:
                row = self._rows[index]
                layers = [layer.extract(index) for layer in self._cache]
                self._generator.store_reply(row.tokens, row.generated, layers)
        gone = set(indices)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = []
            return
        for layer in self._cache:
            layer.filter(keep)
