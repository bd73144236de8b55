"""OpenBLAS preloading for runner processes on Linux.

`mlx[cpu]` ships a reference BLAS; preloading OpenBLAS from the
`cmeel-openblas` wheel makes float32 matmul ~80x faster. It must be in the
environment before the runner process starts, hence a child-process env.

That OpenBLAS needs `libgfortran.so.5`, which a bare machine may lack; the
`mlx-cpu` wheel bundles one under a mangled name, so we expose it under the
expected name in a small directory put on `LD_LIBRARY_PATH`.
"""

import ctypes.util
import os
import sys
from pathlib import Path

from loguru import logger

from exo.shared.package_files import find_package_file
from exo.worker.runner.bytecode import with_bytecode_cache


def openblas_library() -> Path | None:
    if not sys.platform.startswith("linux"):
        return None
    return find_package_file("cmeel-openblas", lambda name: name == "libopenblas.so.0")


def load_openblas_here() -> bool:
    """Make this process's MLX use OpenBLAS, for in-process model work (tests).

    MLX resolves its BLAS symbols in the global scope first, so loading OpenBLAS
    there before MLX is imported has the effect of a preload. It needs a system
    `libgfortran.so.5` (Debian: libgfortran5): the runners' shim directory only
    works through `LD_LIBRARY_PATH`, which is read at process start.
    """
    library = openblas_library()
    if library is None or "mlx.core" in sys.modules:
        return False
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    except OSError:
        return False
    return True


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


def runner_environment(cache_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a runner child process (OpenBLAS preloaded where found,
    its bytecode kept: `bytecode.py`)."""
    env = with_bytecode_cache(os.environ if base is None else base)
    # OpenBLAS threads spin ~0.1 s after each call by default: a pipeline rank
    # waiting on its neighbour would keep the cores the neighbour computes on
    # busy (2-rank decode at 0.5x of 1 rank). This lets them sleep sooner.
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")
    lib = openblas_library()
    if lib is None:
        return env
    if ctypes.util.find_library("gfortran") is None:
        shim = _gfortran_shim_dir(cache_dir)
        if shim is None:
            logger.warning("libgfortran not found: runners use MLX's slow reference BLAS")
            return env
        paths = [str(shim), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
        env["LD_LIBRARY_PATH"] = ":".join(paths)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != str(lib)]
    env["LD_PRELOAD"] = ":".join([str(lib), *preload])
    return env
