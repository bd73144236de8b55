"""The header of a safetensors file: each tensor's dtype, shape and data size,
read without the tensor data (8-byte little-endian length, then JSON)."""

import json
import struct
from pathlib import Path

from exo.shared.types.frozen import FrozenModel

# A header this large is not a safetensors header.
_MAX_HEADER_BYTES = 100_000_000

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


class SafetensorsHeaderError(ValueError):
    """A file whose safetensors header cannot be read."""


class TensorInfo(FrozenModel):
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and data sizes of a safetensors file."""
    try:
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise SafetensorsHeaderError(f"{path.name}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES:
                raise SafetensorsHeaderError(
                    f"{path.name}: header of {length} bytes is not plausible"
                )
            raw = fh.read(length)
    except OSError as error:
        raise SafetensorsHeaderError(f"cannot read {path.name}: {error}") from error
    try:
        header = json.loads(raw)
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            tensors[name] = TensorInfo(
                dtype=entry["dtype"], shape=tuple(entry["shape"]), nbytes=stop - begin
            )
    except (ValueError, KeyError, TypeError) as error:
        raise SafetensorsHeaderError(
            f"{path.name}: malformed safetensors header: {error}"
        ) from error
    return tensors
