"""Skip marks for tests of one platform's facts, each with its reason.

The suite runs on Linux (CI: `mlx[cpu]`) and on macOS (Metal). A test of the CPU
backend's facts (float32 weights, the few-rows decode kernel) or of Linux's
(numba, which is a Linux-only dependency; OpenBLAS preloading) skips elsewhere,
saying why (`-rs` is in the default options).
"""

import importlib

import pytest

from exo.engine.mlx.backend import backend_name


def _numba_missing() -> str | None:
    """Why numba cannot be imported here (None: it can)."""
    try:
        importlib.import_module("numba")
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


NUMBA_MISSING = _numba_missing()
HAS_NUMBA = NUMBA_MISSING is None

# The CPU decode kernel (`exo.engine.mlx.few_rows_kernel`) is numba's.
needs_numba = pytest.mark.skipif(
    not HAS_NUMBA,
    reason=f"needs numba, the CPU decode kernel's Linux-only dependency ({NUMBA_MISSING})",
)
# What MLX runs on by default here: facts of its CPU backend hold there only.
needs_cpu_backend = pytest.mark.skipif(
    backend_name() != "cpu",
    reason=f"a fact of MLX's CPU backend; the default device here is {backend_name()}",
)
