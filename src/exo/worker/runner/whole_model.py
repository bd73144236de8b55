"""A runner that holds the whole model alone: it serves the tasks it holds
together (`engine/mlx/batch.py`), or one at a time where the model's caches have
no batched form. Its prefix cache writes an entry to disk whenever requests
pause, and the rest on a clean stop."""

import time
from pathlib import Path

from loguru import logger
from mlx_lm.utils import load_config

from exo.engine.mlx.batch import Batch, ContinuousBatcher, can_batch
from exo.engine.mlx.draft_model import DraftModel
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.multimodal_rope import MultimodalRopeModel, with_multimodal_rope
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache
from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
from exo.engine.mlx.vision import VisionEncoder, vision_placeholder
from exo.engine.mlx.warm_up import warm_up
from exo.worker.runner.cache_policy import may_persist, memory_pressure
from exo.worker.runner.inbox import StopRequested
from exo.worker.runner.memory_admission import MemorySettings, memory_gate, weights_nbytes
from exo.worker.runner.serving import Runner


def serve_whole_model(
    runner: Runner,
    model_dir: Path,
    prefix_cache_bytes: int,
    disk: tuple[Path, int] | None,
    memory: MemorySettings | None = None,
    draft_model_dir: Path | None = None,
) -> None:
    """Load the model, then serve tasks until the node asks to stop; with
    `memory`, a task starts only when its KV fits (`memory_admission.py`); with
    `draft_model_dir`, that model drafts text that copies nothing
    (`engine/mlx/draft_model.py`)."""
    started = time.monotonic()
    model, tokenizer = load_for_inference(model_dir)
    loaded = time.monotonic()
    forward = with_multimodal_rope(model, load_config(model_dir))
    positions = isinstance(forward, MultimodalRopeModel)  # its caches keep position deltas
    namespace = cache_namespace(model_dir, None, positions=positions)
    cache = (
        KVPrefixCache(
            prefix_cache_bytes,
            memory_pressure=memory_pressure,
            disk=DiskTier(disk[0], namespace, disk[1]) if disk else None,
            decode=tokenizer.decode,
        )
        if prefix_cache_bytes > 0
        else None
    )
    local = LocalModel(forward, tokenizer)
    caches = local.make_cache()
    warm_up(local, caches)  # first-use compiles before "ready", not in the first request
    logger.info(
        f"loaded the model in {loaded - started:.1f}s, warmed it up in "
        f"{time.monotonic() - loaded:.1f}s"
    )
    vision = VisionEncoder(model_dir, model) if vision_placeholder(model_dir) else None
    draft = DraftModel.load(draft_model_dir, tokenizer) if draft_model_dir else None
    if draft is not None:
        logger.info(f"{draft.name} drafts text that copies nothing")
    generator = TextGenerator(local, tokenizer, cache, vision=vision)
    batch = _batch(runner, generator, caches, draft)
    if memory is not None:
        beside = (vision.nbytes if vision is not None else 0) + (draft.nbytes if draft else 0)
        runner.memory = memory_gate(weights_nbytes(model) + beside, model_dir, memory)
    runner.ready(cache)
    try:
        runner.serve(batch, keep_alive=lambda: _persist_while_idle(runner, cache))
    except StopRequested:  # a clean stop: write what is not on disk yet
        if cache is not None:
            cache.persist()


def _batch(
    runner: Runner,
    generator: TextGenerator,
    caches: list[LayerCache],
    draft: DraftModel | None = None,
) -> Batch:
    if can_batch(caches):
        return ContinuousBatcher.for_caches(generator, caches, draft)
    logger.info("this model's caches do not batch: requests are served one at a time")
    if draft is not None:
        logger.warning(
            f"{draft.name} drafts nothing: requests served one at a time do not speculate"
        )
    return OneAtATime(generator, runner.report_progress, runner.is_cancelled)


def _persist_while_idle(runner: Runner, cache: KVPrefixCache | None) -> None:
    """Once requests pause, write the newest entry not on disk yet, then report it."""
    if cache is not None and may_persist(cache) and cache.persist(max_entries=1):
        runner.report_cache(cache)
