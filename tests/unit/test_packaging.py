"""The wheel carries the top-level dashboard, and the installed API serves it."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports the API from the unpacked wheel (first on the path) and fetches `/`;
# the page route needs no cluster.
SERVE_PAGE = """
import sys
from fastapi.testclient import TestClient
from exo.api import app
assert app.__file__.startswith(sys.argv[1]), app.__file__
page = TestClient(app.create_app({}, cluster=None)).get("/")
assert page.status_code == 200, page.status_code
sys.stdout.write(page.text)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [uv, "build", "--wheel", "--quiet", "--out-dir", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    [built] = out.glob("exo-*.whl")
    return built


def test_the_wheel_carries_the_dashboard(wheel: Path) -> None:
    source = ROOT / "dashboard"
    files = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    assert "index.html" in files
    with zipfile.ZipFile(wheel) as archive:
        packaged = sorted(
            name.removeprefix("exo/dashboard/")
            for name in archive.namelist()
            if name.startswith("exo/dashboard/")
        )
        assert packaged == files
        for name in files:
            assert archive.read(f"exo/dashboard/{name}") == (source / name).read_bytes()


def test_the_installed_api_serves_the_packaged_dashboard(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    served = subprocess.run(
        [sys.executable, "-c", SERVE_PAGE, str(site)],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert served.returncode == 0, served.stderr
    assert served.stdout == (site / "exo" / "dashboard" / "index.html").read_text(encoding="utf-8")
    assert "<title>exo cluster</title>" in served.stdout
