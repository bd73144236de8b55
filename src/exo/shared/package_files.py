"""Find files shipped inside installed distributions, without importing them."""

from collections.abc import Callable
from importlib import metadata
from pathlib import Path


def find_package_file(distribution: str, matches: Callable[[str], bool]) -> Path | None:
    """The first file of `distribution` whose name `matches`, or None (also when
    the distribution is not installed)."""
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if matches(f.name):
            return Path(str(f.locate())).resolve()
    return None
