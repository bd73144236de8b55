"""Download progress of one model's files on one node, as the state shows it."""

from typing import Literal

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId

DownloadStatus = Literal["downloading", "complete", "failed", "cancelled"]


class DownloadProgress(FrozenModel):
    model_id: ModelId
    status: DownloadStatus
    files_total: int  # files this node needs for its shard
    files_done: int
    bytes_total: int
    bytes_done: int
    speed_bytes_per_s: float = 0.0
    eta_seconds: float | None = None  # None: unknown (no speed yet) or done
    source: str | None = None  # where the bytes come from now: "local", "peer <node>", "hub"
    error: str | None = None  # why it failed
    # Relative paths of the files complete on this node (placement reads them).
    have_files: tuple[str, ...] = ()
