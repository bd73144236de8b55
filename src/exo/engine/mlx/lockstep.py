"""A split instance's ranks in lockstep: every rank runs the same serving loop on
the same requests, rank 0 deciding.

A forward pass runs on all ranks at once: a tensor rank holds a slice of every
layer (`tensor.py`), the ranks' `all_sum`s pairing up; a pipeline rank holds
some layers and hands the hidden states on (`pipeline.py`). Rather than a
protocol of its own for prefill, batching, sampling, stops, constraints and the
prefix cache, each rank runs the whole-model serving machinery (`batch.py`'s
`ContinuousBatcher`, or `OneAtATime` where the caches do not batch) on its part
of the model, and rank 0 hands the others, around the ring (`ring.py`), each
call its serving loop makes:

- `ADD` (the task, with a seed filled in when the request has none, so every
  rank draws alike) and then `ADDED` (whether rank 0's batch took it: a request
  it refuses, e.g. an uncompilable constraint, is refused alike everywhere);
- `CANCEL` (a task id); `STEP` before every step;
- `DECIDE` for what only rank 0 can know mid-step: whether a request was
  cancelled (`OneAtATime` asks between prefill chunks and tokens);
- `ADMIT` and `SPILL` between steps, for memory admission: each rank puts its
  own verdict on a task into `ADMIT` (its `admission`) and hands it on, back to
  rank 0; `SPILL` moves as many prefix-cache entries out of memory on every rank.

Everything else follows: the same tokens in, the same tokens drawn (from rank
0's logits on tensor ranks, `tensor.RankZeroLogits`; by the last pipeline rank,
`pipeline.RingDraw`), so the same rows end, the same prefix-cache entries are
stored, and evictions are agreed around the ring (`ring_agreements.py`). The
disk tier is read only outside the ranks' lookups: rank 0 brings a longer
prefix from disk into every rank's memory (`LOAD`) before it sends `ADD`.

Messages share the ring with the forward passes, so nothing may be in flight
when one goes: a rank's decode reads each step's tokens back within the step
(`LocalModel.eager_rows` unbounded), never computing a step ahead.
"""

import secrets
from collections.abc import Callable, Sequence

import numpy as np
from loguru import logger
from pydantic import BaseModel

from exo.engine.mlx.batch import Batch, BatchOutput, GenerationFailed, PromptProgress
from exo.engine.mlx.generate import GenerationCancelled
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.ring import (
    Header,
    Link,
    Op,
    PipelineError,
    PipelineFailure,
    ids_of,
    json_message,
    raw_message,
)
from exo.engine.mlx.ring_agreements import (
    IDLE_SILENCE_SECONDS,
    STEP_SECONDS,
    RingDiskLoad,
    answer_load,
)
from exo.shared.prompt_images import PromptImage
from exo.shared.types.tasks import GenerationParams

# A rank's `LocalModel.eager_rows`: every decode step's tokens are read back
# within the step, so nothing is in flight when a message goes (see above).
LOCKSTEP_EAGER_ROWS = 1 << 30
# A seed filled in for a request that has none (every rank must draw alike).
_SEED_BITS = 63


class LockstepTask(BaseModel):
    """An `ADD`'s payload: a task as rank 0's batch took it. Its images without
    their files: only rank 0 reads them, the others need their places (and
    grids: `engine/image_positions.py`)."""

    task_id: str
    tokens: list[int]
    params: GenerationParams
    system_prompt_length: int
    images: list[PromptImage] = []


class RingStopped(PipelineFailure):
    """Rank 0 stopped the ring while a follower was within a step."""


class Decisions:
    """What only rank 0 knows mid-step, the same on every rank: rank 0 hands its
    answer around (`DECIDE`), the others wait for it."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def __call__(self, rank_zero_answer: Callable[[], bool]) -> bool:
        link = self.link
        if link.rank == 0:
            answer = rank_zero_answer()
            link.send(Header(Op.DECIDE, flag=int(answer)))
            return answer
        header, _ = link.recv(STEP_SECONDS)
        if header.op == Op.SHUTDOWN:
            link.send(header)  # onwards; from the last rank, the ack to rank 0
            raise RingStopped("rank 0 stopped the ring")
        if header.op != Op.DECIDE:
            raise PipelineError(f"expected DECIDE from rank {link.left}, got {header.op.name}")
        if not link.is_last:
            link.send(header)
        return bool(header.flag)


class LockstepBatch:
    """Rank 0's `Batch`: each call handed to the other ranks, then made on its own
    batch (see the module docstring)."""

    def __init__(self, inner: Batch, link: Link) -> None:
        if link.rank != 0:
            raise PipelineError("rank 0 leads the lockstep; the others follow")
        self._inner = inner
        self._link = link

    @property
    def max_batch(self) -> int:
        return self._inner.max_batch

    @property
    def idle(self) -> bool:
        return self._inner.idle

    @property
    def prefix_cache(self) -> KVPrefixCache | None:
        return self._inner.prefix_cache

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> PromptProgress | None:
        if params.seed is None:
            params = params.model_copy(update={"seed": secrets.randbits(_SEED_BITS)})
        cache = self._inner.prefix_cache
        if cache is not None:
            cache.bring_from_disk(tokens, RingDiskLoad(self._link))
        task = LockstepTask(
            task_id=task_id,
            tokens=list(tokens),
            params=params,
            system_prompt_length=system_prompt_length,
            images=[image.without_data() for image in images],
        )
        self._link.send(*json_message(Op.ADD, task))
        try:
            progress = self._inner.add(task_id, tokens, params, system_prompt_length, images)
        except Exception:
            self._link.send(Header(Op.ADDED, flag=0))
            raise
        self._link.send(Header(Op.ADDED, flag=1))
        return progress

    def cancel(self, task_id: str) -> bool:
        self._link.send(*json_message(Op.CANCEL, _Cancel(task_id=task_id)))
        return self._inner.cancel(task_id)

    def step(self) -> list[tuple[str, BatchOutput]]:
        self._link.send(Header(Op.STEP))
        return self._inner.step()


class _Cancel(BaseModel):
    task_id: str


class LockstepFollower:
    """Ranks 1..N-1: make rank 0's calls on this rank's own batch until rank 0
    stops the ring. `admission`: this rank's memory admission, which puts its
    verdict into an `ADMIT`'s payload (none: the payload goes on as it came)."""

    def __init__(
        self, link: Link, batch: Batch, admission: Callable[[bytes], bytes] | None = None
    ) -> None:
        if link.rank == 0:
            raise PipelineError("rank 0 leads the lockstep; the others follow")
        self.link = link
        self.batch = batch
        self.admission = admission

    def serve(
        self,
        interrupt: Callable[[], None] = lambda: None,
        on_task_start: Callable[[], None] = lambda: None,
        on_task_end: Callable[[], None] = lambda: None,
        on_persisted: Callable[[], None] = lambda: None,
    ) -> None:
        """Follow until `SHUTDOWN`; `interrupt` is called while waiting and may
        raise to stop. The callbacks say when this rank's batch starts serving,
        goes idle, and has written an entry to disk."""
        link, batch = self.link, self.batch
        while True:
            was_idle = batch.idle
            timeout = IDLE_SILENCE_SECONDS if was_idle else STEP_SECONDS
            header, payload = link.recv(timeout, interrupt)
            if header.op in (Op.ADD, Op.CANCEL, Op.STEP, Op.SPILL) and not link.is_last:
                link.send(header, payload)
            match header.op:
                case Op.HEARTBEAT | Op.SHUTDOWN:
                    link.send(header)  # onwards; from the last rank, the ack to rank 0
                    if header.op == Op.SHUTDOWN:
                        return
                case Op.PERSIST if batch.prefix_cache is not None:
                    for entry_id in ids_of(payload):
                        batch.prefix_cache.persist_entry(entry_id)
                    link.send(header, payload)  # onwards once written (acked)
                    on_persisted()
                case Op.LOAD if batch.prefix_cache is not None:
                    answer_load(link, header, payload, batch.prefix_cache)
                case Op.ADD if payload is not None:
                    self._add(LockstepTask.model_validate_json(np.array(payload).tobytes()))
                case Op.ADMIT if payload is not None:  # on, to rank 0 from the last
                    query = np.array(payload).tobytes()
                    answer = query if self.admission is None else self.admission(query)
                    link.send(*raw_message(Op.ADMIT, answer))
                case Op.SPILL:
                    if batch.prefix_cache is not None:
                        batch.prefix_cache.spill_entries(header.value)
                case Op.CANCEL if payload is not None:
                    batch.cancel(_Cancel.model_validate_json(np.array(payload).tobytes()).task_id)
                case Op.STEP:
                    try:
                        outputs = batch.step()  # rank 0's to send
                    except RingStopped:
                        return
                    for task_id, output in outputs:  # failures: as on rank 0, unless a bug
                        failed = isinstance(output, GenerationFailed)
                        if failed and not isinstance(output.error, GenerationCancelled):
                            logger.opt(exception=output.error).warning(f"task {task_id} failed")
                case _:
                    raise PipelineError(f"unexpected {header.op.name} from rank {link.left}")
            if was_idle and not batch.idle:
                on_task_start()
            elif not was_idle and batch.idle:
                on_task_end()

    def _add(self, task: LockstepTask) -> None:
        try:
            self.batch.add(
                task.task_id, task.tokens, task.params, task.system_prompt_length, task.images
            )
            taken = True
        except Exception:
            taken = False
        verdict, _ = self.link.expect(Op.ADDED, STEP_SECONDS)
        if not self.link.is_last:
            self.link.send(verdict)
        if bool(verdict.flag) != taken:
            raise PipelineError(
                f"rank 0 {'took' if verdict.flag else 'refused'} task {task.task_id}, "
                f"rank {self.link.rank} {'took' if taken else 'refused'} it"
            )
