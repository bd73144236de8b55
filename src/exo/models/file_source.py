"""Where a model's files come from: the interface every source implements and
the errors that tell the downloader what to do next."""

from collections.abc import AsyncIterator
from typing import Protocol

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId


class RemoteFile(FrozenModel):
    """One file of a model as a source lists it."""

    path: str  # relative to the model folder, '/'-separated
    size: int
    sha256: str | None = None
    # The git blob sha1 the hub reports for non-LFS files:
    # sha1(b"blob <size>\0" + content).
    git_sha1: str | None = None


class DownloadError(Exception):
    """A download cannot succeed; the message says what to do (shown to the user)."""


class SourceUnavailable(Exception):
    """This source does not have the model or file, or cannot be reached; the
    caller tries the next source."""


class TransientError(Exception):
    """A failure that may pass (connection dropped, timeout, server error); the
    caller retries the same source, resuming from what it already has."""


class FileSource(Protocol):
    """A place a model's files can be read from.

    Besides `SourceUnavailable` and `TransientError`, a source raises
    `DownloadError` for a refusal that retrying cannot fix (e.g. no access)."""

    name: str  # shown to users: "hub", "peer node-x"

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]: ...

    def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        """The file's bytes from `offset` on (an async generator)."""
        ...
