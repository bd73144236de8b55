"""`one_cpu_thread`: OpenBLAS and numba's kernel on one thread meanwhile, as many
as before afterwards."""

import subprocess
import sys
from pathlib import Path

import pytest

from exo.worker.runner.blas import runner_environment

PROBE = """
import ctypes
import numba
from exo.engine.mlx.cpu_threads import one_cpu_thread
blas = ctypes.CDLL(None)
before = (blas.openblas_get_num_threads(), numba.get_num_threads())
with one_cpu_thread():
    during = (blas.openblas_get_num_threads(), numba.get_num_threads())
print(before, during, (blas.openblas_get_num_threads(), numba.get_num_threads()))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS and numba are Linux dependencies"
)
def test_one_cpu_thread_sets_both_libraries_to_one_thread_and_back(tmp_path: Path) -> None:
    env = runner_environment(tmp_path) | {"OPENBLAS_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(2,", "2)", "(1,", "1)", "(2,", "2)"]


SWITCH_PROBE = """
import ctypes
import mlx.core as mx
import mlx.nn as nn
from exo.engine.mlx.cpu_few_rows import FewRowsLinear, load_kernel
from exo.engine.mlx.cpu_threads import one_cpu_thread
blas = ctypes.CDLL(None)
seen = [blas.openblas_get_num_threads()]
layer = FewRowsLinear(nn.Linear(64, 32), load_kernel())
mx.eval(layer(mx.ones((2, 64))))
seen.append(blas.openblas_get_num_threads())
mx.eval(layer(mx.ones((40, 64))))
seen.append(blas.openblas_get_num_threads())
mx.eval(layer(mx.ones((1, 64))))
with one_cpu_thread():
    mx.eval(layer(mx.ones((40, 64))))
    seen.append(blas.openblas_get_num_threads())
seen.append(blas.openblas_get_num_threads())
print(*seen)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS and numba are Linux dependencies"
)
def test_openblas_runs_on_one_thread_while_products_go_through_the_kernel(tmp_path: Path) -> None:
    """A few rows (the kernel): one thread; more rows (MLX's matmul, OpenBLAS's):
    its count again; within `one_cpu_thread` one, whatever the rows, and its
    count after."""
    env = runner_environment(tmp_path) | {"OPENBLAS_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-c", SWITCH_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "1", "2", "1", "2"]
