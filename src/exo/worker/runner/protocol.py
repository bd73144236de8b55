"""Messages between the node (supervisor) and a runner process: JSON lines.

The supervisor writes `ToRunner` messages to the runner's stdin; the runner
writes `FromRunner` messages to its protocol pipe (the process's stdout; its
own prints and logs go to stderr).

A reply crosses three layers, each with its own type: the engine's `TextDelta`s
and `Finished` become `TaskText`s and a `TaskFinished` here (with the task id),
which the API's generation service turns into `ReplyEvent`s ending in
`ReplyFinished` (with the parsed tool calls).
"""

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo.shared.prompt_images import PromptImage
from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import TaskId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.tasks import FinishReason, GenerationParams, SampledLogprobs, Usage


class Generate(FrozenModel):
    kind: Literal["generate"] = "generate"
    task_id: TaskId
    tokens: list[int]
    params: GenerationParams
    system_prompt_length: int = 0
    # Images, whose placeholders `tokens` holds as image keys (`shared/prompt_images.py`).
    images: list[PromptImage] = Field(default_factory=list[PromptImage])


class Cancel(FrozenModel):
    kind: Literal["cancel"] = "cancel"
    task_id: TaskId


class Shutdown(FrozenModel):
    kind: Literal["shutdown"] = "shutdown"


class StatusChanged(FrozenModel):
    kind: Literal["status"] = "status"
    status: RunnerStatus
    error: str | None = None


class PrefillProgress(FrozenModel):
    kind: Literal["prefill_progress"] = "prefill_progress"
    task_id: TaskId
    done: int
    total: int


class TaskText(FrozenModel):
    kind: Literal["text"] = "text"
    task_id: TaskId
    text: str
    # With `params.logprobs`: the sampled tokens behind this text, each once.
    logprobs: SampledLogprobs | None = None


class TaskFinished(FrozenModel):
    kind: Literal["finished"] = "finished"
    task_id: TaskId
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # which of `params.stop` ended the reply


class MemoryRefusal(FrozenModel):
    """Why memory admission refused a task (`memory_admission.py`), in figures."""

    needed_bytes: int  # the KV bytes the task would add
    free_bytes: int  # what is free for it (never_fits: with nothing else running)
    # True: it does not fit even alone (a 400 naming `largest_max_tokens`, 0 when
    # not even its prompt fits); False: not now (a 503 with Retry-After).
    never_fits: bool
    largest_max_tokens: int | None = None
    retry_after_seconds: int = 1


class TaskFailed(FrozenModel):
    kind: Literal["task_failed"] = "task_failed"
    task_id: TaskId
    error: str
    # The runner (or a rank of its pipeline) is gone, not the request at fault:
    # the client is told why, as a 503 it may retry.
    runner_lost: bool = False
    # Refused before it started: its KV cache would not fit in memory.
    memory: MemoryRefusal | None = None


class CacheStatsReport(FrozenModel):
    kind: Literal["cache_stats"] = "cache_stats"
    stats: CacheStats
    # What the cache holds, as `prefix_digests` (most recently used first).
    summary: tuple[int, ...] = ()


ToRunner = Annotated[Generate | Cancel | Shutdown, Field(discriminator="kind")]
FromRunner = Annotated[
    StatusChanged | PrefillProgress | TaskText | TaskFinished | TaskFailed | CacheStatsReport,
    Field(discriminator="kind"),
]
TaskMessage = PrefillProgress | TaskText | TaskFinished | TaskFailed

to_runner_adapter: TypeAdapter[ToRunner] = TypeAdapter(ToRunner)
from_runner_adapter: TypeAdapter[FromRunner] = TypeAdapter(FromRunner)
