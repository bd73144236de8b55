"""The web dashboard's files: the top-level `dashboard/` folder of the project.

The wheel maps that folder into the package (`exo/dashboard`); a checkout (an
editable install, `uv run exo`) serves it from where it lies, next to `src/`.
`/` is the page; `/dashboard/<name>` its modules, styles and icon (plain ES
modules: no build step)."""

import re
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from exo.api.errors import APIError

PACKAGE_DIR = Path(__file__).resolve().parents[1]

MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# One flat folder: a name without a slash cannot leave it.
ASSET_NAME = re.compile(r"[a-z][a-z0-9_-]*\.(js|css|svg)")
# A new version must reach browsers at once; the files are small.
NO_CACHE = {"Cache-Control": "no-cache"}


def dashboard_dir() -> Path:
    """The installed copy when there is one, else the checkout's folder."""
    installed = PACKAGE_DIR / "dashboard"
    return installed if installed.is_dir() else PACKAGE_DIR.parents[1] / "dashboard"


def dashboard_html() -> str:
    return (dashboard_dir() / "index.html").read_text(encoding="utf-8")


def dashboard_asset(name: str) -> Path | None:
    """The dashboard file called `name`, None for any other name."""
    if ASSET_NAME.fullmatch(name) is None:
        return None
    folder = dashboard_dir().resolve()
    path = (folder / name).resolve()
    return path if path.parent == folder and path.is_file() else None


def dashboard_routes() -> APIRouter:
    router = APIRouter()
    page = dashboard_html()

    @router.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The web dashboard: topology, models and placement, chat, cache."""
        return HTMLResponse(page, headers=NO_CACHE)

    @router.get("/dashboard/{name}", response_model=None)
    async def asset(name: str) -> FileResponse:
        path = dashboard_asset(name)
        if path is None:
            raise APIError(404, f"no dashboard file {name!r}", "invalid_request_error", "not_found")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=NO_CACHE)

    return router
