"""When a runner's prefix cache evicts regardless of its budget, and when it
writes entries to its disk tier: both roles (whole model, pipeline rank) alike."""

import time

import psutil

from exo.engine.mlx.prefix_cache import KVPrefixCache

# Below this share of free RAM the prefix cache evicts regardless of its budget.
LOW_MEMORY_FRACTION = 0.08
# The prefix cache writes to disk only after this long without a request.
PERSIST_AFTER_IDLE_SECONDS = 5.0


def memory_pressure() -> bool:
    memory = psutil.virtual_memory()
    return memory.available < LOW_MEMORY_FRACTION * memory.total


def may_persist(cache: KVPrefixCache) -> bool:
    """Whether requests paused long enough for a disk write (one entry per idle
    poll, so that a request that comes waits for one file at most)."""
    return time.monotonic() - cache.last_active >= PERSIST_AFTER_IDLE_SECONDS
