"""Where runner processes keep the bytecode Python compiles their modules to.

A runner imports about a thousand modules (MLX, mlx_lm, transformers, numba,
exo's own). Python compiles each one's source once and keeps the bytecode next
to it (`__pycache__`), except where `PYTHONDONTWRITEBYTECODE` is set (container
images often set it): there every runner process compiled them all again, ~2 s
of CPU on a 2-core machine, which a runner started after a node's death or a
crash waits for. There runners keep their bytecode in exo's cache folder
instead (`PYTHONPYCACHEPREFIX`), shared by the machine's exo processes: the
machine's first runner compiles, the next ones read, as they would without the
setting.
"""

from collections.abc import Mapping
from pathlib import Path

import platformdirs


def bytecode_dir() -> Path:
    return Path(platformdirs.user_cache_dir("exo")) / "bytecode"


def with_bytecode_cache(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a runner process: as it is where Python keeps bytecode itself
    (or a prefix is set already); else with its bytecode kept in `bytecode_dir`."""
    if not env.get("PYTHONDONTWRITEBYTECODE") or env.get("PYTHONPYCACHEPREFIX"):
        return dict(env)
    kept = {name: value for name, value in env.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return kept | {"PYTHONPYCACHEPREFIX": str(bytecode_dir())}
