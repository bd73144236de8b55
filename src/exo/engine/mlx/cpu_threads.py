"""The CPU backend's math on the calling thread alone, for a while: the warm-up's.

Two libraries run a CPU runner's math on threads of their own: OpenBLAS (MLX's
matmuls of more than a few rows; its threads spin a while between calls, see
`OPENBLAS_THREAD_TIMEOUT`) and numba (the decode kernel of `cpu_few_rows`, about
200 parallel regions per token). On a busy machine each call waits for a thread
that is not running: the warm-up of a runner started after a node's death took
6-10 s there (2 cores, load average 4) and 1.1 s with both on one thread.
What a warm-up prepares (compiled kernels, traced shapes) is per process, not
per thread, so it loses nothing on one thread.
"""

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _openblas() -> ctypes.CDLL | None:
    """The process's OpenBLAS (preloaded in runners: `worker/runner/blas.py`), or None."""
    try:
        process = ctypes.CDLL(None)
        process.openblas_get_num_threads.restype = ctypes.c_int
    except (OSError, AttributeError):  # no OpenBLAS here (macOS: Accelerate)
        return None
    return process


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Meanwhile OpenBLAS (process-wide) and numba's kernel (called from this
    thread: numba's count is per calling thread) use one thread; unchanged where
    they are absent or not loaded."""
    openblas = _openblas()
    numba = sys.modules.get("numba")  # imported with the kernel, if it could be
    blas_threads: int | None = openblas.openblas_get_num_threads() if openblas else None
    kernel_threads: int | None = numba.get_num_threads() if numba else None
    if openblas is not None:
        openblas.openblas_set_num_threads(1)
    if numba is not None:
        numba.set_num_threads(1)
    try:
        yield
    finally:
        if openblas is not None and blas_threads is not None:
            openblas.openblas_set_num_threads(blas_threads)
        if numba is not None and kernel_threads is not None:
            numba.set_num_threads(kernel_threads)
