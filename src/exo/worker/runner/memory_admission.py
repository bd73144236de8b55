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
`batch_kv`); `MemoryGate` is the runner's shell around them: a `RankVerdict`
of its own memory, turned into an answer for the serving loop.

On a split instance every rank holds its part of every request's KV (its
layers', or its heads'), next to its own weights and within its own machine's
limit, so every rank judges: rank 0's `RingMemoryGate` sends the task's figures
around the ring (`ADMIT`), each rank puts in its own verdict where it is worse
(`worse`), and rank 0 answers by the worst. Where the prefix cache must spill,
the ranks spill the same entries, as many as the tightest rank needs (`SPILL`:
each drop agreed as evictions are), since all ranks keep the same entries.
"""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import psutil
from loguru import logger
from mlx.utils import tree_flatten

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.generate import PREFILL_STEP_TOKENS
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.ring import Header, Link, Op, json_message
from exo.engine.mlx.ring_agreements import STEP_SECONDS
from exo.models.cards import ModelCardError, card_from_folder
from exo.models.memory import sequence_kv
from exo.shared.tensor_split import TensorSplit, card_split
from exo.shared.types.frozen import FrozenModel
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
    card: ModelCard,
    backend: MlxBackend,
    prefill_chunk: int = PREFILL_STEP_TOKENS,
    layers: tuple[int, int] | None = None,
    kv_share: Fraction = Fraction(1),
) -> Callable[[int], int]:
    """Predicted KV bytes of one sequence of n tokens on a runner holding the
    whole model (or `layers` of it, a pipeline rank; or a slice of every layer
    with `kv_share` of its KV heads, a tensor rank), as mlx-lm allocates it: in steps of
    `KV_ALLOCATION_STEP`, a sliding-window layer holding its window and a
    prefill chunk while it reads one."""
    start, end = layers if layers is not None else (0, None)
    caches = tuple(
        cache
        if cache.window is None
        else cache.model_copy(update={"window": cache.window + prefill_chunk})
        for cache in card.layer_caches
    )
    allocating = card.model_copy(update={"layer_caches": caches})

    def kv_of(tokens: int) -> int:
        allocated = -(-tokens // KV_ALLOCATION_STEP) * KV_ALLOCATION_STEP
        return sequence_kv(allocating, backend, allocated, start, end, kv_share)

    return kv_of


def _kv_share(card: ModelCard, tensor_rank: tuple[int, int] | None) -> Fraction:
    """The share of the KV heads a tensor rank (rank, ranks) holds; all, whole."""
    if tensor_rank is None:
        return Fraction(1)
    rank, ranks = tensor_rank
    split = card_split(card, ranks)
    # A split that loaded but that the card refuses: sizes the card misreads.
    return split.kv_share(rank) if isinstance(split, TensorSplit) else Fraction(1, ranks)


def sequence_length(task: Generate) -> int:
    """The most tokens a task's cache holds: its prompt and its whole reply."""
    return len(task.tokens) + task.params.max_tokens


def _mib(n: int) -> str:
    return f"{n} bytes ({n / _MIB:.1f} MiB)"


class RankVerdict(FrozenModel):
    """One rank's answer for a task, with the figures a refusal names."""

    decision: Literal["fits", "wait", "never"]
    needed: int  # KV bytes the task adds to the batch here
    limit: int
    weights: int
    reserve: int
    running: int  # the running requests' KV here
    spill: int = 0  # fits: bytes of the prefix cache's memory tier to move out first
    spill_entries: int = 0  # ... as that many least recently used entries
    alone: int = 0  # KV bytes of the task's whole sequence, alone
    largest_max_tokens: int = 0  # the largest max_tokens that fits here alone

    @property
    def capacity(self) -> int:
        return self.limit - self.weights - self.reserve


_SEVERITY = {"fits": 0, "wait": 1, "never": 2}
_DECISION_NAMES: dict[type, Literal["fits", "wait", "never"]] = {
    Fits: "fits",
    WaitForMemory: "wait",
    NeverFits: "never",
}


def worse(mine: RankVerdict, theirs: RankVerdict) -> RankVerdict:
    """Of two ranks' verdicts, the one that decides: the worse decision; of two
    refusals the one with less room; of two admissions the one spilling more
    entries (the ranks spill alike)."""
    if _SEVERITY[mine.decision] != _SEVERITY[theirs.decision]:
        return mine if _SEVERITY[mine.decision] > _SEVERITY[theirs.decision] else theirs
    if mine.decision == "fits":
        return mine if mine.spill_entries > theirs.spill_entries else theirs
    if mine.decision == "never":
        return mine if mine.largest_max_tokens < theirs.largest_max_tokens else theirs
    mine_free, theirs_free = mine.capacity - mine.running, theirs.capacity - theirs.running
    return mine if mine_free < theirs_free else theirs


@dataclass(frozen=True)
class Admitted:
    spill: int  # bytes of the prefix cache to move out before it starts
    spill_entries: int = 0  # ... as that many least recently used entries


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

    def verdict(
        self,
        prompt_tokens: int,
        max_tokens: int,
        running: Sequence[int],
        cached: int,
        entries_to_free: Callable[[int], int] = lambda nbytes: 0,
    ) -> RankVerdict:
        """This rank's verdict on a task of `prompt_tokens` + `max_tokens` beside
        running sequences of `running` tokens (their whole lengths) and a prefix
        cache of `cached` bytes in memory (`entries_to_free`: how many of its
        entries hold so many bytes)."""
        length = prompt_tokens + max_tokens
        room = MemoryRoom(
            self.limit, self.weights, self.reserve, batch_kv(running, self.kv_of), cached
        )
        needed = batch_kv([*running, length], self.kv_of) - room.running
        decision = memory_decision(needed, room)
        spill = decision.spill if isinstance(decision, Fits) else 0
        return RankVerdict(
            decision=_DECISION_NAMES[type(decision)],
            needed=needed,
            limit=self.limit,
            weights=self.weights,
            reserve=self.reserve,
            running=room.running,
            spill=spill,
            spill_entries=entries_to_free(spill) if spill > 0 else 0,
            alone=self.kv_of(length),
            largest_max_tokens=largest_max_tokens(
                prompt_tokens, max_tokens, room.capacity, self.kv_of
            ),
        )

    def decide(
        self,
        task: Generate,
        running: Sequence[Generate],
        cached: int,
        entries_to_free: Callable[[int], int] = lambda nbytes: 0,
    ) -> GateAnswer:
        lengths = [sequence_length(t) for t in running]
        verdict = self.verdict(
            len(task.tokens), task.params.max_tokens, lengths, cached, entries_to_free
        )
        return self.answer(task, verdict)

    def answer(self, task: Generate, verdict: RankVerdict) -> GateAnswer:
        """The serving loop's answer for `task` by `verdict` (its own, or the
        ranks' worst), waiting a bounded time."""
        match verdict.decision:
            case "fits":
                self._waiting = None
                return Admitted(verdict.spill, verdict.spill_entries)
            case "wait":
                now = self._clock()
                if self._waiting is None or self._waiting[0] != task.task_id:
                    self._waiting = (task.task_id, now)  # a new task first in line
                if now - self._waiting[1] < self.wait_seconds:
                    return Waiting()
                self._waiting = None
                return self._busy(task, verdict)
            case "never":
                self._waiting = None
                return self._never(task, verdict)

    def make_room(self, cache: KVPrefixCache, admitted: Admitted) -> int:
        """Spill what `admitted` asks of the prefix cache; the bytes freed."""
        return cache.spill(admitted.spill)

    def _busy(self, task: Generate, verdict: RankVerdict) -> Refused:
        room, needed = verdict, verdict.needed
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

    def _never(self, task: Generate, verdict: RankVerdict) -> Refused:
        prompt, max_tokens = len(task.tokens), task.params.max_tokens
        room, needed, largest = verdict, verdict.alone, verdict.largest_max_tokens
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


class AdmitQuery(FrozenModel):
    """An `ADMIT`'s payload: a task's figures and the worst verdict so far."""

    prompt_tokens: int
    max_tokens: int
    running: list[int]  # the running requests' whole lengths
    verdict: RankVerdict


class RingMemoryGate:
    """Rank 0's gate on a split instance: its own verdict and every other rank's
    (`ADMIT` around the ring), answered by the worst; spills on every rank alike
    (`SPILL`). The other ranks answer with `RankAdmission`."""

    def __init__(self, gate: MemoryGate, link: Link) -> None:
        self.gate = gate
        self._link = link

    def decide(
        self,
        task: Generate,
        running: Sequence[Generate],
        cached: int,
        entries_to_free: Callable[[int], int] = lambda nbytes: 0,
    ) -> GateAnswer:
        lengths = [sequence_length(t) for t in running]
        prompt, max_tokens = len(task.tokens), task.params.max_tokens
        mine = self.gate.verdict(prompt, max_tokens, lengths, cached, entries_to_free)
        query = AdmitQuery(
            prompt_tokens=prompt, max_tokens=max_tokens, running=lengths, verdict=mine
        )
        self._link.send(*json_message(Op.ADMIT, query))
        _, payload = self._link.expect(Op.ADMIT, STEP_SECONDS)
        if payload is None:
            raise ValueError("ADMIT came back without the ranks' verdict")
        worst = AdmitQuery.model_validate_json(np.array(payload).tobytes()).verdict
        return self.gate.answer(task, worst)

    def make_room(self, cache: KVPrefixCache, admitted: Admitted) -> int:
        self._link.send(Header(Op.SPILL, value=admitted.spill_entries))
        return cache.spill_entries(admitted.spill_entries)


class RankAdmission:
    """A follower rank's part of `RingMemoryGate`: its verdict, where worse, put
    into an `ADMIT` (`lockstep.LockstepFollower` hands it on)."""

    def __init__(self, gate: MemoryGate, cache: KVPrefixCache | None) -> None:
        self.gate = gate
        self._cache = cache

    def __call__(self, payload: bytes) -> bytes:
        query = AdmitQuery.model_validate_json(payload)
        cache = self._cache
        mine = self.gate.verdict(
            query.prompt_tokens,
            query.max_tokens,
            query.running,
            cache.nbytes if cache is not None else 0,
            cache.entries_to_free if cache is not None else lambda nbytes: 0,
        )
        worst = worse(mine, query.verdict)
        return query.model_copy(update={"verdict": worst}).model_dump_json().encode()


# What the serving loop asks: a whole model's gate, or rank 0's of a split instance.
Gate = MemoryGate | RingMemoryGate


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
    weights: int,
    model_dir: Path,
    settings: MemorySettings,
    layers: tuple[int, int] | None = None,
    tensor_rank: tuple[int, int] | None = None,
) -> MemoryGate | None:
    """The gate of a runner holding `weights` bytes (its part of the model in
    `model_dir`: the whole model, or `layers` of it on a pipeline rank, or the
    slice of tensor rank `tensor_rank` = (rank, ranks), and what it holds beside: a vision tower, a draft
    model); None, with a warning, when the model's folder gives no card to
    predict from."""
    try:
        card = card_from_folder(ModelId(model_dir.name), model_dir)
    except ModelCardError as error:
        logger.warning(f"memory admission is off: no model card to predict KV bytes ({error})")
        return None
    kv_of = request_kv(card, backend_name(), layers=layers, kv_share=_kv_share(card, tensor_rank))
    limit = settings.limit if settings.limit is not None else machine_memory_limit()
    gate = MemoryGate(
        kv_of,
        limit=limit,
        weights=weights,
        wait_seconds=settings.wait_seconds,
    )
    logger.info(
        f"memory admission: limit {_mib(limit)}, weights {_mib(gate.weights)}, reserve "
        f"{_mib(gate.reserve)}: {_mib(gate.limit - gate.weights - gate.reserve)} for KV "
        f"({kv_of(KV_ALLOCATION_STEP) // KV_ALLOCATION_STEP} bytes a token)"
    )
    return gate
