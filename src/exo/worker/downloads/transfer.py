"""Resumable, verified download of a model's files from an ordered list of sources.

A file is written to `<name>.partial`, resumed from there after an interruption
(also by a later call), checked against the listed size and hash, then renamed
into place atomically: a file under its final name is always complete.
"""

import errno
import hashlib
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from pathlib import Path, PurePosixPath

import anyio
import anyio.to_thread
from loguru import logger

from exo.models.file_source import (
    DownloadError,
    FileSource,
    RemoteFile,
    SourceUnavailable,
    TransientError,
)
from exo.models.local_store import PARTIAL_SUFFIX
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.ids import ModelId
from exo.worker.downloads.disk_space import DiskSpace, Reservation

ATTEMPTS = 4  # per source and file
RETRY_DELAY_SECONDS = 0.5  # doubles after every failed attempt
# Longest wait for a listing, or for the next chunk of a file.
LIST_TIMEOUT_SECONDS = 60.0
CHUNK_TIMEOUT_SECONDS = 60.0
CLOSE_TIMEOUT_SECONDS = 5.0
SPEED_WINDOW_SECONDS = 5.0
_SAMPLE_SECONDS = 0.1  # one speed sample per this long keeps the window short
# What `fetch_file` returns for a file that was already complete here.
ALREADY_HERE = "local"
_HASH_BLOCK = 1 << 20


class _VerificationFailed(Exception):
    pass


def local_path(dest_dir: Path, path: str) -> Path:
    """Where a listed file goes; refuses paths that would leave `dest_dir` (a
    listing comes from another machine)."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or any(p in ("..", ".") for p in parts):
        raise DownloadError(f"refusing file path {path!r}: not a plain relative path")
    return dest_dir.joinpath(*parts)


def _partial_path(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def is_complete(dest_dir: Path, remote: RemoteFile) -> bool:
    """A file under its final name was verified before its rename: its size is
    all that needs checking."""
    final = local_path(dest_dir, remote.path)
    return final.is_file() and final.stat().st_size == remote.size


def present_bytes(dest_dir: Path, remote: RemoteFile) -> int:
    """Bytes of `remote` already here: all of them for a complete file, else
    those of a usable partial."""
    if is_complete(dest_dir, remote):
        return remote.size
    partial = _partial_path(local_path(dest_dir, remote.path))
    size = partial.stat().st_size if partial.is_file() else 0
    return size if size <= remote.size else 0


class _Digest:
    """The listed hash of a file, computed over its bytes as they are written
    (a resumed partial's bytes first), so verifying needs no second read."""

    def __init__(self, remote: RemoteFile) -> None:
        self.expected: str | None
        self._hash: hashlib._Hash | None
        if remote.sha256 is not None:
            self._hash, self.expected = hashlib.sha256(), remote.sha256.lower()
        elif remote.git_sha1 is not None:
            self._hash, self.expected = hashlib.sha1(usedforsecurity=False), remote.git_sha1.lower()
            self._hash.update(b"blob %d\0" % remote.size)
        else:
            self._hash = self.expected = None  # no hash listed: the size check is all there is

    def update(self, data: bytes) -> None:
        if self._hash is not None:
            self._hash.update(data)

    def update_from(self, path: Path) -> None:
        if self._hash is not None:
            with path.open("rb") as fh:
                while block := fh.read(_HASH_BLOCK):
                    self._hash.update(block)

    def mismatch(self) -> str | None:
        """None if the bytes have the listed hash, else the hash they have."""
        if self._hash is None:
            return None
        found = self._hash.hexdigest()
        return None if found == self.expected else found


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(partial: Path, final: Path, digest: _Digest) -> None:
    """Verify the complete partial and rename it into place (blocking)."""
    found = digest.mismatch()
    if found is not None:
        raise _VerificationFailed(f"hash mismatch: got {found}")
    _fsync(partial)
    os.replace(partial, final)
    _fsync(final.parent)  # the rename itself survives a crash


async def _close(stream: AsyncIterator[bytes]) -> None:
    """Let the source release its connection, also when the caller cancelled."""
    if isinstance(stream, AsyncGenerator):
        with anyio.move_on_after(CLOSE_TIMEOUT_SECONDS, shield=True):
            await stream.aclose()


async def _transfer(
    source: FileSource,
    model_id: ModelId,
    remote: RemoteFile,
    final: Path,
    on_bytes: Callable[[int], None],
    chunk_timeout: float,
) -> None:
    """One attempt: append to the partial from its end, then verify and rename."""
    partial = _partial_path(final)
    offset = partial.stat().st_size if partial.is_file() else 0
    if offset > remote.size:
        partial.unlink()  # not counted as present (`present_bytes`)
        offset = 0
    partial.touch()  # an empty file is read from no source
    digest = _Digest(remote)
    if offset:
        await anyio.to_thread.run_sync(digest.update_from, partial)
    written = offset
    if offset < remote.size:
        stream = source.read(model_id, remote.path, offset)
        try:
            with partial.open("ab") as fh:
                while True:
                    try:
                        with anyio.fail_after(chunk_timeout):
                            chunk = await anext(stream, None)
                    except TimeoutError as error:
                        raise TransientError(f"no data for {chunk_timeout:.0f} s") from error
                    if chunk is None:
                        break
                    fh.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    on_bytes(len(chunk))
                    if written > remote.size:
                        raise _VerificationFailed(f"more than the listed {remote.size} bytes")
        finally:
            await _close(stream)
    if written < remote.size:
        raise TransientError(f"the transfer ended after {written} of {remote.size} bytes")
    await anyio.to_thread.run_sync(_finish, partial, final, digest)


async def fetch_file(
    sources: Sequence[FileSource],
    model_id: ModelId,
    remote: RemoteFile,
    dest_dir: Path,
    on_bytes: Callable[[int], None],
    *,
    on_source: Callable[[str], None] = lambda name: None,
    attempts: int = ATTEMPTS,
    retry_delay: float = RETRY_DELAY_SECONDS,
    chunk_timeout: float = CHUNK_TIMEOUT_SECONDS,
) -> str:
    """Download one file into `dest_dir`, trying `sources` in order; returns the
    name of the source that delivered it (`ALREADY_HERE` if it was here).

    `on_bytes(n)`: n bytes were written; a partial discarded after a failed
    verification reports minus its size. `on_source(name)`: a transfer from
    `name` starts. Cancelling keeps the partial for a later call to resume.
    """
    if is_complete(dest_dir, remote):
        return ALREADY_HERE
    final = local_path(dest_dir, remote.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_path(final)
    reasons: list[str] = []
    for source in sources:
        on_source(source.name)
        for attempt in range(1, attempts + 1):
            try:
                await _transfer(source, model_id, remote, final, on_bytes, chunk_timeout)
            except (SourceUnavailable, DownloadError) as error:
                reasons.append(f"{source.name}: {error}")
                break
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                # Another source would fill the same disk: stop here (the partial is kept).
                raise DownloadError(
                    f"the disk is full: cannot write {remote.path} of {model_id} in {dest_dir}"
                ) from error
            except TransientError as error:
                reason = f"{source.name}: {error}"
            except _VerificationFailed as error:
                reason = f"{source.name}: {error}"
                if partial.is_file():
                    on_bytes(-partial.stat().st_size)
                    partial.unlink()
            else:
                logger.info(f"{model_id}: {remote.path} from {source.name}")
                return source.name
            if attempt == attempts:
                reasons.append(f"{reason} (after {attempts} attempts)")
            else:
                delay = retry_delay * 2 ** (attempt - 1)
                logger.warning(f"{model_id}: {remote.path}: {reason}; retrying in {delay:.1f} s")
                await anyio.sleep(delay)
    tried = "; ".join(reasons) or "no sources"
    raise DownloadError(f"cannot download {remote.path} of {model_id}: {tried}")


async def files_to_fetch(
    sources: Sequence[FileSource],
    model_id: ModelId,
    wanted: Collection[str] | None,
    *,
    attempts: int = ATTEMPTS,
    retry_delay: float = RETRY_DELAY_SECONDS,
    list_timeout: float = LIST_TIMEOUT_SECONDS,
) -> list[RemoteFile]:
    """The files to fetch, sorted by path: all files of the first source that has
    the model, or the `wanted` ones, asking further sources for those it lacks
    (a peer may hold only its shard's files)."""
    found: dict[str, RemoteFile] = {}
    reasons: list[str] = []
    for source in sources:
        listing = await _list_one(source, model_id, reasons, attempts, retry_delay, list_timeout)
        if listing is None:
            continue
        for remote in listing:
            found.setdefault(remote.path, remote)
        if wanted is None or set(wanted) <= found.keys():
            break
    if not found:
        tried = "; ".join(reasons) or "no sources"
        raise DownloadError(f"{model_id} not found: {tried}")
    if wanted is None:
        return sorted(found.values(), key=lambda f: f.path)
    missing = sorted(set(wanted) - found.keys())
    if missing:
        raise DownloadError(f"{model_id}: no source has {', '.join(missing)}")
    return [found[path] for path in sorted(set(wanted))]


async def _list_one(
    source: FileSource,
    model_id: ModelId,
    reasons: list[str],
    attempts: int,
    retry_delay: float,
    list_timeout: float,
) -> list[RemoteFile] | None:
    """One source's listing, retrying transient failures; None (and a reason) if
    it has none to give."""
    for attempt in range(1, attempts + 1):
        try:
            with anyio.fail_after(list_timeout):
                return await source.list_files(model_id)
        except (SourceUnavailable, DownloadError) as error:
            reasons.append(f"{source.name}: {error}")
            return None
        except (TransientError, TimeoutError) as error:
            reason = f"{source.name}: {str(error) or 'listing timed out'}"
        if attempt == attempts:
            reasons.append(f"{reason} (after {attempts} attempts)")
        else:
            logger.warning(f"{model_id}: listing failed: {reason}; retrying")
            await anyio.sleep(retry_delay * 2 ** (attempt - 1))
    return None


class _Progress:
    """Counts bytes and files and reports them, at most once per `throttle_seconds`."""

    def __init__(
        self,
        model_id: ModelId,
        files: Sequence[RemoteFile],
        present: dict[str, int],
        have: set[str],
        on_progress: Callable[[DownloadProgress], None],
        throttle_seconds: float,
    ) -> None:
        self.model_id = model_id
        self.files_total = len(files)
        self.bytes_total = sum(f.size for f in files)
        self.bytes_done = sum(present.values())
        self.have = have
        self.source: str | None = None
        self.on_progress = on_progress
        self.throttle_seconds = throttle_seconds
        self.last_report = -float("inf")
        self.received = 0
        # (time, bytes received so far): the speed is measured over the window.
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def add(self, n: int) -> None:
        self.bytes_done += n
        now = time.monotonic()
        if n > 0:
            self.received += n
            if len(self.samples) > 1 and now - self.samples[-2][0] < _SAMPLE_SECONDS:
                self.samples[-1] = (now, self.received)
            else:
                self.samples.append((now, self.received))
            while len(self.samples) > 2 and self.samples[1][0] < now - SPEED_WINDOW_SECONDS:
                self.samples.popleft()
        if now - self.last_report >= self.throttle_seconds:
            self.report()

    def speed(self) -> float:
        (start, start_bytes), (end, end_bytes) = self.samples[0], self.samples[-1]
        return (end_bytes - start_bytes) / (end - start) if end > start else 0.0

    def report(self, complete: bool = False) -> None:
        self.last_report = time.monotonic()
        speed = self.speed()
        remaining = self.bytes_total - self.bytes_done
        self.on_progress(
            DownloadProgress(
                model_id=self.model_id,
                status="complete" if complete else "downloading",
                files_total=self.files_total,
                files_done=len(self.have),
                bytes_total=self.bytes_total,
                bytes_done=self.bytes_done,
                speed_bytes_per_s=speed,
                eta_seconds=remaining / speed if speed > 0 and not complete else None,
                source=self.source,
                have_files=tuple(sorted(self.have)),
            )
        )


async def download_files(
    sources: Sequence[FileSource],
    model_id: ModelId,
    wanted: Collection[str] | None,
    dest_dir: Path,
    on_progress: Callable[[DownloadProgress], None],
    throttle_seconds: float = 0.5,
    *,
    disk: DiskSpace | None = None,
    attempts: int = ATTEMPTS,
    retry_delay: float = RETRY_DELAY_SECONDS,
) -> None:
    """Download `wanted` files of `model_id` (None: all) into `dest_dir`, one by
    one, reporting progress; raises `DownloadError` when it cannot. Files already
    here are kept, partial ones resumed. The space it needs is reserved in
    `disk` first (the node's downloads share one; None: the default floor only)."""
    files = await files_to_fetch(
        sources, model_id, wanted, attempts=attempts, retry_delay=retry_delay
    )
    dest_dir.mkdir(parents=True, exist_ok=True)
    present = {f.path: present_bytes(dest_dir, f) for f in files}
    needed = sum(f.size for f in files) - sum(present.values())
    with (disk or DiskSpace()).reserve(dest_dir, needed) as reservation:
        await _download_all(
            sources,
            model_id,
            files,
            dest_dir,
            present,
            on_progress,
            throttle_seconds,
            reservation,
            attempts=attempts,
            retry_delay=retry_delay,
        )


async def _download_all(
    sources: Sequence[FileSource],
    model_id: ModelId,
    files: Sequence[RemoteFile],
    dest_dir: Path,
    present: dict[str, int],
    on_progress: Callable[[DownloadProgress], None],
    throttle_seconds: float,
    reservation: Reservation,
    *,
    attempts: int,
    retry_delay: float,
) -> None:
    have = {f.path for f in files if is_complete(dest_dir, f)}
    progress = _Progress(model_id, files, present, have, on_progress, throttle_seconds)
    progress.report()

    def on_bytes(n: int) -> None:
        progress.add(n)
        reservation.consume(n)

    def on_source(name: str) -> None:
        progress.source = name

    for remote in files:
        if remote.path in progress.have:
            continue
        await fetch_file(
            sources,
            model_id,
            remote,
            dest_dir,
            on_bytes,
            on_source=on_source,
            attempts=attempts,
            retry_delay=retry_delay,
        )
        progress.have.add(remote.path)
    progress.report(complete=True)
    logger.info(f"{model_id}: {len(files)} files complete in {dest_dir}")
