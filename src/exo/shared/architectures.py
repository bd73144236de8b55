"""Which model architectures (config.json's `model_type`) exo can serve: whole
on one node, any that mlx-lm can load; split into pipeline ranks, any whose
mlx-lm model keeps its blocks in one list that its forward pass runs through,
each handing on only the hidden states (`engine/mlx/shard.py` runs the model's
own forward pass over a rank's part of that list).

Split by tensors (every rank holds a slice of every layer), any whose mlx-lm
model has its own `shard()`, and the families exo shards with a strategy of its
own (`EXO_TENSOR_STRATEGIES`, `engine/mlx/tensor.py`), unevenly where the sizes
call for it (`shared/tensor_split.py`).

Placement checks a card against these before any node downloads a byte. The
node process never imports MLX, so mlx-lm's model modules are read from disk
(their syntax tree), not imported; there is no hand-kept list.
"""

import ast
import functools
import importlib.util
from pathlib import Path


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


def _module_path(architecture: str) -> Path | None:
    package = _mlx_lm_dir()
    if package is None:
        return None
    module = _mlx_lm_remapping().get(architecture, architecture)
    if not module or "/" in module or module.startswith("."):
        return None
    path = package / "models" / f"{module}.py"
    return path if path.is_file() else None


def loadable_whole(architecture: str) -> bool:
    """mlx-lm has a model for `architecture` (so one node can load it whole)."""
    return _module_path(architecture) is not None


# The few trees one answer reads, not every one ever parsed: a module's tree
# takes megabytes, and a master asks again whenever it places a model.
@functools.lru_cache(maxsize=16)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _find_class(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.ClassDef] | None:
    """Class `name` of the module at `path`, following `from .x import y as name`."""
    tree = _tree(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and depth < 4:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = path.parent / f"{node.module}.py"
                    if source.is_file():
                        return _find_class(source, alias.name, depth + 1)
    return None


def _layers_definition(path: Path, name: str, depth: int = 0) -> ast.AST | None:
    """What class `name` (or a base class) says `layers` is: the property's return
    value, or what `__init__` assigns to `self.layers`."""
    found = _find_class(path, name)
    if found is None:
        return None
    path, cls = found
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "layers":
            returns = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
            return returns[0] if returns else None
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and any(
            ast.unparse(t) == "self.layers" for t in node.targets
        ):
            return node.value
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 4:
            value = _layers_definition(path, base.id, depth + 1)
            if value is not None:
                return value
    return None


def _is_attribute_chain(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _related_modules(path: Path, depth: int = 2) -> set[Path]:
    """The module and the model modules it imports (`from . import x`, `from .x import y`)."""
    found = {path}
    if depth == 0:
        return found
    for node in _tree(path).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                source = path.parent / f"{name}.py"
                if source.is_file() and source not in found:
                    found |= _related_modules(source, depth - 1)
    return found


def _layer_calls_hand_on_more(path: Path) -> bool:
    """Whether the forward pass unpacks several values from a layer's call (e.g.
    `h, shared = layer(h, ...)`): what passes between ranks is one array."""
    for module in _related_modules(path):
        tree = _tree(module)
        layer_names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.For) and "layers" in ast.unparse(node.iter):
                layer_names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Assign) and "layers" in ast.unparse(node.value):
                layer_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Tuple) for t in node.targets)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id in layer_names
            ):
                return True
    return False


@functools.cache  # answers are small; the trees behind them are not kept
def pipeline_refusal(architecture: str) -> str | None:
    """Why exo cannot split `architecture` into pipeline ranks; None when it can."""
    path = _module_path(architecture)
    if path is None:
        return f"mlx-lm has no model for {architecture!r}"
    definition = _layers_definition(path, "Model")
    if definition is None:
        return f"mlx-lm's {architecture!r} model names no list of layers"
    if not _is_attribute_chain(definition):
        return (
            f"mlx-lm's {architecture!r} model builds its layer list anew on each use "
            f"({ast.unparse(definition)})"
        )
    if _layer_calls_hand_on_more(path):
        return (
            f"mlx-lm's {architecture!r} layers hand on more than their hidden states "
            "from one layer to the next"
        )
    return None


# Families exo slices by tensors itself (`engine/mlx/tensor.py`, each tested),
# unevenly where the sizes call for it: the last four have no mlx-lm `shard()`,
# the others' would need every size divided evenly.
EXO_TENSOR_STRATEGIES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "qwen3_next",
        "nemotron_h",
        "gemma3_text",
    }
)


def _defines(path: Path, name: str, method: str, depth: int = 0) -> bool:
    """Whether class `name` (or a base class) defines `method`."""
    found = _find_class(path, name)
    if found is None:
        return False
    path, cls = found
    if any(isinstance(n, ast.FunctionDef) and n.name == method for n in cls.body):
        return True
    return depth < 4 and any(
        isinstance(base, ast.Name) and _defines(path, base.id, method, depth + 1)
        for base in cls.bases
    )


@functools.cache
def tensor_refusal(architecture: str) -> str | None:
    """Why exo cannot split `architecture` by tensors; None when it can."""
    path = _module_path(architecture)
    if path is None:
        return f"mlx-lm has no model for {architecture!r}"
    if architecture in EXO_TENSOR_STRATEGIES or _defines(path, "Model", "shard"):
        return None
    return (
        f"mlx-lm's {architecture!r} model has no tensor sharding (no shard()) "
        "and exo has no strategy of its own for it"
    )


def mlx_lm_architectures() -> list[str]:
    """Every model type mlx-lm has a module for (remapped names included)."""
    package = _mlx_lm_dir()
    if package is None:
        return []
    found = {
        path.stem
        for path in (package / "models").glob("*.py")
        if _find_class(path, "Model") is not None
    }
    found |= {name for name, module in _mlx_lm_remapping().items() if module in found}
    return sorted(found)
