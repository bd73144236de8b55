"""Imports only point down: `shared` <- `engine`, `models` <- `master` <- `cluster`
<- `worker` <- `api` <- `node.py` <- `main.py`.

Every import of every module under src/exo counts, including imports inside
functions and under TYPE_CHECKING: a lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom first. Packages of one level may not import each other either.
LAYERS: list[set[str]] = [
    {"shared"},
    {"engine", "models"},
    {"master"},
    {"cluster"},
    {"worker"},
    {"api"},
    {"node"},  # wires the components
    {"main"},  # the CLI: builds a node and runs it
]
# `exo/__init__.py`, the package root, belongs with the cluster link (as does the
# generated `cluster/proto`).
PACKAGE_ROOT_LAYER = "cluster"


def part_of(module: str) -> str:
    """The layer part (`shared`, `engine`, …, `node`) an `exo.…` module belongs to."""
    names = module.split(".")
    assert names[0] == "exo", module
    return names[1] if len(names) > 1 else PACKAGE_ROOT_LAYER


def level(part: str) -> int:
    for index, parts in enumerate(LAYERS):
        if part in parts:
            return index
    raise AssertionError(f"exo.{part} is in no layer: add it to LAYERS in {__file__}")


def may_import(importer: str, imported: str) -> bool:
    a, b = part_of(importer), part_of(imported)
    return a == b or level(a) > level(b)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `exo` import in the file, wherever it is."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "exo" or name.startswith("exo.")]


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("exo.engine.mlx.generate", "exo.shared.types.tasks", True),
        ("exo.models.cards", "exo.shared.types.model_card", True),
        ("exo.master.placement", "exo.models.cards", True),
        ("exo.cluster.link", "exo.master.master", True),
        ("exo.cluster.proto.cluster_pb2_grpc", "exo.cluster.proto.cluster_pb2", True),
        ("exo", "exo.shared.types.ids", True),
        ("exo.worker.worker", "exo.cluster.link", True),
        ("exo.api.app", "exo.worker.served_model", True),
        ("exo.node", "exo.api.app", True),
        ("exo.main", "exo.node", True),
        ("exo.node", "exo.main", False),
        ("exo.shared.apply", "exo.master.master", False),
        ("exo.engine.mlx.load", "exo.models.cards", False),
        ("exo.models.hub_card", "exo.engine.mlx.load", False),
        ("exo.models.hub_card", "exo.worker.downloads", False),
        ("exo.master.placement", "exo.cluster.link", False),
        ("exo.cluster.link", "exo.worker.worker", False),
        ("exo.worker.worker", "exo.api.app", False),
        ("exo.api.app", "exo.node", False),
        ("exo.shared.types.ids", "exo", False),
    ],
)
def test_layer_rule(importer: str, imported: str, allowed: bool) -> None:
    assert may_import(importer, imported) is allowed


def test_imports_only_point_down() -> None:
    files = sorted((SRC / "exo").rglob("*.py"))
    assert files
    upward = [
        f"{path.relative_to(SRC)}:{line}: {imported}"
        for path in files
        for line, imported in imported_modules(path)
        if not may_import(module_name(path), imported)
    ]
    assert not upward, "imports that point up (or sideways):\n" + "\n".join(upward)
