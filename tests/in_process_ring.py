"""A pipeline's ranks as threads of the test process: the real protocol
(`engine/mlx/ring_agreements.py`, `lockstep.py`, `pipeline.py`: handshake,
requests, forward passes, draws, prefix-cache agreement) over a link of queues
instead of `mx.distributed`, so architectures are covered without a process per
rank. The ring itself is tested with real processes elsewhere
(tests/integration/test_pipeline.py)."""

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.batch import (
    Batch,
    ContinuousBatcher,
    GenerationFailed,
    can_batch,
)
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.lockstep import (
    LOCKSTEP_EAGER_ROWS,
    Decisions,
    LockstepBatch,
    LockstepFollower,
)
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.pipeline import PipelineStage, RingDraw
from exo.engine.mlx.prefix_cache import KVPrefixCache, needs_checkpoints
from exo.engine.mlx.ring import Header, Link, Message, Op, PeerLost, expected
from exo.engine.mlx.ring_agreements import RingLead, handshake, ring_prefix_cache
from exo.engine.mlx.shard import ShardModel, load_shard
from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.shard import LayerRange
from exo.shared.types.tasks import GenerationParams, Usage

_WAIT_SLICE_SECONDS = 0.05
_RANK_SECONDS = 300.0


class QueueLink:
    """`RingLink`'s interface between threads: what a rank sends goes to its right
    neighbour's queue."""

    def __init__(self, rank: int, inboxes: list["queue.Queue[Message]"]) -> None:
        self.rank = rank
        self.size = len(inboxes)
        self.left = (rank - 1) % self.size
        self.right = (rank + 1) % self.size
        self._inboxes = inboxes
        self.broken = False
        self.last_activity = time.monotonic()

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, header: Header, payload: mx.array | None = None) -> None:
        if payload is not None:
            mx.eval(payload)
        self._inboxes[self.right].put((header, payload))
        self.last_activity = time.monotonic()

    def recv(self, timeout: float, interrupt: Callable[[], None] = lambda: None) -> Message:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._inboxes[self.rank].get(timeout=_WAIT_SLICE_SECONDS)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.broken = True
                    raise PeerLost(f"rank {self.left} sent nothing for {timeout:.0f}s") from None
                interrupt()
                continue
            self.last_activity = time.monotonic()
            return message

    def expect(
        self, op: Op, timeout: float, interrupt: Callable[[], None] = lambda: None
    ) -> Message:
        return expected(op, self.recv(timeout, interrupt), self.left)


@dataclass
class PipelineRun:
    replies: list[tuple[str, Usage]]  # rank 0's, in request order
    stats: list[CacheStats]  # every rank's prefix cache, after the last request


def run_pipeline(
    model_dir: Path,
    bounds: Sequence[int],
    requests: Sequence[tuple[Sequence[int], GenerationParams]],
    cache_bytes: int = 1 << 30,
    together: bool = False,
) -> PipelineRun:
    """Serve `requests` on ranks holding [bounds[r], bounds[r+1]): one after
    another, or with `together` all at once (decoding together where the model's
    caches batch)."""
    total = bounds[-1]
    ranges = [LayerRange(start=a, end=b, total=total) for a, b in itertools.pairwise(bounds)]
    shards = [load_shard(model_dir, layers) for layers in ranges]
    tokenizer = load_model_tokenizer(model_dir)
    inboxes: list[queue.Queue[Message]] = [queue.Queue() for _ in ranges]
    links = [QueueLink(rank, inboxes) for rank in range(len(ranges))]
    caches: list[KVPrefixCache | None] = [
        ring_prefix_cache(link, cache_bytes, lambda: False, lockstep=True) for link in links
    ]
    replies: list[tuple[str, Usage]] = []
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        link, shard, cache = links[rank], shards[rank], caches[rank]
        try:
            agreed = handshake(
                link,
                ranges[rank],
                cache is not None,
                timeout=_RANK_SECONDS,
                checkpoints=needs_checkpoints(shard.make_cache()),
            )
            if cache is not None:
                cache.ends_only = agreed.ends_only
            batch = pipeline_rank_batch(link, shard, tokenizer, cache)
            if rank > 0:
                LockstepFollower(link, batch).serve()
                return
            lead = LockstepBatch(batch, link)
            waves = [list(enumerate(requests))] if together else [[r] for r in enumerate(requests)]
            for wave in waves:
                replies.extend(serve_wave(lead, wave))
            RingLead(link).shutdown()
        except BaseException as error:
            errors.append(error)
            for inbox in inboxes:  # wake the others: they fail on the unexpected message
                inbox.put((Header(Op.SHUTDOWN), None))

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(ranges))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_RANK_SECONDS)
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError("a pipeline rank did not finish")
    return PipelineRun(
        replies=replies, stats=[cache.stats() for cache in caches if cache is not None]
    )


def pipeline_rank_batch(
    link: Link, shard: ShardModel, tokenizer: TokenizerWrapper, cache: KVPrefixCache | None
) -> Batch:
    """A pipeline rank's batch, as `worker/runner/split_rank.py` makes it (no
    cancellations: nothing here cancels)."""
    local = LocalModel(PipelineStage(shard, link), tokenizer, lambda step: RingDraw(step, link))
    local.eager_rows = LOCKSTEP_EAGER_ROWS
    generator = TextGenerator(local, tokenizer, cache)
    decide = Decisions(link)
    caches = shard.whole_model_caches()
    if can_batch(caches):
        return ContinuousBatcher.for_caches(generator, caches)
    return OneAtATime(generator, is_cancelled=lambda task_id: decide(lambda: False))


def serve_wave(
    lead: LockstepBatch, wave: list[tuple[int, tuple[Sequence[int], GenerationParams]]]
) -> list[tuple[str, Usage]]:
    """Requests added at once and stepped until all end, as the runner's loop
    serves them (admitting what the batch has room for); replies in wave order."""
    texts: dict[str, str] = {}
    usages: dict[str, Usage] = {}
    waiting = [(f"request-{n}", request) for n, request in wave]
    for _ in range(10_000):
        if not waiting and len(usages) == len(wave):
            break
        while waiting and len(texts) - len(usages) < lead.max_batch:
            task_id, (tokens, params) = waiting.pop(0)
            texts[task_id] = ""
            lead.add(task_id, tokens, params)
        for task_id, output in lead.step():
            if isinstance(output, TextDelta):
                texts[task_id] += output.text
            elif isinstance(output, Finished):
                usages[task_id] = output.usage
            elif isinstance(output, GenerationFailed):
                raise output.error
    return [(texts[f"request-{n}"], usages[f"request-{n}"]) for n, _ in wave]
