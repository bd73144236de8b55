"""A snapshot of the cluster state at an index: what a compacted log starts from.

On disk (next to the event log, `events.snapshot`): an 8-byte magic, the
CRC-32 of the body (uint32, little-endian), then the body, the `State` as JSON
(its `last_idx` is the snapshot's index). It is replaced atomically, so a crash
leaves the previous snapshot or the new one; a bad CRC is damage, not a crash.
On the wire the body alone travels (`IndexedEventEnvelope.snapshot`).
"""

import struct
import zlib
from pathlib import Path

from exo.shared.data_dir import atomic_write_bytes
from exo.shared.types.state import State

_MAGIC = b"EXOSNAP1"
_CRC = struct.Struct("<I")


class SnapshotCorrupted(Exception):
    """The snapshot file is damaged; it needs a human."""


def snapshot_path(log_path: Path) -> Path:
    """Where the snapshot of the log at `log_path` lives."""
    return log_path.with_suffix(".snapshot")


def encode_state(state: State) -> bytes:
    return state.model_dump_json().encode()


def decode_state(body: bytes) -> State:
    return State.model_validate_json(body)


def write_snapshot(path: Path, state: State) -> None:
    body = encode_state(state)
    atomic_write_bytes(path, _MAGIC + _CRC.pack(zlib.crc32(body)) + body)


def read_snapshot(path: Path) -> State | None:
    """The snapshot at `path`, None when there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(_MAGIC) + _CRC.size
    if data[: len(_MAGIC)] != _MAGIC or len(data) < head:
        raise SnapshotCorrupted(f"{path}: not an exo state snapshot")
    (crc,) = _CRC.unpack_from(data, len(_MAGIC))
    body = data[head:]
    if zlib.crc32(body) != crc:
        raise SnapshotCorrupted(f"{path}: CRC mismatch")
    return decode_state(body)
