"""The node process never imports MLX: runners do, so a broken MLX install shows
as a failed runner rather than a node that cannot start."""

import subprocess
import sys

LOADED_MLX = (
    "import sys, exo.node, exo.main; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
)


def test_the_node_process_does_not_import_mlx() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", LOADED_MLX], capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
