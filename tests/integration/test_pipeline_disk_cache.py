"""The prefix cache's disk tier on pipeline ranks: real runner processes on a
loopback ring, restarted between two turns. Each rank keeps its own layers' share
of an entry; the ranks agree on which entries exist, on what is written and on
what a lookup brings back, so a damaged share on one rank is an agreed miss."""

import itertools
import signal
from pathlib import Path

import pytest

from exo.engine.mlx.prefix_cache_disk import cache_namespace
from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.shard import LayerRange
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.protocol import CacheStatsReport
from tests.model_factory import make_tiny_llama
from tests.pipeline_harness import (
    RunnerProcess,
    even_bounds,
    running_pipeline,
    start_runner,
    wait_until,
    write_hostfile,
)

TINY_LAYERS = 6
BOUNDS = even_bounds(TINY_LAYERS, 2)
GREEDY = GenerationParams(max_tokens=24, temperature=0.0)
FIRST = list(range(100, 800))
# The second turn shares 650 tokens with the first (its prompt and reply are cached).
SECOND = [*FIRST[:650], 11, 12, 13]

Turns = list[tuple[str, Usage]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny6") / "tiny-llama-6", smollm_dir, n_layers=TINY_LAYERS
    )


@pytest.fixture(scope="module")
def no_restart(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Turns:
    """Both turns on one 2-rank pipeline without a disk tier."""
    with running_pipeline(tiny_dir, tmp_path_factory.mktemp("reference"), BOUNDS) as pipeline:
        return [
            pipeline.entry.generate("first", FIRST, GREEDY),
            pipeline.entry.generate("second", SECOND, GREEDY),
        ]


def rank_folders(model_dir: Path, disk: Path) -> list[Path]:
    """Each rank's disk tier folder (named by its layers)."""
    return [
        disk / cache_namespace(model_dir, LayerRange(start=start, end=end, total=TINY_LAYERS))
        for start, end in itertools.pairwise(BOUNDS)
    ]


def files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("*.safetensors"))


def latest_stats(runner: RunnerProcess) -> CacheStats | None:
    reports = [m for m in runner.received if isinstance(m, CacheStatsReport)]
    return reports[-1].stats if reports else None


def stats_after(runner: RunnerProcess, lookups: int) -> CacheStats:
    """The first stats a rank reports once it has done `lookups` lookups."""
    wait_until(
        lambda: (s := latest_stats(runner)) is not None and s.lookups >= lookups,
        30,
        "the rank's stats",
    )
    stats = latest_stats(runner)
    assert stats is not None
    return stats


def first_turn(model_dir: Path, work: Path, disk: Path, stop: str) -> tuple[str, Usage]:
    """The first turn on a fresh pipeline, which then stops (or is killed once it
    has written its entries while idle)."""
    with running_pipeline(model_dir, work, BOUNDS, prefix_cache_dir=disk) as pipeline:
        turn = pipeline.entry.generate("first", FIRST, GREEDY)
        if stop == "killed once idle":
            for rank in pipeline.ranks:
                wait_until(
                    lambda r=rank: (s := latest_stats(r)) is not None and s.disk_entries == 1,
                    30,
                    "the entry to be written while idle",
                )
            for rank in pipeline.ranks:
                rank.process.send_signal(signal.SIGKILL)
                rank.process.wait(10)
    if stop == "shutdown":
        assert [r.process.returncode for r in pipeline.ranks] == [0, 0]
    return turn


@pytest.mark.parametrize("stop", ["shutdown", "killed once idle"])
def test_a_restarted_pipeline_hits_from_disk_as_if_it_never_stopped(
    tiny_dir: Path, tmp_path: Path, no_restart: Turns, stop: str
) -> None:
    disk = tmp_path / "prefix_cache"
    first = first_turn(tiny_dir, tmp_path, disk, stop)
    folders = rank_folders(tiny_dir, disk)
    # Each rank wrote its share of the same entry, under the same name.
    assert files(folders[0]) == files(folders[1]) and len(files(folders[0])) == 1

    with running_pipeline(tiny_dir, tmp_path, BOUNDS, prefix_cache_dir=disk) as pipeline:
        second = pipeline.entry.generate("second", SECOND, GREEDY)
        stats = [stats_after(rank, lookups=1) for rank in pipeline.ranks]
    assert [first, second] == no_restart
    assert second[1].cached_tokens == 650
    for rank_stats in stats:
        assert (rank_stats.disk_hits, rank_stats.memory_hits) == (1, 0)
        assert rank_stats.tokens_reused == 650


@pytest.mark.parametrize(
    "damage", ["truncated on rank 1", "garbage on rank 0", "missing on rank 1"]
)
def test_a_damaged_share_on_one_rank_is_an_agreed_miss(
    tiny_dir: Path, tmp_path: Path, no_restart: Turns, damage: str
) -> None:
    disk = tmp_path / "prefix_cache"
    first_turn(tiny_dir, tmp_path, disk, "shutdown")
    folders = rank_folders(tiny_dir, disk)
    (name,) = files(folders[0])
    rank = 1 if "rank 1" in damage else 0
    path = folders[rank] / name
    if damage.startswith("truncated"):  # a readable header: found only when loaded
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage.startswith("garbage"):  # removed when the rank starts
        path.write_bytes(b"\x07" * 64)
    else:
        path.unlink()

    with running_pipeline(tiny_dir, tmp_path, BOUNDS, prefix_cache_dir=disk) as pipeline:
        text, usage = pipeline.entry.generate("second", SECOND, GREEDY)
        stats = [stats_after(r, lookups=1) for r in pipeline.ranks]
        # Every rank's share is gone; the ring is in step (the next turn hits memory).
        assert [name in files(folder) for folder in folders] == [False, False]
        again = pipeline.entry.generate("again", SECOND, GREEDY)
    assert (text, usage.completion_tokens) == (no_restart[1][0], no_restart[1][1].completion_tokens)
    assert usage.cached_tokens == 0
    assert again[0] == text and again[1].cached_tokens == len(SECOND) - 1
    for rank_stats in stats:
        assert (rank_stats.disk_hits, rank_stats.misses) == (0, 1)
    assert [r.statuses[-1].status for r in pipeline.ranks] == ["stopped", "stopped"]


def test_entries_evicted_on_every_rank_come_back_from_disk(
    tiny_dir: Path, tmp_path: Path, no_restart: Turns
) -> None:
    # Each rank's budget (768 bytes a token) holds the first turn's entry (724
    # tokens), not an unrelated one (324) too: the first goes to disk on every rank.
    disk = tmp_path / "prefix_cache"
    with running_pipeline(
        tiny_dir, tmp_path, BOUNDS, prefix_cache_bytes=650_000, prefix_cache_dir=disk
    ) as pipeline:
        first = pipeline.entry.generate("first", FIRST, GREEDY)
        pipeline.entry.generate("unrelated", list(range(5000, 5300)), GREEDY)
        second = pipeline.entry.generate("second", SECOND, GREEDY)
        stats = [stats_after(rank, lookups=3) for rank in pipeline.ranks]
    assert [first, second] == no_restart
    for rank_stats in stats:
        assert rank_stats.evictions >= 1
        assert (rank_stats.disk_hits, rank_stats.memory_hits) == (1, 0)


def test_a_pipeline_uses_no_disk_tier_unless_every_rank_keeps_one(
    tiny_dir: Path, tmp_path: Path, no_restart: Turns
) -> None:
    disk = tmp_path / "prefix_cache"
    hostfile = write_hostfile(tmp_path, 2)
    ranks = [
        start_runner(
            tiny_dir,
            tmp_path,
            1 << 30,
            hostfile,
            rank,
            LayerRange(start=start, end=end, total=TINY_LAYERS),
            disk if rank == 0 else None,
            1 << 30,
        )
        for rank, (start, end) in enumerate(itertools.pairwise(BOUNDS))
    ]
    try:
        for rank in ranks:
            rank.wait_status("ready", 120)
        assert ranks[0].generate("first", FIRST, GREEDY) == no_restart[0]
        stats = stats_after(ranks[0], lookups=1)
    finally:
        for rank in ranks:
            rank.stop()
    assert [r.process.returncode for r in ranks] == [0, 0]
    assert (stats.disk_byte_budget, stats.disk_entries) == (0, 0)
    assert files(rank_folders(tiny_dir, disk)[0]) == []  # nothing written, even at the stop
