"""A runner that is one rank of a split instance: a range of layers (a pipeline
rank, `engine/mlx/pipeline.py`) or a slice of every layer (a tensor rank,
`engine/mlx/tensor.py`), serving in lockstep with the other ranks
(`engine/mlx/lockstep.py`).

The ranks start together: each joins the ring, then loads its part (loading
times differ: the handshake waits for the slowest), agrees with the others
(`engine/mlx/ring_agreements.py`: the handshake, then which disk entries every
rank holds) and warms up with them (the warm-up's forward passes cross the
ring). Then every rank runs the whole-model serving machinery on its part:
rank 0 takes the node's tasks and leads, with heartbeats and disk writes while
idle; the others follow it and fail any task sent to them by mistake. Memory
admission asks every rank (`memory_admission.RingMemoryGate`). Rank 0
stops when the node says so and stops the others (`SHUTDOWN` around the ring);
a follower stops at whichever comes first. A clean stop writes what the prefix
cache has not on disk yet (the next start's agreement drops what another rank
did not write).
"""

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from loguru import logger
from mlx_lm.utils import load_config

from exo.engine.mlx.batch import Batch, ContinuousBatcher, can_batch
from exo.engine.mlx.cpu_few_rows import configure_kernel_threads
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.lockstep import (
    LOCKSTEP_EAGER_ROWS,
    Decisions,
    LockstepBatch,
    LockstepFollower,
)
from exo.engine.mlx.multimodal_rope import install as install_multimodal_rope
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.pipeline import PipelineStage, RingDraw
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache, needs_checkpoints
from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
from exo.engine.mlx.ring import PeerLost, RingLink, join_ring
from exo.engine.mlx.ring_agreements import (
    RingLead,
    agree_disk_entries,
    handshake,
    ring_prefix_cache,
)
from exo.engine.mlx.shard import load_shard
from exo.engine.mlx.tensor import load_tensor_rank
from exo.engine.mlx.vision import VisionEncoder, vision_placeholder
from exo.engine.mlx.warm_up import warm_up
from exo.shared.types.shard import LayerRange
from exo.worker.runner.cache_policy import may_persist, memory_pressure
from exo.worker.runner.inbox import StopRequested
from exo.worker.runner.memory_admission import (
    MemoryGate,
    MemorySettings,
    RankAdmission,
    RingMemoryGate,
    memory_gate,
    weights_nbytes,
)
from exo.worker.runner.protocol import StatusChanged
from exo.worker.runner.serving import Runner


@dataclass(frozen=True)
class _Rank:
    """A rank in its ring, its part loaded, agreed with the other ranks."""

    link: RingLink
    local: LocalModel
    cache: KVPrefixCache | None
    # Every layer's caches, empty: what they can do is decided alike on every rank.
    whole_caches: list[LayerCache]
    # A vision model's image side (a pipeline's first rank reads the images) and
    # image token (every rank reads image keys as it).
    vision: VisionEncoder | None = None
    image_placeholder: int | None = None
    # This rank's memory admission (`memory_admission.py`); None: off.
    memory: MemoryGate | None = None


def serve_split_rank(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange,
    disk: tuple[Path, int] | None,
    tensor: bool,
    memory: MemorySettings | None = None,
) -> None:
    """Join the ring and load this rank's part (`layers` of a pipeline, or with
    `tensor` a slice of every layer), then lead (rank 0) or follow until stopped;
    with `memory`, a task starts only when its KV fits on every rank."""
    try:
        rank = _join(runner, model_dir, prefix_cache_bytes, layers, disk, tensor, memory)
    except StopRequested:  # stopped before the ring served: nothing to undo
        return
    runner.ready(rank.cache)
    if rank.link.rank == 0:
        _lead(runner, rank)
    else:
        _follow(runner, rank)


def _join(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange,
    disk: tuple[Path, int] | None,
    tensor: bool,
    memory: MemorySettings | None = None,
) -> _Rank:
    started = time.monotonic()
    link = join_ring(interrupt=runner.inbox.drain)
    joined = time.monotonic()
    kind = "tensor" if tensor else "pipeline"
    logger.info(
        f"joined the {kind} group as rank {link.rank} of {link.size} in {joined - started:.1f}s"
    )
    configure_kernel_threads(pipeline_rank=True)  # before loading, which starts the threads
    tokenizer = load_model_tokenizer(model_dir)
    # A tensor-split instance reads text only (the node refuses images for it).
    vision, placeholder = None, None if tensor else vision_placeholder(model_dir)
    gate: MemoryGate | None = None
    if tensor:
        local = LocalModel(load_tensor_rank(model_dir, link.group), tokenizer)
        whole_caches = local.make_cache()  # every rank holds every layer's kind
        namespace = cache_namespace(model_dir, None, (link.rank, link.size))
        if memory is not None:
            weights = weights_nbytes(local.model)
            gate = memory_gate(weights, model_dir, memory, tensor_rank=(link.rank, link.size))
    else:
        shard = load_shard(model_dir, layers)
        positions = install_multimodal_rope(shard.model, load_config(model_dir))
        stage = PipelineStage(shard, link, positions)
        local = LocalModel(stage, tokenizer, lambda step: RingDraw(step, link))
        whole_caches = shard.whole_model_caches()
        namespace = cache_namespace(model_dir, layers, positions=positions is not None)
        if placeholder is not None and link.rank == 0:
            # (Where this rank does not hold every layer that adds Qwen3-VL's
            # deepstack features, the node sends no images: `image_prompts_for`.)
            vision = VisionEncoder(model_dir, shard.model)
        if memory is not None:
            weights = shard.weight_bytes + (vision.nbytes if vision is not None else 0)
            gate = memory_gate(weights, model_dir, memory, layers=(layers.start, layers.end))
    local.eager_rows = LOCKSTEP_EAGER_ROWS
    logger.info(
        f"loaded {'a slice of every layer' if tensor else layers} (peak "
        f"{mx.get_peak_memory() / 1e6:.0f} MB) in {time.monotonic() - joined:.1f}s"
    )
    # This rank's share of each entry on disk, in a folder named by its part.
    tier = DiskTier(disk[0], namespace, disk[1]) if disk and prefix_cache_bytes > 0 else None
    cache = ring_prefix_cache(link, prefix_cache_bytes, memory_pressure, tier, lockstep=True)
    interrupt = runner.inbox.drain if link.rank == 0 else runner.refuse_tasks
    agreed = handshake(
        link,
        layers,
        cache is not None,
        interrupt=interrupt,
        disk_on=tier is not None,
        checkpoints=needs_checkpoints(local.make_cache()),
        every_layer=tensor,
    )
    # First-use compiles before "ready", not in the first request: every rank at once.
    warm_up(local, whole_caches)
    if cache is not None:
        cache.ends_only = agreed.ends_only
    if cache is not None and agreed.disk:
        agree_disk_entries(link, cache, interrupt)
    elif cache is not None and tier is not None:
        logger.warning(f"prefix cache: another {kind} rank keeps no disk tier: none is used")
        cache.detach_disk()
    return _Rank(link, local, cache, whole_caches, vision, placeholder, gate)


def _batch(
    rank: _Rank,
    is_cancelled: Callable[[str], bool],
    on_progress: Callable[[str, int, int], None] = lambda task_id, done, total: None,
) -> Batch:
    """The same kind of batch on every rank: continuous where the caches batch."""
    generator = TextGenerator(
        rank.local,
        rank.local.tokenizer,
        rank.cache,
        vision=rank.vision,
        image_placeholder=rank.image_placeholder,
    )
    if can_batch(rank.whole_caches):
        return ContinuousBatcher.for_caches(generator, rank.whole_caches)
    logger.info("this model's caches do not batch: requests are served one at a time")
    return OneAtATime(generator, on_progress, is_cancelled)


def _lead(runner: Runner, rank: _Rank) -> None:
    """Rank 0: serve the node's tasks until it stops the instance, then stop the
    other ranks."""
    cache, decide, lead = rank.cache, Decisions(rank.link), RingLead(rank.link)

    def keep_alive() -> None:
        """Heartbeats; once requests pause, one entry to disk per idle poll, on
        every rank (rank 0 names it)."""
        lead.keep_alive()
        if cache is not None and may_persist(cache) and lead.persist_idle(cache):
            runner.report_cache(cache)

    inner = _batch(
        rank, lambda task_id: decide(lambda: runner.is_cancelled(task_id)), runner.report_progress
    )
    if rank.memory is not None:  # every rank judges a task's memory (`ADMIT`)
        runner.memory = RingMemoryGate(rank.memory, rank.link)
    try:
        runner.serve(LockstepBatch(inner, rank.link), keep_alive)
    except StopRequested:  # the node stops the instance: rank 0 stops the ring
        with suppress(PeerLost):  # a rank stopped along with us may be gone already
            lead.shutdown()
        if cache is not None:
            cache.persist()


def _follow(runner: Runner, rank: _Rank) -> None:
    """Ranks > 0: make rank 0's calls until it stops the ring, or the node stops
    this rank first."""
    cache, decide = rank.cache, Decisions(rank.link)
    admission = RankAdmission(rank.memory, cache) if rank.memory is not None else None
    batch = _batch(rank, lambda task_id: decide(lambda: False))
    follower = LockstepFollower(rank.link, batch, admission)
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
