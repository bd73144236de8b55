"""Tests that run MLX in the test process get OpenBLAS, as runners do.

This package is imported before any test module or conftest imports MLX.
"""

from exo.worker.runner.blas import load_openblas_here

OPENBLAS_IN_PROCESS = load_openblas_here()
