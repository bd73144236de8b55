"""Regenerate the Python modules of the cluster's gRPC transport from `proto/`.

    uv run python -m exo.cluster.codegen

writes `cluster_pb2.py`, `cluster_pb2.pyi`, `cluster_pb2_grpc.py` and `__init__.py`
into `src/exo/cluster/proto/`. A unit test regenerates them into a temporary
directory and fails when the committed files differ (stale generated code).

`protoc` is run (from the `grpcio-tools` dev dependency) with `proto/` as the
include root, so the descriptor keeps its natural name `exo/cluster.proto`; the
generated code is then moved into the package `exo.cluster.proto`, and the few
lines that name its module are rewritten to that package (each rewrite must match
exactly once, so a change in the generator's output fails loudly instead of
producing a module that imports the wrong thing).
"""

import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "exo/cluster.proto"
PACKAGE = "exo.cluster.proto"
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "proto"

INIT_TEXT = '''"""Generated gRPC modules of the cluster transport (from proto/exo/cluster.proto).

Do not edit: regenerate with `uv run python -m exo.cluster.codegen`.
"""
'''

# Per generated file: (text protoc wrote, text it must become).
_REWRITES: dict[str, list[tuple[str, str]]] = {
    "cluster_pb2.py": [
        (
            "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'exo.cluster_pb2', _globals)",
            f"_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, '{PACKAGE}.cluster_pb2', _globals)",
        ),
    ],
    "cluster_pb2.pyi": [],
    "cluster_pb2_grpc.py": [
        (
            "from exo import cluster_pb2 as exo_dot_cluster__pb2",
            f"from {PACKAGE} import cluster_pb2 as exo_dot_cluster__pb2",
        ),
        (
            "generated code in exo/cluster_pb2_grpc.py",
            f"generated code in {PACKAGE.replace('.', '/')}/cluster_pb2_grpc.py",
        ),
    ],
}

GENERATED_FILES = ("__init__.py", *_REWRITES)


def _run_protoc(work_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--python_out={work_dir}",
            f"--pyi_out={work_dir}",
            f"--grpc_python_out={work_dir}",
            PROTO_FILE,
        ],
        cwd=PROTO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"protoc failed (exit {result.returncode}) on {PROTO_FILE}:\n{result.stderr}"
        )


def _rewrite(name: str, text: str) -> str:
    for old, new in _REWRITES[name]:
        count = text.count(old)
        if count != 1:
            raise RuntimeError(
                f"codegen: expected exactly one {old!r} in generated {name}, found {count}"
            )
        text = text.replace(old, new)
    return text


def generate(out_dir: Path) -> None:
    """Generate the modules of package `exo.cluster.proto` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="exo-codegen-") as tmp:
        work_dir = Path(tmp)
        _run_protoc(work_dir)
        generated = work_dir / Path(PROTO_FILE).parent
        for name in _REWRITES:
            text = (generated / name).read_text(encoding="utf-8")
            (out_dir / name).write_text(_rewrite(name, text), encoding="utf-8", newline="\n")
    (out_dir / "__init__.py").write_text(INIT_TEXT, encoding="utf-8", newline="\n")


def main() -> None:
    generate(DEFAULT_OUT_DIR)
    for name in GENERATED_FILES:
        print(DEFAULT_OUT_DIR / name)


if __name__ == "__main__":
    main()
