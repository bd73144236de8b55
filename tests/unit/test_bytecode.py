"""Runner processes keep their bytecode where `PYTHONDONTWRITEBYTECODE` would
have them compile every module at every start."""

import subprocess
import sys
from pathlib import Path

import pytest

from exo.worker.runner.bytecode import bytecode_dir, with_bytecode_cache

KEPT = {"PYTHONPYCACHEPREFIX": "exo's cache"}  # stands for `bytecode_dir()`


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PATH": "/bin"}, {"PATH": "/bin"}),  # Python keeps bytecode itself
        ({"PYTHONDONTWRITEBYTECODE": ""}, {"PYTHONDONTWRITEBYTECODE": ""}),  # unset, in effect
        (  # the user's own prefix wins
            {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/x"},
            {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/x"},
        ),
        ({"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}, {"PATH": "/bin", **KEPT}),
    ],
)
def test_bytecode_is_kept_in_exo_cache_only_where_python_would_keep_none(
    env: dict[str, str], expected: dict[str, str]
) -> None:
    if expected.get("PYTHONPYCACHEPREFIX") == KEPT["PYTHONPYCACHEPREFIX"]:
        expected = expected | {"PYTHONPYCACHEPREFIX": str(bytecode_dir())}
    assert with_bytecode_cache(env) == expected


def test_a_runner_process_writes_its_bytecode_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src" / "probe_module.py"
    source.parent.mkdir()
    source.write_text("VALUE = 1\n")
    env = with_bytecode_cache({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(source.parent)})
    subprocess.run([sys.executable, "-c", "import probe_module"], env=env, check=True, timeout=60)
    assert [p.name for p in bytecode_dir().rglob("probe_module.*.pyc")]
