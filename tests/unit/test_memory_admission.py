"""Memory admission: the pure decisions (table-driven), the prediction against
the KV caches a real tiny model allocates, and the runner's serving loop with a
small memory limit (400, 503 after a bounded wait, the prefix cache spilling to
disk before anything is refused)."""

import itertools
import queue
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.api.generation import memory_refused
from exo.engine.mlx.batch import ContinuousBatcher
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.lockstep import LockstepFollower
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.prefix_cache_disk import DiskTier
from exo.engine.mlx.ring import Header, Message, Op
from exo.engine.mlx.ring_agreements import ring_prefix_cache
from exo.models.cards import card_from_folder
from exo.models.memory import sequence_kv
from exo.shared.types.ids import ModelId, TaskId
from exo.shared.types.model_card import LayerCache, ModelCard
from exo.shared.types.state import MlxBackend
from exo.shared.types.tasks import GenerationParams
from exo.worker.runner.inbox import Inbox, StopRequested
from exo.worker.runner.memory_admission import (
    Admitted,
    Fits,
    MemoryGate,
    MemoryRoom,
    NeverFits,
    RankAdmission,
    RankVerdict,
    Refused,
    RingMemoryGate,
    WaitForMemory,
    Waiting,
    batch_kv,
    largest_max_tokens,
    memory_decision,
    memory_settings,
    request_kv,
    worse,
)
from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    FromRunner,
    Generate,
    MemoryRefusal,
    PrefillProgress,
    Shutdown,
    TaskFailed,
    TaskFinished,
    ToRunner,
)
from exo.worker.runner.serving import Runner
from tests.in_process_ring import QueueLink
from tests.model_factory import make_tiny_model
from tests.unit.test_prefix_cache import store_fresh
from tests.unit.test_serving import ProtocolOut

Loaded = tuple[nn.Module, TokenizerWrapper]
EOS = 2  # the tiny models' end of sequence: kept out of long replies


def room(running: int = 0, cached: int = 0) -> MemoryRoom:
    # capacity 1000 bytes of KV: limit 1300 - weights 200 - reserve 100
    return MemoryRoom(limit=1300, weights=200, reserve=100, running=running, cached=cached)


@pytest.mark.parametrize(
    ("needed", "running", "cached", "decision"),
    [
        (400, 0, 0, Fits()),
        (1000, 0, 0, Fits()),  # exactly the capacity
        (400, 300, 300, Fits()),  # 400 free
        (500, 300, 300, Fits(spill=100)),  # the prefix cache makes room
        (700, 300, 300, Fits(spill=300)),  # all of it
        (800, 300, 300, WaitForMemory()),  # only once running requests finish
        (800, 300, 0, WaitForMemory()),
        (1001, 0, 0, NeverFits()),  # never, even alone
        (1001, 300, 300, NeverFits()),
    ],
)
def test_memory_decision(needed: int, running: int, cached: int, decision: object) -> None:
    assert memory_decision(needed, room(running, cached)) == decision


def per_token(tokens: int) -> int:
    return 10 * tokens


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "capacity", "largest"),
    [
        (20, 1000, 1000, 80),
        (20, 50, 1000, 50),  # what was asked fits
        (100, 1000, 1000, 0),  # the prompt alone fills it
        (200, 1000, 1000, 0),  # the prompt alone does not fit
    ],
)
def test_largest_max_tokens(prompt: int, max_tokens: int, capacity: int, largest: int) -> None:
    assert largest_max_tokens(prompt, max_tokens, capacity, per_token) == largest


def test_a_batch_pads_every_row_to_the_longest() -> None:
    assert batch_kv([], per_token) == 0
    assert batch_kv([30, 100, 50], per_token) == 3 * 1000


def card_of(caches: Sequence[LayerCache], model_dir: Path) -> ModelCard:
    card = card_from_folder(ModelId("tiny"), model_dir)
    return card.model_copy(update={"layer_caches": tuple(caches), "n_layers": len(caches)})


ATTENTION = LayerCache(kind="attention", token_elements=100)
SLIDING = LayerCache(kind="attention", token_elements=100, window=64)
RECURRENT = LayerCache(kind="recurrent", state_elements=50, float32_state_elements=30)


@pytest.mark.parametrize(
    ("caches", "tokens", "backend", "expected"),
    [
        ([ATTENTION], 10, "cpu", 10 * 100 * 4),
        ([ATTENTION], 10, "metal", 10 * 100 * 2),
        ([ATTENTION, SLIDING], 1000, "cpu", (1000 + 64) * 100 * 4),  # a window keeps 64
        ([SLIDING], 10, "cpu", 10 * 100 * 4),
        ([RECURRENT], 1000, "cpu", 50 * 4 + 30 * 4),  # a state, whatever the length
        ([RECURRENT], 1000, "metal", 50 * 2 + 30 * 4),  # recurrent state stays float32
    ],
)
def test_sequence_kv(
    tiny_model_dir: Path,
    caches: list[LayerCache],
    tokens: int,
    backend: MlxBackend,
    expected: int,
) -> None:
    assert sequence_kv(card_of(caches, tiny_model_dir), backend, tokens) == expected


def test_request_kv_allocates_in_steps_and_windows_hold_a_prefill_chunk(
    tiny_model_dir: Path,
) -> None:
    kv_of = request_kv(card_of([ATTENTION, SLIDING], tiny_model_dir), "cpu", prefill_chunk=32)
    assert kv_of(1) == (256 + 64 + 32) * 400
    assert kv_of(257) == (512 + 64 + 32) * 400


def test_memory_settings_come_from_the_environment() -> None:
    settings = memory_settings({"EXO_MEMORY_LIMIT_BYTES": "1000", "EXO_QUEUE_TIMEOUT_SECONDS": "2"})
    assert (settings.limit, settings.wait_seconds) == (1000, 2.0)
    assert memory_settings({}).limit is None
    with pytest.raises(ValueError, match="EXO_MEMORY_LIMIT_BYTES"):
        memory_settings({"EXO_MEMORY_LIMIT_BYTES": "-1"})


def generate(name: str, tokens: int, max_tokens: int, seed: int = 0) -> Generate:
    rng = random.Random(seed)
    return Generate(
        task_id=TaskId(name),
        tokens=[rng.randrange(10, 40_000) for _ in range(tokens)],
        params=GenerationParams(max_tokens=max_tokens, temperature=0, logit_bias={EOS: -100}),
    )


def test_the_gate_waits_a_bounded_time_then_refuses_with_the_figures() -> None:
    clock = itertools.count()  # a second per decision
    gate = MemoryGate(per_token, limit=1300, weights=200, reserve=100, wait_seconds=2,
                      clock=lambda: float(next(clock)))  # fmt: skip
    running = [generate("a", 20, 60)]  # 800 bytes
    task = generate("b", 10, 20)  # 300 bytes more
    assert gate.decide(task, running, cached=0) == Waiting()
    assert gate.decide(task, running, cached=0) == Waiting()
    refused = gate.decide(task, running, cached=0)
    assert isinstance(refused, Refused)
    assert refused.refusal == MemoryRefusal(
        needed_bytes=300 + 500, free_bytes=200, never_fits=False, retry_after_seconds=2
    )  # the batch's rows are padded to the longest: 800 more in all
    assert "needs 800 bytes" in refused.message and "200 bytes" in refused.message
    assert gate.decide(task, [], cached=0) == Admitted(spill=0)
    never = gate.decide(generate("c", 20, 1000), [], cached=500)
    assert isinstance(never, Refused) and never.refusal.never_fits
    assert never.refusal.largest_max_tokens == 80
    assert "the largest max_tokens that fits is 80" in never.message


def test_the_api_answers_a_refusal_as_400_or_503_with_retry_after() -> None:
    never = MemoryRefusal(needed_bytes=9, free_bytes=1, never_fits=True, largest_max_tokens=3)
    error = memory_refused("never fits", never)
    assert (error.status, error.param, error.headers) == (400, "max_tokens", {})
    busy = MemoryRefusal(needed_bytes=9, free_bytes=1, never_fits=False, retry_after_seconds=7)
    error = memory_refused("busy", busy)
    assert (error.status, error.headers) == (503, {"Retry-After": "7"})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Loaded:
    return load_for_inference(tiny_model_dir)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_the_prediction_holds_the_caches_a_real_model_allocates(
    family: str, tiny_model_dir: Path, smollm_dir: Path, tmp_path: Path
) -> None:
    """Attention (exact), sliding windows and recurrent states (bounded above)."""
    model_dir = (
        tiny_model_dir
        if family == "llama"
        else make_tiny_model(family, tmp_path / family, smollm_dir, n_layers=4)
    )
    model, tokenizer = load_for_inference(model_dir)
    local = LocalModel(model, tokenizer)
    kv_of = request_kv(card_from_folder(ModelId("tiny"), model_dir), "cpu", prefill_chunk=64)
    rows = []
    for length in (30, 300):
        caches = local.make_cache()
        tokens = mx.array([[10 + i % 500 for i in range(length)]])
        for start in range(0, length, 64):  # a prefill in chunks, as the runner reads
            model(tokens[:, start : start + 64], cache=caches)
            mx.eval([cache.state for cache in caches])
        measured = sum(cache.nbytes for cache in caches)
        assert measured <= kv_of(length) <= 2 * measured
        if family == "llama":
            assert kv_of(length) == measured
        rows.append(caches)
    merged = [type(layers[0]).merge(list(layers)) for layers in zip(*rows, strict=True)]
    mx.eval([layer.state for layer in merged])
    assert sum(layer.nbytes for layer in merged) <= batch_kv([30, 300], kv_of)


def serve(
    tiny: Loaded,
    gate: MemoryGate,
    tasks: Sequence[Generate],
    cache: KVPrefixCache | None = None,
    on_message: Callable[["queue.Queue[ToRunner | None]", FromRunner], None] = lambda n, m: None,
) -> list[FromRunner]:
    node: queue.Queue[ToRunner | None] = queue.Queue()
    for task in tasks:
        node.put(task)
    out = ProtocolOut(lambda message: on_message(node, message))
    runner = Runner(out, Inbox(node))
    runner.memory = gate
    model, tokenizer = tiny
    batch = ContinuousBatcher(TextGenerator(LocalModel(model, tokenizer), tokenizer, cache))

    def keep_alive() -> None:
        if out.ended >= len(tasks):
            node.put(Shutdown())

    with pytest.raises(StopRequested):
        runner.serve(batch, keep_alive)
    return out.messages


def ending(messages: list[FromRunner], name: str) -> FromRunner:
    return [m for m in messages if isinstance(m, TaskFinished | TaskFailed) and m.task_id == name][
        -1
    ]


def tiny_kv(tiny_model_dir: Path) -> Callable[[int], int]:
    return request_kv(card_from_folder(ModelId("tiny"), tiny_model_dir), "cpu")


def test_a_request_that_never_fits_gets_400_figures_and_the_runner_goes_on(
    tiny: Loaded, tiny_model_dir: Path
) -> None:
    kv_of = tiny_kv(tiny_model_dir)
    gate = MemoryGate(kv_of, limit=kv_of(512), weights=0, reserve=0, wait_seconds=60)
    messages = serve(tiny, gate, [generate("big", 20, 1000), generate("small", 20, 8)])
    big = ending(messages, "big")
    assert isinstance(big, TaskFailed) and big.memory is not None
    assert big.memory.never_fits and big.memory.largest_max_tokens == 512 - 20
    assert big.memory.needed_bytes == kv_of(1020) and big.memory.free_bytes == kv_of(512)
    assert "the largest max_tokens that fits is 492" in big.error
    assert isinstance(ending(messages, "small"), TaskFinished)


def test_a_request_that_fits_only_alone_waits_then_gets_503_and_the_runner_goes_on(
    tiny: Loaded, tiny_model_dir: Path
) -> None:
    kv_of = tiny_kv(tiny_model_dir)
    clock = itertools.count()  # a second per decision: no test waits in real time
    gate = MemoryGate(kv_of, limit=kv_of(512), weights=0, reserve=0, wait_seconds=2,
                      clock=lambda: float(next(clock)))  # fmt: skip

    def cancel_a_once_b_is_refused(node: "queue.Queue[ToRunner | None]", m: FromRunner) -> None:
        if isinstance(m, TaskFailed) and m.task_id == "b":
            node.put(Cancel(task_id=TaskId("a")))

    # "a" holds the whole memory while it runs; "b" and "c" would fit alone.
    tasks = [generate("a", 20, 480), generate("b", 20, 8, seed=1), generate("c", 20, 8, seed=2)]
    messages = serve(tiny, gate, tasks, on_message=cancel_a_once_b_is_refused)
    b = ending(messages, "b")
    assert isinstance(b, TaskFailed) and b.memory is not None
    assert not b.memory.never_fits
    assert (b.memory.needed_bytes, b.memory.free_bytes) == (kv_of(500), 0)
    assert b.memory.retry_after_seconds == 2
    assert "waited 2s for running requests" in b.error
    assert ending(messages, "a") == TaskFailed(task_id=TaskId("a"), error="cancelled")
    assert isinstance(ending(messages, "c"), TaskFinished)


def test_under_pressure_the_prefix_cache_spills_to_disk_before_anything_is_refused(
    tiny: Loaded, tiny_model_dir: Path, tmp_path: Path
) -> None:
    kv_of = tiny_kv(tiny_model_dir)
    gate = MemoryGate(kv_of, limit=kv_of(512), weights=0, reserve=0, wait_seconds=60)
    cache = KVPrefixCache(1 << 30, disk=DiskTier(tmp_path, "tiny", 1 << 30))
    # Two conversations fill the cache (about 2 x 208 tokens); "q" needs 220
    # tokens' worth (256 allocated) of the 512 that fit.
    tasks = [generate("p1", 200, 8, seed=1), generate("p2", 200, 8, seed=2)]
    tasks.append(generate("q", 20, 200, seed=3))
    messages = serve(tiny, gate, tasks, cache)
    assert all(isinstance(ending(messages, t.task_id), TaskFinished) for t in tasks)
    q_starts = next(
        i for i, m in enumerate(messages) if isinstance(m, PrefillProgress) and m.task_id == "q"
    )
    reports = [m.stats for m in messages[:q_starts] if isinstance(m, CacheStatsReport)]
    assert reports[-1].disk_entries >= 1 and reports[-1].evictions >= 1
    assert reports[-1].bytes <= kv_of(512) - kv_of(220)
    assert cache.stats().disk_entries >= 1


# ---- split instances: every rank judges, the worst decides ----


def _verdict(decision: str, **figures: int) -> RankVerdict:
    defaults = {"needed": 10, "limit": 1000, "weights": 100, "reserve": 100, "running": 0}
    return RankVerdict.model_validate({"decision": decision, **defaults, **figures})


@pytest.mark.parametrize(
    ("mine", "theirs", "decides"),
    [
        (_verdict("fits"), _verdict("wait"), "theirs"),
        (_verdict("never"), _verdict("wait"), "mine"),
        (_verdict("fits", spill=5, spill_entries=1), _verdict("fits", spill=9, spill_entries=3), "theirs"),
        (_verdict("never", largest_max_tokens=40), _verdict("never", largest_max_tokens=90), "mine"),
        (_verdict("wait", running=500), _verdict("wait", running=100), "mine"),
    ],
)  # fmt: skip
def test_of_two_ranks_verdicts_the_worse_decides(
    mine: RankVerdict, theirs: RankVerdict, decides: str
) -> None:
    expected = mine if decides == "mine" else theirs
    assert worse(mine, theirs) == expected
    assert worse(theirs, mine) == expected


def _ring_cache(link: QueueLink) -> KVPrefixCache:
    cache = ring_prefix_cache(link, 1 << 40, lambda: False, lockstep=True)
    assert cache is not None
    return cache


class _IdleBatch:
    """A follower's batch between requests: only its prefix cache is used here."""

    def __init__(self, cache: KVPrefixCache) -> None:
        self.prefix_cache = cache
        self.idle = True


def test_rank_zero_asks_every_rank_and_they_spill_alike() -> None:
    """Rank 0 has room to spare, the follower little: the follower's verdict
    decides (a refusal naming its figures; an admission that spills as many of
    the same entries on both ranks)."""
    inboxes: list[queue.Queue[Message]] = [queue.Queue(), queue.Queue()]
    links = [QueueLink(rank, inboxes) for rank in range(2)]
    caches = [_ring_cache(link) for link in links]

    def store_alike(sequences: list[tuple[int, ...]]) -> None:
        """Both ranks store the same entries, their eviction rounds paired."""
        follower = threading.Thread(target=lambda: [store_fresh(caches[1], s) for s in sequences])
        follower.start()
        for sequence in sequences:
            store_fresh(caches[0], sequence)
        follower.join(30)

    store_alike([tuple(range(start, start + 300)) for start in (0, 10_000, 20_000)])
    entry_bytes = caches[1].nbytes // 3
    kv_of = lambda tokens: tokens * 100  # noqa: E731
    roomy = MemoryGate(kv_of, limit=10**9, weights=0, reserve=0, wait_seconds=0)
    # The follower's room: a sequence of 3,000 tokens and one entry.
    tight = MemoryGate(kv_of, limit=300_000 + entry_bytes, weights=0, reserve=0, wait_seconds=0)
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            batch = cast(Any, _IdleBatch(caches[1]))
            LockstepFollower(cast(Any, links[1]), batch, RankAdmission(tight, caches[1])).serve()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        gate = RingMemoryGate(roomy, cast(Any, links[0]))
        never = gate.decide(generate("never", 1000, 100_000), [], caches[0].nbytes)
        assert isinstance(never, Refused) and never.refusal.never_fits
        assert never.refusal.largest_max_tokens == (300_000 + entry_bytes) // 100 - 1000
        # 3,000 tokens fit once two entries are out of the follower's memory.
        fits = gate.decide(
            generate("fits", 1000, 2000), [], caches[0].nbytes, caches[0].entries_to_free
        )
        assert isinstance(fits, Admitted) and fits.spill_entries == 2
        gate.make_room(caches[0], fits)
    finally:
        links[0].send(Header(Op.SHUTDOWN))
        thread.join(30)
    assert not errors
    assert caches[0].entry_ids() == caches[1].entry_ids()
    assert len(caches[0].entry_ids()) == 1
