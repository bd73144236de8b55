"""A runner that is one rank of a pipeline (the protocol: `engine/mlx/pipeline.py`).

The ranks start together: each joins the ring first, then loads its layers
(loading times differ: the handshake waits for the slowest), then agrees with
the others (the handshake, then which disk entries every rank holds). After the
handshake rank 0's heartbeats must start within the followers' idle bound, so
everything slow comes before it.

Then rank 0 drives: it serves the node's tasks one at a time through the ring,
with heartbeats and disk writes while idle. The other ranks follow it and fail
any task sent to them by mistake. Rank 0 stops when the node says so and stops
the others (`SHUTDOWN` around the ring); a follower stops at whichever comes
first. A clean stop writes what the prefix cache has not on disk yet (the next
start's agreement drops what another rank did not write).
"""

import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from loguru import logger
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.cpu_few_rows import configure_kernel_threads
from exo.engine.mlx.generate import TextGenerator
from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.pipeline import (
    PipelineDriver,
    PipelineFollower,
    agree_disk_entries,
    handshake,
    ring_prefix_cache,
)
from exo.engine.mlx.prefix_cache import KVPrefixCache, needs_checkpoints
from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
from exo.engine.mlx.ring import PeerLost, RingLink, join_ring
from exo.engine.mlx.shard import ShardModel, load_shard
from exo.engine.mlx.warm_up import warm_up_shard
from exo.shared.types.shard import LayerRange
from exo.worker.runner.cache_policy import may_persist, memory_pressure
from exo.worker.runner.inbox import StopRequested
from exo.worker.runner.protocol import StatusChanged
from exo.worker.runner.serving import Runner


@dataclass(frozen=True)
class _Rank:
    """A rank in its ring, its layers loaded, agreed with the other ranks."""

    link: RingLink
    shard: ShardModel
    cache: KVPrefixCache | None
    tokenizer: TokenizerWrapper | None  # rank 0 detokenizes, the last rank samples


def serve_rank(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange,
    disk: tuple[Path, int] | None,
) -> None:
    """Join the ring and load `layers`, then drive (rank 0) or follow until stopped."""
    try:
        rank = _join(runner, model_dir, prefix_cache_bytes, layers, disk)
    except StopRequested:  # stopped before the ring served: nothing to undo
        return
    runner.ready(rank.cache)
    if rank.link.rank == 0:
        _drive(runner, rank)
    else:
        _follow(runner, rank)


def _join(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange,
    disk: tuple[Path, int] | None,
) -> _Rank:
    started = time.monotonic()
    link = join_ring(interrupt=runner.inbox.drain)
    joined = time.monotonic()
    logger.info(
        f"joined the pipeline group as rank {link.rank} of {link.size} in {joined - started:.1f}s"
    )
    configure_kernel_threads(pipeline_rank=True)  # before loading, which starts the threads
    shard = load_shard(model_dir, layers)
    warm_up_shard(shard)  # first-use compiles before the handshake, not in the first request
    logger.info(
        f"loaded {layers} ({shard.weight_bytes / 1e6:.0f} MB, peak "
        f"{mx.get_peak_memory() / 1e6:.0f} MB) in {time.monotonic() - joined:.1f}s"
    )
    # This rank's share of each entry on disk, in a folder named by its layers.
    tier = (
        DiskTier(disk[0], cache_namespace(model_dir, layers), disk[1])
        if disk and prefix_cache_bytes > 0
        else None
    )
    cache = ring_prefix_cache(link, prefix_cache_bytes, memory_pressure, tier)
    needs_tokenizer = link.rank == 0 or link.is_last
    tokenizer = load_model_tokenizer(model_dir) if needs_tokenizer else None
    interrupt = runner.inbox.drain if link.rank == 0 else runner.refuse_tasks
    agreed = handshake(
        link,
        layers,
        cache is not None,
        interrupt=interrupt,
        disk_on=tier is not None,
        checkpoints=needs_checkpoints(shard.make_cache()),
    )
    if cache is not None:
        cache.ends_only = agreed.ends_only
    if cache is not None and agreed.disk:
        agree_disk_entries(link, cache, interrupt)
    elif cache is not None and tier is not None:
        logger.warning("prefix cache: another pipeline rank keeps no disk tier: none is used")
        cache.detach_disk()
    return _Rank(link, shard, cache, tokenizer)


def _drive(runner: Runner, rank: _Rank) -> None:
    """Rank 0: serve the node's tasks until it stops the instance, then stop the
    other ranks."""
    assert rank.tokenizer is not None
    cache = rank.cache
    driver = PipelineDriver(rank.link, rank.shard)

    def keep_alive() -> None:
        """Heartbeats; once requests pause, one entry to disk per idle poll, on
        every rank (rank 0 names it)."""
        driver.keep_alive()
        if cache is not None and may_persist(cache) and driver.persist_idle(cache):
            runner.report_cache(cache)

    generator = TextGenerator(driver, rank.tokenizer, cache)
    batch = OneAtATime(generator, runner.report_progress, runner.is_cancelled)
    try:
        runner.serve(batch, keep_alive)
    except StopRequested:  # the node stops the instance: rank 0 stops the ring
        with suppress(PeerLost):  # a rank stopped along with us may be gone already
            driver.shutdown()
        if cache is not None:
            cache.persist()


def _follow(runner: Runner, rank: _Rank) -> None:
    """Ranks > 0: run this rank's layers on what rank 0 sends until it stops the
    ring, or the node stops this rank first."""
    cache = rank.cache
    follower = PipelineFollower(rank.link, rank.shard, cache, rank.tokenizer)
    # The node's word may come before rank 0's `SHUTDOWN`: as clean a stop.
    with suppress(StopRequested):
        follower.serve(
            interrupt=runner.refuse_tasks,
            on_task_start=lambda: runner.send(StatusChanged(status="running")),
            on_task_end=lambda: runner.ready(cache),
            on_persisted=lambda: runner.report_cache(cache),
        )
    if cache is not None:
        cache.persist()
