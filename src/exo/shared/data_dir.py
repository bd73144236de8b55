"""A node's data dir: one process owns it (a lock held for the node's life), and
its small state files are replaced atomically (a crash leaves the old or the
new content, never a torn file)."""

import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Self

LOCK_FILE_NAME = "lock"


class DataDirInUse(RuntimeError):
    """Another process holds the data dir."""


def fsync_dir(directory: Path) -> None:
    """Make the entries of `directory` (a create, a rename) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(f"{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class DataDirLock:
    """An exclusive `flock` on `DATA_DIR/lock`, released when the process ends
    (even by SIGKILL), so a stale lock file never blocks a restart."""

    def __init__(self, path: Path, fd: int) -> None:
        self._path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> Self:
        """Lock `data_dir` for this process; raises `DataDirInUse` (naming the
        holder's pid) when another process has it."""
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"another exo node (pid {holder}) uses {data_dir}; stop it or choose "
                "another --data-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The pid is only for the message above; the lock is the flock itself.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
