"""The node process never imports MLX: runners do, so a broken MLX install shows
as a failed runner rather than a node that cannot start. Nor numba (the CPU
decode kernel's, a Linux-only dependency): only a CPU runner loads it, lazily."""

import subprocess
import sys

LOADED = (
    "import sys, exo.node, exo.main; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'numba')))"
)


def test_the_node_process_does_not_import_mlx_or_numba() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
