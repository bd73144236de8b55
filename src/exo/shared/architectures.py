"""Which model architectures (config.json's `model_type`) exo can serve: whole
on one node, any that mlx-lm can load; split across nodes (pipeline ranks),
the ones `engine/mlx/shard.py` can slice.

Placement checks a card against these before any node downloads a byte. The
node process never imports MLX, so mlx-lm's model modules are looked up on
disk, not imported.
"""

import ast
import functools
import importlib.util
from pathlib import Path

SHARDABLE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@functools.cache
def _mlx_lm_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _mlx_lm_remapping() -> dict[str, str]:
    """mlx-lm's `MODEL_REMAPPING` (model types served by another type's module),
    read from its source: importing it would import MLX."""
    package = _mlx_lm_dir()
    if package is None:
        return {}
    tree = ast.parse((package / "utils.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            mapping = ast.literal_eval(node.value)
            return {str(k): str(v) for k, v in mapping.items()}
    return {}


def loadable_whole(architecture: str) -> bool:
    """mlx-lm has a model for `architecture` (so one node can load it whole)."""
    package = _mlx_lm_dir()
    if package is None:
        return False
    module = _mlx_lm_remapping().get(architecture, architecture)
    if not module or "/" in module or module.startswith("."):
        return False
    return (package / "models" / f"{module}.py").is_file()


def shardable(architecture: str) -> bool:
    """exo can split `architecture` into pipeline ranks."""
    return architecture in SHARDABLE_ARCHITECTURES
