import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exo.worker.runner.blas import (
    openblas_library,
    openblas_runs,
    runner_environment,
    usable_openblas,
)

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
    wheel = openblas_library()
    assert wheel is not None and wheel.exists()
    env = runner_environment(tmp_path, base={"PATH": "/usr/bin:/bin"})
    library = usable_openblas(env.get("LD_LIBRARY_PATH", ""))
    if library is None:
        pytest.skip("no OpenBLAS runs on this machine (the wheel's needs AVX-512)")
    assert env["LD_PRELOAD"].split(":")[0] == library
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux only"
)
def test_a_library_that_fails_its_product_is_never_preloaded(tmp_path: Path) -> None:
    """A library the check cannot run (here: not a library; on CPUs without
    AVX-512: the wheel's, killed by SIGILL) is not used, the next one is."""
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"not a library")
    assert not openblas_runs(str(fake), "")
    chosen = usable_openblas("")
    assert chosen is None or openblas_runs(chosen, "")


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
    not sys.platform.startswith("linux")
    or ctypes.util.find_library("gfortran") is None
    or usable_openblas(os.environ.get("LD_LIBRARY_PATH", "")) is None,
    reason="needs Linux, a system libgfortran.so.5 and an OpenBLAS that runs here",
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
