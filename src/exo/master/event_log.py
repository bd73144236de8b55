"""The master's append-only, fsynced, crash-safe on-disk event log.

A record is an opaque payload (the caller's JSON bytes); its index `idx` is its
position in the file: 0, 1, 2, ... with no gaps.

On-disk format: records back to back, each a 10-byte little-endian header and
then the payload::

    offset  size  field
    0       1     magic   0xE5
    1       1     version 0x01
    2       4     length  payload length in bytes (uint32)
    6       4     crc     CRC-32 (zlib) of the payload (uint32)
    10      len   payload

Crash safety: a batch is written with one write, then fsynced, so a crash can
leave only the tail of the file torn (a short header, a short payload, or a
payload whose CRC does not match). `EventLog.open` drops such a tail with a
warning. A bad record with a valid record anywhere after it cannot be a torn
write, so it raises `EventLogCorrupted` instead of silently dropping history.
A record with the magic byte but another version raises too: it was written by
a different exo, and truncating it would destroy that history.
"""

import os
import struct
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from loguru import logger

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


class EventLog:
    """An append-only log of opaque byte records, indexed by position.

    Single writer; reads (even from a `read_from` iterator already running)
    see every record appended by the same object.
    """

    def __init__(self, path: Path, fd: int, bounds: "array[int]") -> None:
        self._path = path
        self._fd: int | None = fd
        # bounds[k] is where record k starts; bounds[-1] is the end of the last record.
        self._bounds = bounds

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
            # Make the new file's directory entry durable, not just its data.
            os.fsync(fd)
            _fsync_dir(path.parent)
        try:
            bounds = _scan(path, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, bounds)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def next_idx(self) -> int:
        """The number of records, i.e. the idx the next appended record gets."""
        return len(self._bounds) - 1

    def append(self, payloads: Sequence[bytes]) -> int:
        """Append `payloads` durably (one write, then fsync); return the first one's idx."""
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
        try:
            _pwrite_all(fd, b"".join(parts), start)
            os.fsync(fd)
        except BaseException:
            # Leave no half-written batch behind for the next append to follow.
            try:
                os.ftruncate(fd, start)
            except OSError as error:
                logger.error(f"event log {self._path}: could not undo a failed append: {error}")
            raise
        self._bounds.extend(ends)
        return first_idx

    def read_from(self, from_idx: int) -> Iterator[tuple[int, bytes]]:
        """Yield `(idx, payload)` from `from_idx` on, including records appended meanwhile.

        A `from_idx` at or past `next_idx` yields nothing.
        """
        if from_idx < 0:
            raise ValueError(f"from_idx must be >= 0, got {from_idx}")
        self._open_fd()
        return self._records_from(from_idx)

    def close(self) -> None:
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
        # Re-check next_idx each round so records appended while iterating are seen.
        while idx < self.next_idx:
            fd = self._open_fd()
            start = self._bounds[idx]
            # Take every whole record that fits in one chunk, and at least one.
            stop = max(idx + 1, bisect_right(self._bounds, start + _READ_CHUNK, idx + 1) - 1)
            chunk = _pread_all(fd, self._bounds[stop] - start, start)
            for k in range(idx, stop):
                at = self._bounds[k] - start
                _, _, length, crc = _HEADER.unpack_from(chunk, at)
                payload = chunk[at + _HEADER.size : at + _HEADER.size + length]
                if zlib.crc32(payload) != crc:
                    raise EventLogCorrupted(
                        self._path, self._bounds[k], k, "CRC mismatch on replay (changed on disk)"
                    )
                yield k, payload
            idx = stop

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"event log {self._path} is closed")
        return self._fd


def _scan(path: Path, fd: int) -> "array[int]":
    """Validate every record; truncate a torn tail; return the record boundaries."""
    bounds = array("Q", [0])
    size = os.fstat(fd).st_size
    with open(fd, "rb", closefd=False) as file:
        offset = 0
        while offset < size:
            idx = len(bounds) - 1
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
        _fsync_dir(new.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
