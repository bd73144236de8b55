"""How many threads the CPU backend's math libraries use: one for the
warm-up, and OpenBLAS on one while forward passes go through the decode kernel.

Two libraries run a CPU runner's math on threads of their own: OpenBLAS (MLX's
matmuls of more than a few rows; its threads spin a while between calls, see
`OPENBLAS_THREAD_TIMEOUT`) and numba (the decode kernel of `cpu_few_rows`, about
200 parallel regions per token; its OpenMP threads spin a while after each).

- On a busy machine each call waits for a thread that is not running: the
  warm-up of a runner started after a node's death took 6-10 s there (2 cores,
  load average 4) and 1.1 s with both on one thread. What a warm-up prepares
  (compiled kernels, traced shapes) is per process, not per thread, so it loses
  nothing on one thread (`one_cpu_thread`).
- A forward pass through the kernel may still call OpenBLAS between its
  matmuls (MLX's attention where `cpu_attention`'s does not apply, a mixture of
  experts' gathered matmuls); OpenBLAS's threads and the kernel's spinning ones
  then take turns on the cores. Before attention had a kernel, a 1-row verify
  step of 7-12 tokens took 280-390 ms so, 115-155 ms with OpenBLAS on one
  thread for those passes (`blas_for_kernel`), on 2 cores.
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


class _BlasThreads:
    """OpenBLAS's thread count as forward passes switch between the kernel and
    MLX's matmul; left alone while `one_cpu_thread` holds it."""

    def __init__(self) -> None:
        self._default = 0  # the count before the switch went to one thread
        self._on_one = False
        self.holds = 0  # `one_cpu_thread`s entered and not left
        # Looked up at the first switch, by when a runner has loaded OpenBLAS.
        self._openblas: ctypes.CDLL | bool | None = False

    def _library(self) -> ctypes.CDLL | None:
        if self._openblas is False:
            self._openblas = _openblas()
        return self._openblas if isinstance(self._openblas, ctypes.CDLL) else None

    def for_kernel(self) -> None:
        if not self._on_one and not self.holds and (openblas := self._library()) is not None:
            self._default = openblas.openblas_get_num_threads()
            openblas.openblas_set_num_threads(1)
            self._on_one = True

    def for_matmul(self) -> None:
        if self._on_one and not self.holds and (openblas := self._library()) is not None:
            openblas.openblas_set_num_threads(self._default)
            self._on_one = False


blas_for_kernel = _BlasThreads()


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Meanwhile OpenBLAS (process-wide) and numba's kernel (called from this
    thread: numba's count is per calling thread) use one thread; unchanged where
    they are absent or not loaded."""
    blas_for_kernel.for_matmul()  # its default is what is restored after
    openblas = _openblas()
    numba = sys.modules.get("numba")  # imported with the kernel, if it could be
    blas_threads: int | None = openblas.openblas_get_num_threads() if openblas else None
    kernel_threads: int | None = numba.get_num_threads() if numba else None
    if openblas is not None:
        openblas.openblas_set_num_threads(1)
    if numba is not None:
        numba.set_num_threads(1)
    blas_for_kernel.holds += 1
    try:
        yield
    finally:
        blas_for_kernel.holds -= 1
        if openblas is not None and blas_threads is not None:
            openblas.openblas_set_num_threads(blas_threads)
        if numba is not None and kernel_threads is not None:
            numba.set_num_threads(kernel_threads)
