"""A small tmpfs the test mounts, to fill a disk for real (Linux, as root: CI;
elsewhere the test is skipped with the reason)."""

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "2m") at `mount_point`, unmounted afterwards."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"a tmpfs is mounted on Linux only (this is {sys.platform})")
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def resize(mount_point: Path, size: str) -> None:
    """Give the tmpfs at `mount_point` another size (space comes back)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """Take every free byte of `directory`'s disk with one file; returns it."""
    filler = directory / "filler"
    block = b"\0" * 4096
    with filler.open("wb", buffering=0) as fh:
        try:
            while fh.write(block):
                pass
        except OSError:
            pass  # full
    return filler
