"""The Hugging Face hub as a file source, over its HTTP protocol: the tree API
lists a repo's files with their hashes, `resolve` serves them (with Range)."""

import os
import re
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from exo.models.file_source import (
    DownloadError,
    FileSource,
    RemoteFile,
    SourceUnavailable,
    TransientError,
)
from exo.shared.types.ids import ModelId

DEFAULT_ENDPOINT = "https://huggingface.co"
_REVISION = "main"  # the branch files are read from
# Bounds every connect and every read: a stalled transfer is retried, not awaited.
_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_MAX_PAGES = 10_000  # of a tree listing; the hub pages by 1000 entries
_CONTENT_RANGE = re.compile(r"bytes (\d+)-")
# The hub answers 401, not 404, for a repo that does not exist (or is private)
# when the request carries no token; this header tells them apart from a refusal.
_NOT_FOUND_CODES = {"RepoNotFound", "RevisionNotFound", "EntryNotFound"}


class _Lfs(BaseModel):
    oid: str  # sha256 of the content
    size: int


class _TreeEntry(BaseModel):
    type: str
    path: str
    size: int = 0
    oid: str | None = None  # git blob sha1 (of the LFS pointer, for an LFS file)
    lfs: _Lfs | None = None


_TREE = TypeAdapter(list[_TreeEntry])


class HubSource(FileSource):
    """Repo id = model id (`org/name`). `endpoint` defaults to `HF_ENDPOINT`, else
    huggingface.co; `token` to `HF_TOKEN` (needed for gated and private repos)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        self.name = "hub"
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = token or os.environ.get("HF_TOKEN") or None

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        # httpx drops the Authorization header on a redirect to another host
        # (the hub sends large files to a CDN with a signed URL).
        return httpx.AsyncClient(headers=headers, timeout=_TIMEOUT, follow_redirects=True)

    def _check(self, response: httpx.Response, model_id: ModelId, what: str) -> None:
        status = response.status_code
        if status < 300:
            return
        code = response.headers.get("x-error-code", "")
        detail = response.headers.get("x-error-message", "")
        detail = f" ({detail})" if detail else ""
        if status == 404 or code in _NOT_FOUND_CODES:
            hint = "" if self.token else "; if the repo is private, set HF_TOKEN"
            raise SourceUnavailable(f"{what} not found on {self.endpoint}{hint}")
        if status in (401, 403):
            fix = (
                "HF_TOKEN's token has no access to it"
                if self.token
                else "set HF_TOKEN to a token with access"
            )
            raise DownloadError(
                f"{self.endpoint} refused access to {model_id} (HTTP {status}{detail}): "
                f"the repo is gated or private; {fix}"
            )
        if status >= 500 or status == 429:
            raise TransientError(f"HTTP {status} from {self.endpoint}{detail}")
        raise DownloadError(f"HTTP {status} from {self.endpoint} for {what}{detail}")

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        url = httpx.URL(f"{self.endpoint}/api/models/{model_id}/tree/{_REVISION}")
        params: dict[str, str] | None = {"recursive": "true"}
        files: list[RemoteFile] = []
        try:
            async with self._client() as client:
                for _ in range(_MAX_PAGES):
                    response = await client.get(url, params=params)
                    self._check(response, model_id, model_id)
                    entries = _parse_tree(response, model_id)
                    files.extend(_remote_file(e) for e in entries if e.type == "file")
                    next_page = response.links.get("next", {}).get("url")
                    if next_page is None:
                        return files
                    url, params = response.url.join(next_page), None
        except httpx.TransportError as error:
            raise TransientError(hub_unreachable(self.endpoint, error)) from error
        except httpx.RequestError as error:
            raise DownloadError(f"{self.endpoint}: {error!r}") from error
        raise DownloadError(f"{model_id}: the listing has more than {_MAX_PAGES} pages")

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        url = f"{self.endpoint}/{model_id}/resolve/{_REVISION}/{quote(path)}"
        # identity: the bytes counted and resumed from are the file's own.
        headers = {"Accept-Encoding": "identity"}
        if offset > 0:
            headers["Range"] = f"bytes={offset}-"
        try:
            async with (
                self._client() as client,
                client.stream("GET", url, headers=headers) as response,
            ):
                self._check(response, model_id, f"{model_id}/{path}")
                skip = _bytes_to_skip(response, offset)
                async for chunk in response.aiter_bytes():
                    if skip >= len(chunk):
                        skip -= len(chunk)
                        continue
                    yield chunk[skip:]
                    skip = 0
        except httpx.TransportError as error:
            raise TransientError(hub_unreachable(self.endpoint, error)) from error
        except httpx.RequestError as error:
            raise DownloadError(f"{self.endpoint}: {error!r}") from error


# What to do when the hub cannot be reached: a model can come without it.
OFFLINE_ADVICE = (
    "to serve a model without the hub, copy its folder (config.json, the .safetensors "
    "files, the tokenizer files) into a node's models directory (--models-dir), or set "
    "HF_ENDPOINT to a hub mirror this node can reach"
)


def _transport_reason(error: httpx.TransportError) -> str:
    """`error` in a user's words: "[Errno -2] Name or service not known" is a
    name that does not resolve, i.e. most often no internet."""
    text = str(error)
    if isinstance(error, httpx.ConnectError) and (
        "Errno -2" in text
        or "Errno -3" in text
        or "Errno 8" in text
        or "not known" in text
        or "resolution" in text
    ):
        return "its name does not resolve: is this machine offline?"
    if isinstance(error, httpx.ConnectError):
        return f"the connection failed{': ' + text if text else ''}"
    if isinstance(error, httpx.TimeoutException):
        return "it did not answer in time"
    return text or type(error).__name__


def hub_unreachable(endpoint: str, error: httpx.TransportError) -> str:
    """The message of a hub that cannot be reached, with what to do offline."""
    return f"cannot reach the Hugging Face hub at {endpoint} ({_transport_reason(error)}); {OFFLINE_ADVICE}"


def _parse_tree(response: httpx.Response, model_id: ModelId) -> list[_TreeEntry]:
    try:
        return _TREE.validate_json(response.content)
    except ValidationError as error:
        raise DownloadError(f"{model_id}: malformed file listing from the hub: {error}") from error


def _remote_file(entry: _TreeEntry) -> RemoteFile:
    if entry.lfs is not None:
        # The entry's oid is the sha1 of the LFS pointer, not of the content.
        return RemoteFile(path=entry.path, size=entry.lfs.size, sha256=entry.lfs.oid)
    return RemoteFile(path=entry.path, size=entry.size, git_sha1=entry.oid)


def _bytes_to_skip(response: httpx.Response, offset: int) -> int:
    """Bytes at the start of the body before `offset`: a server may ignore Range
    and send the whole file (200)."""
    if response.status_code == 200:
        return offset
    if offset == 0:
        return 0
    match = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
    if response.status_code != 206 or match is None or int(match.group(1)) != offset:
        raise TransientError(
            f"asked for bytes from {offset}, got HTTP {response.status_code} "
            f"{response.headers.get('content-range', 'without Content-Range')}"
        )
    return 0


def hub_enabled() -> bool:
    """The hub is a source unless `HF_HUB_OFFLINE` says otherwise (as in huggingface_hub)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes")
