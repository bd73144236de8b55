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
