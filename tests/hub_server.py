"""A fake Hugging Face hub for tests: a real HTTP server on 127.0.0.1 serving
model folders with the hub's tree API and `resolve` downloads (Range, LFS files
redirected to a "CDN" path), with fault injection."""

import functools
import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

_TREE = re.compile(r"^/api/models/(.+)/tree/([^/]+)$")
_RESOLVE = re.compile(r"^/(.+?)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-$")
_CHUNK = 64 * 1024
REVISION = "main"


@dataclass(frozen=True)
class FileRequest:
    """A request for a file's bytes, as the server saw it."""

    path: str  # relative to the repo
    offset: int  # where the requested range starts (0 without Range)
    status: int


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _is_lfs(path: str) -> bool:
    return path.endswith(".safetensors")


class FakeHub:
    """Serves `repos` ({model id: folder}); `token`: requests without
    `Authorization: Bearer <token>` get 401. Tree listings come in pages of
    `page_size` entries linked by `Link: <...>; rel="next"`."""

    def __init__(
        self, repos: Mapping[str, Path], token: str | None = None, page_size: int = 1000
    ) -> None:
        self.repos = dict(repos)
        self.token = token
        self.page_size = page_size
        self.bytes_sent: Counter[str] = Counter()
        self.requests: list[FileRequest] = []
        self.authorizations: list[str | None] = []
        self._cuts: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._corrupt: set[str] = set()
        self._ignore_range: set[str] = set()
        self._holds: dict[str, tuple[int, threading.Event]] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def cut_after(self, path: str, n_bytes: int) -> None:
        """The next response for `path` closes the connection after `n_bytes`."""
        with self._lock:
            self._cuts[path] = n_bytes

    def corrupt_once(self, path: str) -> None:
        """The next response for `path` has one byte flipped (same length)."""
        with self._lock:
            self._corrupt.add(path)

    def fail_once(self, path: str, status: int) -> None:
        """The next response for `path` is an error with this status."""
        with self._lock:
            self._failures[path] = status

    def ignore_range_once(self, path: str) -> None:
        """The next response for `path` ignores Range: 200 with the whole file."""
        with self._lock:
            self._ignore_range.add(path)

    def hold_after(self, path: str, n_bytes: int) -> threading.Event:
        """The next response for `path` pauses after `n_bytes` until the
        returned event is set (at most a minute): a download caught in the middle."""
        release = threading.Event()
        with self._lock:
            self._holds[path] = (n_bytes, release)
        return release

    def _take_hold(self, path: str) -> tuple[int, threading.Event] | None:
        with self._lock:
            return self._holds.pop(path, None)

    def offsets(self, path: str) -> list[int]:
        """Where each request for `path` started."""
        return [r.offset for r in self.requests if r.path == path]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # --- called from the server's threads ----------------------------------------

    def _tree(self, repo: Path, cursor: int) -> tuple[list[dict[str, Any]], bool]:
        stamp = tuple((p, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(repo.rglob("*")))
        entries = _tree_entries(repo, stamp)
        page = entries[cursor : cursor + self.page_size]
        return page, cursor + self.page_size < len(entries)

    def _take_faults(self, path: str) -> tuple[int | None, int | None, bool, bool]:
        with self._lock:
            return (
                self._cuts.pop(path, None),
                self._failures.pop(path, None),
                _pop(self._corrupt, path),
                _pop(self._ignore_range, path),
            )

    def _record_authorization(self, authorization: str | None) -> None:
        with self._lock:
            self.authorizations.append(authorization)

    def _record(self, request: FileRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.bytes_sent[path] += n


@functools.lru_cache(maxsize=16)
def _tree_entries(repo: Path, stamp: tuple[tuple[Path, int, int], ...]) -> list[dict[str, Any]]:
    """The repo's tree listing, as the hub's API gives it (recursive). Hashing is
    slow: cached while the files' sizes and times (`stamp`) stay the same."""
    entries: list[dict[str, Any]] = []
    for item in sorted(repo.rglob("*")):
        rel = item.relative_to(repo).as_posix()
        if item.is_dir():
            entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": rel})
            continue
        data = item.read_bytes()
        entry: dict[str, Any] = {"type": "file", "size": len(data), "path": rel}
        if _is_lfs(rel):
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
            # As on the hub: the entry's oid is the pointer's blob sha1.
            entry["oid"] = git_sha1(pointer.encode())
            entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
        else:
            entry["oid"] = git_sha1(data)
        entries.append(entry)
    return entries


def _pop(items: set[str], item: str) -> bool:
    found = item in items
    items.discard(item)
    return found


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], hub: FakeHub
    ) -> None:
        super().__init__(address, handler)
        self.hub = hub


class _Handler(BaseHTTPRequestHandler):
    @property
    def hub(self) -> FakeHub:
        return cast(_Server, self.server).hub

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keeps test output clean

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        authorization = self.headers.get("Authorization")
        self.hub._record_authorization(authorization)
        if cdn := _CDN.match(path):
            # Reached by redirect with a "signed" URL: no token needed, as on a CDN.
            self._serve_file(cdn.group(1).replace("--", "/"), cdn.group(2))
            return
        if self.hub.token is not None and authorization != f"Bearer {self.hub.token}":
            self._error(401, "", "Invalid credentials")
            return
        if tree := _TREE.match(path):
            cursor = int(parse_qs(url.query).get("cursor", ["0"])[0])
            self._serve_tree(tree.group(1), tree.group(2), cursor)
        elif resolve := _RESOLVE.match(path):
            repo, revision, file = resolve.groups()
            if revision != REVISION:
                self._error(404, "RevisionNotFound", "Revision not found")
            elif _is_lfs(file) and repo in self.hub.repos:
                self.send_response(302)
                self.send_header("Location", f"/cdn/{repo.replace('/', '--')}/{quote(file)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._serve_file(repo, file)
        else:
            self._error(404, "", "Not found")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _serve_tree(self, repo_id: str, revision: str, cursor: int) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return
        if revision != REVISION:
            self._error(404, "RevisionNotFound", "Revision not found")
            return
        page, more = self.hub._tree(repo, cursor)
        body = json.dumps(page).encode()
        self.send_response(200)
        if more:
            next_url = f"{self.hub.url}/api/models/{repo_id}/tree/{revision}?recursive=true&cursor={cursor + len(page)}"
            self.send_header("Link", f'<{next_url}>; rel="next"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _serve_file(self, repo_id: str, file: str) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return
        target = repo / file
        if ".." in Path(file).parts or not target.is_file():
            self._error(404, "EntryNotFound", "Entry not found")
            return
        data = target.read_bytes()
        cut, failure, corrupt, ignore_range = self.hub._take_faults(file)
        requested = _RANGE.match(self.headers.get("Range", ""))
        offset = int(requested.group(1)) if requested else 0
        if failure is not None:
            self.hub._record(FileRequest(file, offset, failure))
            self._error(failure, "", "Injected failure")
            return
        if offset >= len(data) > 0:
            self.hub._record(FileRequest(file, offset, 416))
            self._error(416, "", "Range not satisfiable")
            return
        status = 206 if requested and not ignore_range else 200
        body = data[offset:] if status == 206 else data
        if corrupt:
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
        self.hub._record(FileRequest(file, offset, status))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {offset}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        limit = len(body) if cut is None else min(cut, len(body))
        hold = self.hub._take_hold(file)
        try:
            for start in range(0, limit, _CHUNK):
                chunk = body[start : min(start + _CHUNK, limit)]
                self.wfile.write(chunk)
                self.hub._count(file, len(chunk))
                if hold is not None and start + len(chunk) >= hold[0]:
                    self.wfile.flush()
                    hold[1].wait(60)
                    hold = None
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return  # the client went away: its retry is a new request
        if cut is not None:
            self.close_connection = True  # short of Content-Length: the client sees a cut
