"""Memory admission: a runner starts a request only when its KV cache fits.

Before a task joins the batch, the runner predicts the KV bytes it adds
(`request_kv`: its prompt plus `max_tokens`, from the model card's per-layer
cache kinds, rounded up to mlx-lm's allocation step; in a continuous batch
every row is padded to the longest, so a row costs the longest row's length)
and weighs them against the room left (`MemoryRoom`): the memory limit (total
RAM on the CPU, Metal's recommended working set, or `--memory-limit-bytes`)
less the weights, a reserve, the running requests' predicted KV and the prefix
cache's memory tier. `memory_decision` then says, in order of preference:

- `Fits(spill=0)`: start it;
- `Fits(spill=n)`: start it once the prefix cache has moved at least n bytes of
  its memory tier to its disk tier (or dropped them, without one);
- `WaitForMemory`: it would fit once running requests finish: it stays first in
  line (nobody overtakes it) and is decided again after each step, for at most
  the wait bound (the node's `--queue-timeout-seconds`), then refused with a
  `MemoryRefusal` the API answers as a 503 with Retry-After;
- `NeverFits`: even alone, with the prefix cache empty, it does not fit: refused
  at once as a 400 naming the largest `max_tokens` that fits
  (`largest_max_tokens`).

The decisions are pure (`memory_decision`, `largest_max_tokens`,
`batch_kv`); `MemoryGate` is the runner's shell around them. Only a runner that
holds the whole model applies it: on a split instance an eviction must be
agreed by every rank, which rank 0's serving loop cannot ask for between steps.
"""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import psutil
from loguru import logger
from mlx.utils import tree_flatten

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.generate import PREFILL_STEP_TOKENS
from exo.models.cards import ModelCardError, card_from_folder
from exo.models.memory import sequence_kv
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import MlxBackend
from exo.worker.runner.protocol import Generate, MemoryRefusal

# What the node hands its runners in their environment: `--memory-limit-bytes`
# (unset: the machine's) and `--queue-timeout-seconds`, the longest a task waits
# for running requests to free memory.
MEMORY_LIMIT_ENV = "EXO_MEMORY_LIMIT_BYTES"
MEMORY_WAIT_ENV = "EXO_QUEUE_TIMEOUT_SECONDS"
DEFAULT_WAIT_SECONDS = 120.0
# mlx-lm's KV caches grow in steps of this many tokens.
KV_ALLOCATION_STEP = 256
# Share of the memory limit kept free for what is not KV or weights: activations
# of a prefill chunk, sampling, the process itself.
RESERVE_FRACTION = 0.1
# Retry-After bounds of a 503 for memory.
RETRY_AFTER_MIN_SECONDS = 1
RETRY_AFTER_MAX_SECONDS = 60
_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryRoom:
    """What the runner's memory holds, in bytes."""

    limit: int
    weights: int
    reserve: int
    running: int  # the running requests' KV (predicted)
    cached: int  # the prefix cache's memory tier

    @property
    def capacity(self) -> int:
        """KV room with nothing running and the prefix cache empty."""
        return self.limit - self.weights - self.reserve

    @property
    def free(self) -> int:
        return self.capacity - self.running - self.cached


@dataclass(frozen=True)
class Fits:
    spill: int = 0  # bytes of the prefix cache's memory tier to move out first


@dataclass(frozen=True)
class WaitForMemory:
    pass


@dataclass(frozen=True)
class NeverFits:
    pass


MemoryDecision = Fits | WaitForMemory | NeverFits


def memory_decision(needed: int, room: MemoryRoom) -> MemoryDecision:
    """Whether a request that adds `needed` bytes of KV starts now (after the
    prefix cache spills, if need be), waits for running requests, or never fits."""
    if needed <= room.free:
        return Fits()
    if needed <= room.capacity - room.running:
        return Fits(spill=needed - room.free)
    if needed <= room.capacity:
        return WaitForMemory()
    return NeverFits()


def batch_kv(lengths: Sequence[int], kv_of: Callable[[int], int]) -> int:
    """KV bytes of a batch of sequences of `lengths` tokens: every row is padded
    to the longest."""
    return len(lengths) * kv_of(max(lengths)) if lengths else 0


def largest_max_tokens(
    prompt_tokens: int, max_tokens: int, capacity: int, kv_of: Callable[[int], int]
) -> int:
    """The largest `max_tokens` (at most the one asked for) whose sequence fits in
    `capacity` alone; 0 when not even the prompt and one token do."""
    low, high = 0, max_tokens  # kv_of grows with the tokens: bisect
    while low < high:
        middle = (low + high + 1) // 2
        if kv_of(prompt_tokens + middle) <= capacity:
            low = middle
        else:
            high = middle - 1
    return low


def request_kv(
    card: ModelCard, backend: MlxBackend, prefill_chunk: int = PREFILL_STEP_TOKENS
) -> Callable[[int], int]:
    """Predicted KV bytes of one sequence of n tokens on a runner holding the
    whole model, as mlx-lm allocates it: in steps of `KV_ALLOCATION_STEP`, a
    sliding-window layer holding its window and a prefill chunk while it reads one."""
    caches = tuple(
        cache
        if cache.window is None
        else cache.model_copy(update={"window": cache.window + prefill_chunk})
        for cache in card.layer_caches
    )
    allocating = card.model_copy(update={"layer_caches": caches})

    def kv_of(tokens: int) -> int:
        allocated = -(-tokens // KV_ALLOCATION_STEP) * KV_ALLOCATION_STEP
        return sequence_kv(allocating, backend, allocated)

    return kv_of


def sequence_length(task: Generate) -> int:
    """The most tokens a task's cache holds: its prompt and its whole reply."""
    return len(task.tokens) + task.params.max_tokens


def _mib(n: int) -> str:
    return f"{n} bytes ({n / _MIB:.1f} MiB)"


@dataclass(frozen=True)
class Admitted:
    spill: int  # bytes of the prefix cache to move out before it starts


@dataclass(frozen=True)
class Waiting:
    pass


@dataclass(frozen=True)
class Refused:
    refusal: MemoryRefusal
    message: str


GateAnswer = Admitted | Waiting | Refused


class MemoryGate:
    """The runner's memory admission (see the module docstring): decides the task
    first in line, given the tasks running and the prefix cache's bytes; keeps
    when each waiting task began to wait."""

    def __init__(
        self,
        kv_of: Callable[[int], int],
        limit: int,
        weights: int,
        wait_seconds: float,
        reserve: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv_of = kv_of
        self.limit = limit
        self.weights = weights
        self.reserve = int(limit * RESERVE_FRACTION) if reserve is None else reserve
        self.wait_seconds = wait_seconds
        self._clock = clock
        # The task first in line that waits for memory, and since when.
        self._waiting: tuple[str, float] | None = None

    def room(self, running: Sequence[Generate], cached: int) -> MemoryRoom:
        lengths = [sequence_length(task) for task in running]
        return MemoryRoom(
            self.limit, self.weights, self.reserve, batch_kv(lengths, self.kv_of), cached
        )

    def needed(self, task: Generate, running: Sequence[Generate]) -> int:
        """What `task` adds to the batch's predicted KV."""
        lengths = [sequence_length(t) for t in running]
        with_it = batch_kv([*lengths, sequence_length(task)], self.kv_of)
        return with_it - batch_kv(lengths, self.kv_of)

    def decide(self, task: Generate, running: Sequence[Generate], cached: int) -> GateAnswer:
        room = self.room(running, cached)
        needed = self.needed(task, running)
        match memory_decision(needed, room):
            case Fits(spill=spill):
                self._waiting = None
                return Admitted(spill)
            case WaitForMemory():
                now = self._clock()
                if self._waiting is None or self._waiting[0] != task.task_id:
                    self._waiting = (task.task_id, now)  # a new task first in line
                if now - self._waiting[1] < self.wait_seconds:
                    return Waiting()
                self._waiting = None
                return self._busy(task, needed, room)
            case NeverFits():
                self._waiting = None
                return self._never(task, room)

    def _busy(self, task: Generate, needed: int, room: MemoryRoom) -> Refused:
        free = room.capacity - room.running  # the prefix cache would have spilled
        retry = max(
            RETRY_AFTER_MIN_SECONDS, min(RETRY_AFTER_MAX_SECONDS, math.ceil(self.wait_seconds))
        )
        message = (
            f"not enough memory for this request now: its KV cache needs {_mib(needed)} for "
            f"{len(task.tokens)} prompt tokens + max_tokens {task.params.max_tokens}; "
            f"{_mib(max(free, 0))} are free (limit {room.limit} - weights {room.weights} - "
            f"reserve {room.reserve} - running requests {room.running} bytes); waited "
            f"{self.wait_seconds:g}s for running requests to finish; retry later"
        )
        refusal = MemoryRefusal(
            needed_bytes=needed,
            free_bytes=max(free, 0),
            never_fits=False,
            retry_after_seconds=retry,
        )
        return Refused(refusal, message)

    def _never(self, task: Generate, room: MemoryRoom) -> Refused:
        prompt, max_tokens = len(task.tokens), task.params.max_tokens
        needed = self.kv_of(prompt + max_tokens)
        largest = largest_max_tokens(prompt, max_tokens, room.capacity, self.kv_of)
        figures = (
            f"its KV cache needs {_mib(needed)} for {prompt} prompt tokens + max_tokens "
            f"{max_tokens}, and at most {_mib(max(room.capacity, 0))} are free for it with "
            f"nothing else running (limit {room.limit} - weights {room.weights} - reserve "
            f"{room.reserve} bytes)"
        )
        advice = (
            f"the largest max_tokens that fits is {largest}"
            if largest > 0
            else "not even the prompt fits: shorten it"
        )
        refusal = MemoryRefusal(
            needed_bytes=needed,
            free_bytes=max(room.capacity, 0),
            never_fits=True,
            largest_max_tokens=largest,
        )
        return Refused(refusal, f"this request can never fit in memory: {figures}; {advice}")


@dataclass(frozen=True)
class MemorySettings:
    limit: int | None = None  # bytes; None: the machine's (`machine_memory_limit`)
    wait_seconds: float = DEFAULT_WAIT_SECONDS


def memory_settings(environ: Mapping[str, str]) -> MemorySettings:
    """The settings the node passed in the runner's environment; a value that
    does not parse raises (the runner fails with the message)."""
    limit, wait = environ.get(MEMORY_LIMIT_ENV) or None, environ.get(MEMORY_WAIT_ENV) or None
    settings = MemorySettings(
        limit=int(limit) if limit is not None else None,
        wait_seconds=float(wait) if wait is not None else DEFAULT_WAIT_SECONDS,
    )
    if settings.limit is not None and settings.limit <= 0:
        raise ValueError(f"{MEMORY_LIMIT_ENV} must be a positive number of bytes, not {limit}")
    return settings


def machine_memory_limit() -> int:
    """Bytes MLX may use here: Metal's recommended working set, else the RAM."""
    if mx.metal.is_available():
        working_set = mx.device_info().get("max_recommended_working_set_size")
        if isinstance(working_set, int) and working_set > 0:
            return working_set
    return psutil.virtual_memory().total


def weights_nbytes(model: nn.Module) -> int:
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(array.nbytes for _, array in parameters)


def memory_gate(
    model: nn.Module, model_dir: Path, settings: MemorySettings, other_weights: int = 0
) -> MemoryGate | None:
    """The gate of a runner holding the whole `model` (loaded from `model_dir`)
    and `other_weights` bytes beside it (a vision tower, a draft model); None, with a warning,
    when the model's folder gives no card to predict from."""
    try:
        card = card_from_folder(ModelId(model_dir.name), model_dir)
    except ModelCardError as error:
        logger.warning(f"memory admission is off: no model card to predict KV bytes ({error})")
        return None
    kv_of = request_kv(card, backend_name())
    limit = settings.limit if settings.limit is not None else machine_memory_limit()
    gate = MemoryGate(
        kv_of,
        limit=limit,
        weights=weights_nbytes(model) + other_weights,
        wait_seconds=settings.wait_seconds,
    )
    logger.info(
        f"memory admission: limit {_mib(limit)}, weights {_mib(gate.weights)}, reserve "
        f"{_mib(gate.reserve)}: {_mib(gate.limit - gate.weights - gate.reserve)} for KV "
        f"({kv_of(KV_ALLOCATION_STEP) // KV_ALLOCATION_STEP} bytes a token)"
    )
    return gate
