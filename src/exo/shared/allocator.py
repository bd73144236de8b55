"""glibc allocator settings for the node process.

Model files stream between nodes in 1 MiB chunks; with glibc's defaults every
chunk's buffers are fresh pages from the kernel (mmap/trim at 128 KiB), so each
MiB pays page faults and page zeroing. Serving big blocks from the heap and
keeping some freed heap roughly doubles peer transfer speed (bench/peer_transfer.py).
"""

import ctypes
import ctypes.util
import sys

from loguru import logger

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 128 << 20  # freed heap kept for reuse, at most


def keep_large_buffers_in_the_heap() -> bool:
    """Apply the settings on Linux with glibc; False elsewhere (nothing to do)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        logger.debug("mallopt refused the allocator settings")
    return ok
