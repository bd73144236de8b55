"""A runner that is one tensor rank: a slice of every layer (`engine/mlx/tensor.py`),
serving in lockstep with the other ranks (`engine/mlx/lockstep.py`).

The ranks start as a pipeline's do (`pipeline_rank.py`): join the ring, load,
warm up (together: the warm-up's forward passes pair their `all_sum`s), agree
in the handshake and on the disk entries all of them hold. Then every rank runs
the whole-model serving machinery on its slice: rank 0 takes the node's tasks
and leads, the others follow it. Each rank's prefix cache holds its own heads'
KV of the same entries; evictions and disk reads are agreed around the ring.
"""

from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from loguru import logger

from exo.engine.mlx.batch import Batch, ContinuousBatcher, can_batch
from exo.engine.mlx.cpu_few_rows import configure_kernel_threads
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.lockstep import Decisions, LockstepBatch, LockstepFollower
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.pipeline import (
    RingLead,
    agree_disk_entries,
    handshake,
    ring_prefix_cache,
)
from exo.engine.mlx.prefix_cache import needs_checkpoints
from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
from exo.engine.mlx.ring import PeerLost, join_ring
from exo.engine.mlx.tensor import load_tensor_rank
from exo.engine.mlx.warm_up import warm_up
from exo.shared.types.shard import LayerRange
from exo.worker.runner.cache_policy import may_persist, memory_pressure
from exo.worker.runner.inbox import StopRequested
from exo.worker.runner.protocol import StatusChanged
from exo.worker.runner.serving import Runner

# A tensor rank reads every decode step's tokens back within the step (messages
# share the ring with the forward passes: nothing may be in flight between steps).
_ALWAYS_EAGER = 1 << 30


def serve_tensor_rank(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    disk: tuple[Path, int] | None,
) -> None:
    """Join the ring, load this rank's slice, then lead (rank 0) or follow."""
    try:
        link = join_ring(interrupt=runner.inbox.drain)
    except StopRequested:
        return
    logger.info(f"joined the tensor group as rank {link.rank} of {link.size}")
    configure_kernel_threads(pipeline_rank=True)  # ranks share machines in tests
    model = load_tensor_rank(model_dir, link.group)
    tokenizer = load_model_tokenizer(model_dir)
    local = LocalModel(model, tokenizer)
    local.eager_rows = _ALWAYS_EAGER
    warm_up(local)
    tier = (
        DiskTier(disk[0], cache_namespace(model_dir, None, (link.rank, link.size)), disk[1])
        if disk and prefix_cache_bytes > 0
        else None
    )
    cache = ring_prefix_cache(link, prefix_cache_bytes, memory_pressure, tier, lockstep=True)
    interrupt = runner.inbox.drain if link.rank == 0 else runner.refuse_tasks
    total = len(model.layers)
    try:
        agreed = handshake(
            link,
            LayerRange(start=0, end=total, total=total),
            cache is not None,
            interrupt=interrupt,
            disk_on=tier is not None,
            checkpoints=needs_checkpoints(local.make_cache()),
            every_layer=True,
        )
    except StopRequested:
        return
    if cache is not None:
        cache.ends_only = agreed.ends_only
        if agreed.disk:
            agree_disk_entries(link, cache, interrupt)
        elif tier is not None:
            logger.warning("prefix cache: another tensor rank keeps no disk tier: none is used")
            cache.detach_disk()
    generator = TextGenerator(local, tokenizer, cache)
    decide = Decisions(link)
    runner.ready(cache)
    if link.rank > 0:
        batch = _batch(generator, local, lambda task_id: decide(lambda: False))
        follower = LockstepFollower(link, batch)
        with suppress(StopRequested):  # the node's word may come before rank 0's
            follower.serve(
                interrupt=runner.refuse_tasks,
                on_task_start=lambda: runner.send(StatusChanged(status="running")),
                on_task_end=lambda: runner.ready(cache),
                on_persisted=lambda: runner.report_cache(cache),
            )
        if cache is not None:
            cache.persist()
        return
    # Rank 0: heartbeats, disk writes and the ring's stop are a pipeline driver's.
    driver = RingLead(link)
    inner = _batch(
        generator,
        local,
        lambda task_id: decide(lambda: runner.is_cancelled(task_id)),
        runner.report_progress,
    )

    def keep_alive() -> None:
        driver.keep_alive()
        if cache is not None and may_persist(cache) and driver.persist_idle(cache):
            runner.report_cache(cache)

    try:
        runner.serve(LockstepBatch(inner, link), keep_alive)
    except StopRequested:
        with suppress(PeerLost):
            driver.shutdown()
        if cache is not None:
            cache.persist()


def _batch(
    generator: TextGenerator,
    local: LocalModel,
    is_cancelled: Callable[[str], bool],
    on_progress: Callable[[str, int, int], None] = lambda task_id, done, total: None,
) -> Batch:
    """The same kind of batch on every rank: continuous where the caches batch."""
    if can_batch(local.make_cache()):
        return ContinuousBatcher(generator)
    logger.info("this model's caches do not batch: requests are served one at a time")
    return OneAtATime(generator, on_progress, is_cancelled)
