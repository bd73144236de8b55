"""The runner's one serving loop: tasks from the inbox into a batch, its outputs
out as `FromRunner` messages.

The batch is `engine/mlx/batch.py`'s `ContinuousBatcher` (a whole model whose
requests decode together) or `OneAtATime` (pipeline rank 0, or a whole model
whose caches cannot batch): a lone request is a batch of one. Between steps the
loop reads its inbox (new tasks, cancellations, a stop); while idle it waits on
it and runs the role's `keep_alive` (heartbeats, disk writes).

How a task ends: its `Finished`, or a `TaskFailed` — "cancelled", "invalid
constraint: …" (the request's fault, no traceback), or the exception's name and
message (the runner goes on), or, before it starts, a refusal of memory
admission (`memory_admission.py`: `TaskFailed.memory` holds the figures). A
lost pipeline (`PipelineFailure`) fails every task, waiting ones too, as
`runner_lost`, and ends the loop by raising. A stop ends it by
`StopRequested`, which each role handles where it stops cleanly.
"""

from collections.abc import Callable
from typing import IO, NoReturn

from loguru import logger

from exo.engine.constraint_grammar import ConstraintError
from exo.engine.mlx.batch import Batch, BatchOutput, GenerationFailed, PromptProgress
from exo.engine.mlx.generate import Finished, GenerationCancelled, TextDelta
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.ring import PipelineFailure
from exo.shared.types.ids import TaskId
from exo.shared.types.tasks import SampledLogprobs
from exo.worker.runner.inbox import Inbox
from exo.worker.runner.memory_admission import Admitted, Gate, Refused, Waiting
from exo.worker.runner.protocol import (
    CacheStatsReport,
    FromRunner,
    Generate,
    PrefillProgress,
    StatusChanged,
    TaskFailed,
    TaskFinished,
    TaskText,
)

# How long an idle runner waits on its inbox before its `keep_alive` runs again.
IDLE_POLL_SECONDS = 1.0


class Runner:
    """A runner's messages out (to `out`) and its tasks in (from `inbox`)."""

    def __init__(self, out: IO[str], inbox: Inbox, speculation: bool = True) -> None:
        """`speculation` off: every task is generated without drafts, whatever its
        params say (on a split instance rank 0's runner decides, here)."""
        self._out = out
        self.inbox = inbox
        self.speculation = speculation
        # Memory admission, once the model is loaded (None: every task starts).
        self.memory: Gate | None = None

    def send(self, message: FromRunner, flush: bool = True) -> None:
        """Write `message`; `flush=False` leaves it buffered for a later send or
        `flush` (a batch step's messages go out in one write)."""
        self._out.write(message.model_dump_json() + "\n")
        if flush:
            self._out.flush()

    def flush(self) -> None:
        self._out.flush()

    def ready(self, cache: KVPrefixCache | None) -> None:
        self.send(StatusChanged(status="ready"))
        self.report_cache(cache)

    def report_cache(self, cache: KVPrefixCache | None) -> None:
        """The cache's stats and summary; the summary counts the prompts being
        served as cached: a session's next turn, sent the moment this one's
        reply ends, may reach a node before the report at its end does."""
        if cache is not None:
            coming = (tuple(task.tokens) for task in self.inbox.taken.values())
            summary = tuple(cache.summary(coming))
            self.send(CacheStatsReport(stats=cache.stats(), summary=summary))

    def report_progress(self, task_id: str, done: int, total: int) -> None:
        """`OneAtATime`'s `on_progress`: progress goes out as the prompt is read."""
        self.send(PrefillProgress(task_id=TaskId(task_id), done=done, total=total))

    def is_cancelled(self, task_id: str) -> bool:
        """`OneAtATime`'s `is_cancelled`: during a long prefill, the moment the
        inbox is read (a stop raises `StopRequested` through the generation)."""
        self.inbox.drain()
        return self.inbox.is_cancelled(task_id)

    def refuse_tasks(self) -> None:
        """Read the inbox where tasks are not served (pipeline ranks > 0): a task
        sent by mistake fails at once."""
        self.inbox.drain()
        for task in self.inbox.drop_pending():
            error = "only rank 0 of a pipeline takes tasks"
            self.send(TaskFailed(task_id=task.task_id, error=error))

    def serve(self, batch: Batch, keep_alive: Callable[[], None]) -> NoReturn:
        """Serve tasks until the node asks to stop (`StopRequested`); `keep_alive`
        runs while idle. See the module docstring."""
        tasks = self.inbox.taken
        try:
            while True:
                if batch.idle and not self.inbox.has_pending:
                    keep_alive()
                    self.inbox.wait(IDLE_POLL_SECONDS)
                    continue
                self.inbox.drain()
                for task in [t for t in tasks.values() if self.inbox.is_cancelled(t.task_id)]:
                    batch.cancel(task.task_id)
                    self._end(batch, task, "cancelled")
                while len(tasks) < batch.max_batch:
                    if (task := self._next_task(batch)) is None:
                        break
                    self._start(batch, task)
                for task_id, output in batch.step():
                    self._send_step_output(batch, tasks[task_id], output)
                self.flush()
        except PipelineFailure as error:  # the group is gone: so is every task
            for task in [*tasks.values(), *self.inbox.drop_pending()]:
                self.send(TaskFailed(task_id=task.task_id, error=str(error), runner_lost=True))
            raise

    def _next_task(self, batch: Batch) -> Generate | None:
        """The next task to start, taken from the inbox. With memory admission
        (`memory_admission.py`) a task whose KV does not fit is refused here, or
        left first in line (None) while running requests may free its room; the
        prefix cache spills to disk first when that makes room."""
        while (task := self.inbox.peek()) is not None:
            if self.memory is None:
                return self.inbox.take()
            cache = batch.prefix_cache
            running = list(self.inbox.taken.values())
            cached, to_free = (cache.nbytes, cache.entries_to_free) if cache else (0, lambda n: 0)
            match self.memory.decide(task, running, cached, to_free):
                case Waiting():
                    return None
                case Refused(refusal=refusal, message=message):
                    self.inbox.take()
                    self.inbox.end(task.task_id)
                    logger.info(f"task {task.task_id} refused: {message}")
                    self.send(TaskFailed(task_id=task.task_id, error=message, memory=refusal))
                case Admitted(spill=spill) as admitted:
                    if spill > 0 and cache is not None:
                        self.memory.make_room(cache, admitted)
                        self.report_cache(cache)
                    return self.inbox.take()
        return None

    def _start(self, batch: Batch, task: Generate) -> None:
        if len(self.inbox.taken) == 1:  # the first since the runner was idle
            self.send(StatusChanged(status="running"))
        params = task.params
        if not self.speculation:
            params = params.model_copy(update={"speculation": False})
        try:
            progress = batch.add(
                task.task_id, task.tokens, params, task.system_prompt_length, task.images
            )
        except Exception as error:  # a bad request must not stop the runner
            self._end(batch, task, _failure_message(task, error))
            return
        if progress is not None:
            self.report_progress(task.task_id, progress.done, progress.total)
        self.report_cache(batch.prefix_cache)  # its prompt, to route its next turn here

    def _send_step_output(self, batch: Batch, task: Generate, output: BatchOutput) -> None:
        """One output of a batch step, left buffered (the step's are flushed at once)."""
        match output:
            case PromptProgress(done=done, total=total):
                progress = PrefillProgress(task_id=task.task_id, done=done, total=total)
                self.send(progress, flush=False)
            case GenerationFailed(error=error):
                self._end(batch, task, _failure_message(task, error))
            case Finished():
                # What the cache holds now first: the next turn may go to any node.
                self.report_cache(batch.prefix_cache)
                self.send(_finished_message(task, output), flush=False)
                self._end(batch, task)
            case TextDelta():
                self.send(_text_message(task, output), flush=False)

    def _end(self, batch: Batch, task: Generate, error: str | None = None) -> None:
        """A task is over: failed with `error`, or finished (its messages are out)."""
        self.inbox.end(task.task_id)
        if error is not None:
            self.send(TaskFailed(task_id=task.task_id, error=error))
        if not self.inbox.taken:
            self.send(StatusChanged(status="ready"))
        self.report_cache(batch.prefix_cache)


def _failure_message(task: Generate, error: BaseException) -> str:
    match error:
        case GenerationCancelled():
            return "cancelled"
        case ConstraintError():  # the request's fault: no traceback
            return f"invalid constraint: {error}"
        case _:
            logger.opt(exception=error).error(f"task {task.task_id} failed")
            return f"{type(error).__name__}: {error}"


def _text_message(task: Generate, output: TextDelta) -> TaskText:
    logprobs = SampledLogprobs(tokens=output.logprobs) if task.params.logprobs else None
    return TaskText(task_id=task.task_id, text=output.text, logprobs=logprobs)


def _finished_message(task: Generate, output: Finished) -> TaskFinished:
    return TaskFinished(
        task_id=task.task_id,
        finish_reason=output.finish_reason,
        usage=output.usage,
        stop_sequence=output.stop_sequence,
    )
