"""The API serves the dashboard's own files and nothing else."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exo.api.dashboard import dashboard_dir, dashboard_routes
from exo.api.errors import install_error_handlers


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(dashboard_routes())
    return TestClient(app)


@pytest.mark.parametrize(
    ("path", "status", "media_type"),
    [
        ("/", 200, "text/html"),
        ("/dashboard/app.js", 200, "text/javascript"),
        ("/dashboard/style.css", 200, "text/css"),
        ("/dashboard/favicon.svg", 200, "image/svg+xml"),
        ("/dashboard/missing.js", 404, "application/json"),
        ("/dashboard/index.html", 404, "application/json"),  # the page is `/`
        ("/dashboard/..%2F..%2Fpyproject.toml", 404, "application/json"),
        ("/dashboard/%2E%2E%2Fsrc%2Fexo%2Fmain.py", 404, "application/json"),
        ("/dashboard/.hidden.js", 404, "application/json"),
        ("/dashboard/App.JS", 404, "application/json"),
    ],
)
def test_only_the_dashboard_files_are_served(
    client: TestClient, path: str, status: int, media_type: str
) -> None:
    response = client.get(path)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(media_type)


def test_every_module_the_page_imports_is_served(client: TestClient) -> None:
    for path in dashboard_dir().iterdir():
        if path.suffix in (".js", ".css", ".svg"):
            served = client.get(f"/dashboard/{path.name}")
            assert served.status_code == 200, path.name
            assert served.content == path.read_bytes()
