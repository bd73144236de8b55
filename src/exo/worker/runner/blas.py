"""OpenBLAS preloading for runner processes on Linux.

`mlx[cpu]` ships a reference BLAS; preloading OpenBLAS from the
`cmeel-openblas` wheel makes float32 matmul ~80x faster. It must be in the
environment before the runner process starts, hence a child-process env.

That OpenBLAS needs `libgfortran.so.5`, which a bare machine may lack; the
`mlx-cpu` wheel bundles one under a mangled name, so we expose it under the
expected name in a small directory put on `LD_LIBRARY_PATH`.

The wheel's build does not run on every x86-64 CPU (cmeel-openblas 0.3.31's
`sgemm_beta` uses AVX-512 whatever core it detects: an illegal instruction on
AMD Zen 2/3 and most desktop Intel CPUs). A runner must never die of its BLAS,
so a child process multiplies two small matrices with it first, once per node
process; where that fails, a system OpenBLAS (Debian: libopenblas0) is tried
the same way, and with none that works runners keep MLX's own BLAS and the
node says why.
"""

import ctypes.util
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

from loguru import logger

from exo.shared.package_files import find_package_file
from exo.worker.runner.bytecode import with_bytecode_cache


def openblas_library() -> Path | None:
    if not sys.platform.startswith("linux"):
        return None
    return find_package_file("cmeel-openblas", lambda name: name == "libopenblas.so.0")


def usable_openblas(library_path: str) -> str | None:
    """The OpenBLAS runners preload: the wheel's, else the system's, whichever
    first computes a product here (`LD_LIBRARY_PATH` = `library_path`)."""
    candidates = [str(lib) for lib in [openblas_library()] if lib is not None]
    system = ctypes.util.find_library("openblas") if sys.platform.startswith("linux") else None
    candidates += [system] if system else []
    return next((lib for lib in candidates if openblas_runs(lib, library_path)), None)


def load_openblas_here() -> bool:
    """Make this process's MLX use OpenBLAS, for in-process model work (tests).

    MLX resolves its BLAS symbols in the global scope first, so loading OpenBLAS
    there before MLX is imported has the effect of a preload. The wheel's needs a
    system `libgfortran.so.5` (Debian: libgfortran5): the runners' shim directory
    only works through `LD_LIBRARY_PATH`, which is read at process start.
    """
    if "mlx.core" in sys.modules:
        return False
    library = usable_openblas(os.environ.get("LD_LIBRARY_PATH", ""))
    if library is None:
        return False
    try:
        ctypes.CDLL(library, mode=os.RTLD_GLOBAL)
    except OSError:
        return False
    return True


# A float32 matrix product through the library's CBLAS interface, big enough
# for its threaded kernels, in a child process (argv: the library's path).
_PROBE = """
import ctypes, sys
blas = ctypes.CDLL(sys.argv[1])
n = 256
Matrix = ctypes.c_float * (n * n)
a, c = Matrix(*([1.0] * (n * n))), Matrix()
f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
blas.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
blas.cblas_sgemm(101, 111, 111, n, n, n, 1.0, a, n, a, n, 0.0, c, n)
sys.exit(0 if c[0] == n and c[n * n - 1] == n else 3)
"""
_PROBE_SECONDS = 30


@functools.cache
def openblas_runs(library: str, library_path: str) -> bool:
    """Whether `library` (a path, or a name the loader finds) computes a matrix
    product on this CPU, with `LD_LIBRARY_PATH` = `library_path`; logs why not."""
    env = {**os.environ, "LD_LIBRARY_PATH": library_path}
    env.pop("LD_PRELOAD", None)
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, library],
            env=env,
            capture_output=True,
            timeout=_PROBE_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        why = f"its check did not finish ({error})"
    else:
        if result.returncode == 0:
            return True
        code = result.returncode
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if code == -signal.SIGILL:
            why += ": it uses instructions this CPU lacks (AVX-512)"
    # (A warning only where no OpenBLAS works: `_no_openblas`.)
    logger.info(f"OpenBLAS {library} fails on this machine ({why}): not used")
    return False


def _gfortran_shim_dir(cache_dir: Path) -> Path | None:
    """A directory holding `libgfortran.so.5` (and its libquadmath) from the mlx-cpu wheel."""
    gfortran = find_package_file("mlx-cpu", lambda n: n.startswith("libgfortran-") and ".so" in n)
    if gfortran is None:
        return None
    shim = cache_dir / "blas-libs"
    shim.mkdir(parents=True, exist_ok=True)
    links = {"libgfortran.so.5": gfortran}
    # The mangled libgfortran finds its mangled libquadmath through $ORIGIN,
    # which is the link's directory, so that one is linked under its own name.
    for sibling in gfortran.parent.glob("libquadmath-*"):
        links[sibling.name] = sibling
    for name, target in links.items():
        link = shim / name
        if not (link.is_symlink() and link.resolve() == target):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return shim


@functools.cache
def _no_openblas() -> None:
    logger.warning(
        "no OpenBLAS works here: runners use MLX's own BLAS, which multiplies "
        "float32 matrices ~80x slower (Debian: apt install libopenblas0)"
    )


def runner_environment(cache_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a runner child process (OpenBLAS preloaded where found,
    its bytecode kept: `bytecode.py`)."""
    env = with_bytecode_cache(os.environ if base is None else base)
    # OpenBLAS threads spin ~0.1 s after each call by default: a pipeline rank
    # waiting on its neighbour would keep the cores the neighbour computes on
    # busy (2-rank decode at 0.5x of 1 rank). This lets them sleep sooner.
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")
    wheel = openblas_library()
    if wheel is not None and ctypes.util.find_library("gfortran") is None:
        shim = _gfortran_shim_dir(cache_dir)
        if shim is not None:
            paths = [str(shim), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
            env["LD_LIBRARY_PATH"] = ":".join(paths)
    lib = usable_openblas(env.get("LD_LIBRARY_PATH", ""))
    if lib is None:
        if wheel is not None:  # (elsewhere, no OpenBLAS is expected)
            _no_openblas()
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib, *preload])
    return env
