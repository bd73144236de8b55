"""Tests that run MLX in the test process get OpenBLAS, as runners do.

This package is imported before any test module or conftest imports MLX.
"""

import os

# The suite runs on two workers (pyproject's addopts) on as many cores. OpenMP
# threads that spin while they wait for work (the CPU decode kernel's, in the
# test process and in the runners started here, which inherit this) would
# then take turns with the other worker's: several times slower each.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from exo.worker.runner.blas import load_openblas_here

OPENBLAS_IN_PROCESS = load_openblas_here()
