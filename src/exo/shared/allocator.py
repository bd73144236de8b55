"""glibc allocator settings for the node process.

Model files stream between nodes in 1 MiB chunks; with glibc's defaults every
chunk's buffers are fresh pages from the kernel (mmap/trim at 128 KiB), so each
MiB pays page faults and page zeroing. Serving big blocks from the heap and
keeping some freed heap roughly doubles peer transfer speed (bench/peer_transfer.py).

glibc gives freed heap back to the kernel only from the top of an arena, so
every burst of allocations (a peer's restart, a re-placement, a relay storm)
would stay in the process's RSS for good, in each thread's arena: the node
hands its free pages back now and then (`release_free_memory_periodically`).
"""

import ctypes
import ctypes.util
import functools
import sys

import anyio
from loguru import logger

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 128 << 20  # freed heap kept for reuse, at most
RELEASE_EVERY_SECONDS = 10.0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") else None  # musl has neither call


def keep_large_buffers_in_the_heap() -> bool:
    """Apply the settings on Linux with glibc; False elsewhere (nothing to do)."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        logger.debug("mallopt refused the allocator settings")
    return ok


def release_free_memory() -> bool:
    """Hand the heap's free pages, in every arena, back to the kernel (glibc's
    `malloc_trim`); False where there is nothing to do (not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


async def release_free_memory_periodically(every_seconds: float = RELEASE_EVERY_SECONDS) -> None:
    """Runs for the node's life: what a burst freed leaves the RSS within
    `every_seconds`, not never. (A peer transfer reuses its buffers between
    two releases, so transfers keep their speed.)"""
    if _glibc() is None:
        return
    while True:
        await anyio.sleep(every_seconds)
        # In a thread: it walks every arena, taking each one's lock in turn (the
        # event loop's allocations wait for the main arena's, briefly).
        await anyio.to_thread.run_sync(release_free_memory)
