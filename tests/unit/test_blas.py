import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

from exo.worker.runner.blas import openblas_library, runner_environment

PROBE = """
import mlx.core as mx
a = mx.ones((64, 64))
assert (a @ a)[0, 0].item() == 64.0
print(any("libopenblas" in line for line in open("/proc/self/maps")))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only"
)
def test_runner_environment_preloads_a_working_openblas(tmp_path: Path) -> None:
    library = openblas_library()
    assert library is not None and library.exists()
    env = runner_environment(tmp_path, base={"PATH": "/usr/bin:/bin"})
    assert env["LD_PRELOAD"].split(":")[0] == str(library)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_runner_environment_keeps_other_preloads(tmp_path: Path) -> None:
    env = runner_environment(tmp_path, base={"LD_PRELOAD": "/lib/other.so"})
    assert "/lib/other.so" in env["LD_PRELOAD"].split(":")


IN_PROCESS_PROBE = """
import sys
{before}
from exo.worker.runner.blas import load_openblas_here
loaded = load_openblas_here()
import mlx.core as mx
a = mx.ones((64, 64))
assert (a @ a)[0, 0].item() == 64.0
print(loaded, any("libopenblas" in line for line in open("/proc/self/maps")))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("gfortran") is None,
    reason="needs Linux and a system libgfortran.so.5",
)
@pytest.mark.parametrize(
    ("before", "expected"),
    [("", "True True"), ("import mlx.core", "False False")],
    ids=["before-mlx", "after-mlx"],
)
def test_openblas_loads_in_process_only_before_mlx(before: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_PROBE.format(before=before)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
