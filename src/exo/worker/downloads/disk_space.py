"""Disk space for downloads: a floor kept free for the system, and reservations
so that downloads running together never count the same free bytes twice.

A download reserves what it still needs before its first byte; the reservation
shrinks as bytes land (they leave the free space at the same time) and ends
with the download. A download that does not fit beside the floor and the
others' reservations is refused at once with the figures.
"""

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from exo.models.file_source import DownloadError
from exo.shared.units import human_bytes

# The default floor: this much, or this fraction of the disk when that is more.
MIN_FREE_BYTES = 1 << 30
MIN_FREE_FRACTION = 0.05


class DiskUsage(NamedTuple):
    total: int
    free: int


def disk_usage(path: Path) -> DiskUsage:
    usage = shutil.disk_usage(path)
    return DiskUsage(usage.total, usage.free)


def default_floor(total: int) -> int:
    """What downloads leave free on a disk of `total` bytes by default."""
    return max(MIN_FREE_BYTES, int(total * MIN_FREE_FRACTION))


class Reservation:
    """Bytes a running download may still write; `consume` as they land."""

    def __init__(self, nbytes: int) -> None:
        self.remaining = nbytes

    def consume(self, nbytes: int) -> None:
        self.remaining = max(0, self.remaining - nbytes)


@dataclass
class DiskSpace:
    """The downloads of one node: `min_free_bytes` (None: `default_floor`) stays
    free on every disk they write to."""

    min_free_bytes: int | None = None
    usage: Callable[[Path], DiskUsage] = disk_usage
    # Running downloads' reservations, by device.
    _reserved: dict[int, list[Reservation]] = field(default_factory=dict)

    def floor(self, total: int) -> int:
        return default_floor(total) if self.min_free_bytes is None else self.min_free_bytes

    @contextmanager
    def reserve(self, directory: Path, nbytes: int) -> Iterator[Reservation]:
        """Reserve `nbytes` in `directory` for a download; raises `DownloadError`
        (saying what is free, kept free and reserved) when they do not fit."""
        device = os.stat(directory).st_dev
        usage = self.usage(directory)
        floor = self.floor(usage.total)
        others = sum(r.remaining for r in self._reserved.get(device, []))
        available = usage.free - floor - others
        if nbytes > 0 and nbytes > available:
            reserved = f", {human_bytes(others)} reserved by other downloads" if others else ""
            raise DownloadError(
                f"needs {human_bytes(nbytes)} more, {human_bytes(usage.free)} free in "
                f"{directory} of which {human_bytes(floor)} stays free{reserved}"
            )
        reservation = Reservation(nbytes)
        self._reserved.setdefault(device, []).append(reservation)
        try:
            yield reservation
        finally:
            self._reserved[device].remove(reservation)
