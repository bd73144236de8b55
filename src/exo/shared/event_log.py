"""A node's append-only, crash-safe on-disk event log (every node keeps one;
the master appends what it indexes, followers what they ingest).

A record is an opaque payload (the caller's JSON bytes); its index `idx` is the
file's base index plus its position: base, base + 1, ... with no gaps. The base
is 0 until the log is compacted (`rewrite_from`): the records before a snapshot
are dropped and the file starts later.

On-disk format: a 16-byte file header, then records back to back::

    file header: offset 0 magic b"EXOLOG", 6 version uint16 (2), 8 base uint64
    record:      offset 0 magic 0xE5, 1 version 0x01, 2 length uint32,
                 6 crc uint32 (CRC-32 of the payload), 10 payload

(little-endian). A file that starts with a record (no file header) is an older
log whose base is 0.

Durability: `write` puts records in the file (visible to `read_from` at once)
and `sync` makes every record written so far durable (one fsync, safe to run in
another thread while `write` goes on); `append` does both. A failed write is
undone; a failed sync rewrites the records it did not make durable, so the next
sync tries them again.

Crash safety: a crash can leave only the tail of the file torn (a short header,
a short payload, or a payload whose CRC does not match). `EventLog.open` drops
such a tail with a warning. A bad record with a valid record anywhere after it
cannot be a torn write, so it raises `EventLogCorrupted` instead of silently
dropping history. A record with the magic byte but another version raises too:
it was written by a different exo, and truncating it would destroy that history.
A compaction writes the new file aside and renames it over the old one.
"""

import os
import struct
import threading
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from loguru import logger

from exo.shared.data_dir import fsync_dir

_FILE_MAGIC = b"EXOLOG"
_FILE_VERSION = 2
_FILE_HEADER = struct.Struct("<6sHQ")
_MAGIC = 0xE5
_VERSION = 1
_HEADER = struct.Struct("<BBII")
_RECORD_PREFIX = bytes((_MAGIC, _VERSION))
_MAX_PAYLOAD = 0xFFFF_FFFF
# Replay reads whole runs of records with one pread of about this many bytes.
_READ_CHUNK = 1 << 20


class EventLogCorrupted(Exception):
    """The log holds a bad record that is not a torn tail; it needs a human."""

    def __init__(self, path: Path, offset: int, idx: int, detail: str) -> None:
        super().__init__(f"{path}: record {idx} at byte offset {offset}: {detail}")
        self.path = path
        self.offset = offset
        self.idx = idx


class LogCompacted(Exception):
    """The records asked for were compacted away: they are in a snapshot."""

    def __init__(self, path: Path, from_idx: int, base_idx: int) -> None:
        super().__init__(f"{path}: records before {base_idx} were compacted (asked {from_idx})")
        self.base_idx = base_idx


class EventLog:
    """An append-only log of opaque byte records, indexed from a base.

    Single writer; reads (even from a `read_from` iterator already running)
    see every record written by the same object. `sync` may run in a thread.
    """

    def __init__(self, path: Path, fd: int, base_idx: int, bounds: "array[int]") -> None:
        self._path = path
        self._fd: int | None = fd
        self._base_idx = base_idx
        # bounds[k] is where record base + k starts; bounds[-1] is the end of the last record.
        self._bounds = bounds
        # Records [base + _synced, next_idx) are written but not yet fsynced.
        # _unsynced holds each write not yet fsynced: (offset, record count
        # after it, bytes), to write the bytes again after a failed fsync. Only
        # the owner's thread writes; `sync` (any thread) takes the writes listed
        # when it starts, all of them complete on disk.
        self._synced = len(bounds) - 1
        self._unsynced: list[tuple[int, int, bytes]] = []
        # Held around fsync and around replacing or closing the file.
        self._fd_lock = threading.Lock()

    @classmethod
    def open(cls, path: Path | str) -> Self:
        """Open (or create) the log at `path`, dropping a torn tail left by a crash."""
        path = Path(path)
        _make_dirs(path.parent)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
        else:
            _pwrite_all(fd, _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, 0), 0)
            # Make the new file's directory entry durable, not just its data.
            os.fsync(fd)
            fsync_dir(path.parent)
        try:
            base_idx, data_start = _read_file_header(path, fd)
            bounds = _scan(path, fd, base_idx, data_start)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, base_idx, bounds)

    @classmethod
    def create_empty(cls, path: Path, base_idx: int) -> Self:
        """Replace whatever is at `path` with an empty log whose next record is `base_idx`."""
        _make_dirs(path.parent)
        _write_aside_and_rename(path, base_idx, [])
        return cls.open(path)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def base_idx(self) -> int:
        """The idx of the first record the file holds."""
        return self._base_idx

    @property
    def next_idx(self) -> int:
        """The idx the next appended record gets."""
        return self._base_idx + len(self._bounds) - 1

    @property
    def synced_idx(self) -> int:
        """Records before this idx are durable."""
        return self._base_idx + self._synced

    def append(self, payloads: Sequence[bytes]) -> int:
        """Append `payloads` durably (one write, then fsync); return the first one's idx."""
        first_idx = self.write(payloads)
        self.sync()
        return first_idx

    def write(self, payloads: Sequence[bytes]) -> int:
        """Write `payloads` with one write, not yet durable; return the first one's idx.
        On an error (a full disk) nothing is written and the error is raised."""
        fd = self._open_fd()
        first_idx = self.next_idx
        if not payloads:
            return first_idx
        parts: list[bytes] = []
        ends: list[int] = []
        end = self._bounds[-1]
        for payload in payloads:
            if len(payload) > _MAX_PAYLOAD:
                raise ValueError(f"payload of {len(payload)} bytes exceeds the 4 GiB record limit")
            parts.append(_HEADER.pack(_MAGIC, _VERSION, len(payload), zlib.crc32(payload)))
            parts.append(payload)
            end += _HEADER.size + len(payload)
            ends.append(end)
        start = self._bounds[-1]
        data = b"".join(parts)
        try:
            _pwrite_all(fd, data, start)
        except BaseException:
            # Leave no half-written batch behind for the next write to follow.
            _truncate(self._path, fd, start)
            raise
        self._bounds.extend(ends)
        self._unsynced.append((start, len(self._bounds) - 1, data))
        return first_idx

    def sync(self) -> int:
        """Make every record written so far durable; return `synced_idx`. Raises
        the fsync's error after writing the records again for the next try."""
        with self._fd_lock:
            fd = self._open_fd()
            writes = self._unsynced[:]
            if not writes:
                return self.synced_idx
            try:
                os.fsync(fd)
            except OSError:
                # After a failed fsync the kernel may have dropped the dirty
                # pages: write the same bytes again, so the next fsync covers them.
                try:
                    for offset, _, data in writes:
                        _pwrite_all(fd, data, offset)
                except OSError as error:
                    logger.error(f"event log {self._path}: could not rewrite records: {error}")
                raise
            self._synced = writes[-1][1]
            del self._unsynced[: len(writes)]
            return self.synced_idx

    def read_from(self, from_idx: int) -> Iterator[tuple[int, bytes]]:
        """Yield `(idx, payload)` from `from_idx` on, including records written meanwhile.

        A `from_idx` at or past `next_idx` yields nothing; one before `base_idx`
        raises `LogCompacted`.
        """
        if from_idx < 0:
            raise ValueError(f"from_idx must be >= 0, got {from_idx}")
        if from_idx < self._base_idx:
            raise LogCompacted(self._path, from_idx, self._base_idx)
        self._open_fd()
        return self._records_from(from_idx)

    def rewrite_from(self, from_idx: int) -> None:
        """Compact: keep only the records from `from_idx` on (all of them durable
        first). The new file is written aside and renamed over this one, so a
        crash leaves either file whole."""
        self.sync()
        from_idx = min(max(from_idx, self._base_idx), self.next_idx)
        records = [payload for _, payload in self.read_from(from_idx)]
        with self._fd_lock:
            _write_aside_and_rename(self._path, from_idx, records)
            fd = os.open(self._path, os.O_RDWR)
            old, self._fd = self._fd, fd
            if old is not None:
                os.close(old)
            self._base_idx = from_idx
            self._bounds = _scan(self._path, fd, from_idx, _FILE_HEADER.size)
            self._synced = len(self._bounds) - 1
            self._unsynced = []

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _records_from(self, idx: int) -> Iterator[tuple[int, bytes]]:
        # Re-read the bounds each round: records written meanwhile are seen, and
        # a compaction meanwhile moves the records (or drops the ones still wanted).
        while idx < self.next_idx:
            if idx < self._base_idx:
                raise LogCompacted(self._path, idx, self._base_idx)
            fd, bounds, base = self._open_fd(), self._bounds, self._base_idx
            k = idx - base
            start = bounds[k]
            # Take every whole record that fits in one chunk, and at least one.
            stop = max(k + 1, bisect_right(bounds, start + _READ_CHUNK, k + 1) - 1)
            chunk = _pread_all(fd, bounds[stop] - start, start)
            for j in range(k, stop):
                at = bounds[j] - start
                _, _, length, crc = _HEADER.unpack_from(chunk, at)
                payload = chunk[at + _HEADER.size : at + _HEADER.size + length]
                if zlib.crc32(payload) != crc:
                    raise EventLogCorrupted(
                        self._path, bounds[j], base + j, "CRC mismatch on replay (changed on disk)"
                    )
                yield base + j, payload
            idx = base + stop

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"event log {self._path} is closed")
        return self._fd


def _read_file_header(path: Path, fd: int) -> tuple[int, int]:
    """The log's base idx and where its records start."""
    head = _pread_some(fd, _FILE_HEADER.size, 0)
    if head[:1] == bytes((_MAGIC,)):
        return 0, 0  # an older log, without a file header
    empty_header = _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, 0)
    if len(head) < _FILE_HEADER.size:
        if empty_header.startswith(head) and os.fstat(fd).st_size == len(head):
            # A new log torn while its header was written (compacted logs are renamed whole).
            _pwrite_all(fd, empty_header, 0)
            os.fsync(fd)
            return 0, _FILE_HEADER.size
        raise EventLogCorrupted(path, 0, 0, "bad file header")
    magic, version, base_idx = _FILE_HEADER.unpack(head)
    if magic != _FILE_MAGIC:
        raise EventLogCorrupted(path, 0, 0, "bad file header")
    if version != _FILE_VERSION:
        raise EventLogCorrupted(path, 0, 0, f"unsupported file format version {version}")
    return base_idx, _FILE_HEADER.size


def _write_aside_and_rename(path: Path, base_idx: int, records: Sequence[bytes]) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    parts = [_FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, base_idx)]
    for payload in records:
        parts.append(_HEADER.pack(_MAGIC, _VERSION, len(payload), zlib.crc32(payload)))
        parts.append(payload)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, b"".join(parts), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _truncate(path: Path, fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError as error:
        logger.error(f"event log {path}: could not undo a failed write: {error}")


def _scan(path: Path, fd: int, base_idx: int, data_start: int) -> "array[int]":
    """Validate every record; truncate a torn tail; return the record boundaries."""
    bounds = array("Q", [data_start])
    size = os.fstat(fd).st_size
    with open(fd, "rb", closefd=False) as file:
        file.seek(data_start)
        offset = data_start
        while offset < size:
            idx = base_idx + len(bounds) - 1
            header = file.read(_HEADER.size)
            problem = _header_problem(path, header, offset, idx, size)
            if problem is None:
                _, _, length, crc = _HEADER.unpack(header)
                if zlib.crc32(file.read(length)) == crc:
                    offset += _HEADER.size + length
                    bounds.append(offset)
                    continue
                problem = "CRC mismatch"
            _drop_torn_tail(path, fd, offset, idx, size, problem)
            break
    return bounds


def _header_problem(path: Path, header: bytes, offset: int, idx: int, size: int) -> str | None:
    """Why the record whose header is `header` is torn or bad, or None if it may be valid."""
    if len(header) < _HEADER.size:
        return "short header"
    magic, version, length, _ = _HEADER.unpack(header)
    if magic != _MAGIC:
        return "bad magic byte"
    if version != _VERSION:
        # Not a torn write: another exo wrote it, and dropping it would lose history.
        raise EventLogCorrupted(path, offset, idx, f"unsupported format version {version}")
    # Checked before reading so a garbled length never makes us allocate it.
    if offset + _HEADER.size + length > size:
        return "short payload"
    return None


def _drop_torn_tail(path: Path, fd: int, offset: int, idx: int, size: int, problem: str) -> None:
    """Truncate the bad record at `offset`, unless valid data follows it (then raise)."""
    tail = _pread_all(fd, size - offset, offset)
    following = _find_valid_record(tail, start=1)
    if following is not None:
        raise EventLogCorrupted(
            path,
            offset,
            idx,
            f"{problem}, yet a valid record follows at byte offset {offset + following}; "
            "refusing to drop it",
        )
    logger.warning(
        f"event log {path}: dropping a torn last record (idx {idx}) at byte offset {offset}: "
        f"{problem}; truncating {size - offset} bytes"
    )
    os.ftruncate(fd, offset)
    os.fsync(fd)


def _find_valid_record(data: bytes, start: int) -> int | None:
    """The first position at or after `start` where a whole valid record begins, if any."""
    at = data.find(_RECORD_PREFIX, start)
    while at != -1:
        if at + _HEADER.size <= len(data):
            _, _, length, crc = _HEADER.unpack_from(data, at)
            end = at + _HEADER.size + length
            if end <= len(data) and zlib.crc32(data[at + _HEADER.size : end]) == crc:
                return at
        at = data.find(_RECORD_PREFIX, at + 1)
    return None


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while size > 0:
        part = os.pread(fd, size, offset)
        if not part:
            raise EOFError(f"unexpected end of file at byte offset {offset}")
        parts.append(part)
        size -= len(part)
        offset += len(part)
    return b"".join(parts)


def _pread_some(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes at `offset` (fewer at the end of the file)."""
    parts: list[bytes] = []
    while size > 0:
        part = os.pread(fd, size, offset)
        if not part:
            break
        parts.append(part)
        size -= len(part)
        offset += len(part)
    return b"".join(parts)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _make_dirs(directory: Path) -> None:
    """Create `directory` and missing parents, fsyncing each new entry's parent."""
    missing: list[Path] = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)
        fsync_dir(new.parent)
