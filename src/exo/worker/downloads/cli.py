"""`exo download MODEL`: a hub download into the models directory with a
progress bar on the terminal."""

import sys
from pathlib import Path

from loguru import logger

from exo.models.file_source import DownloadError
from exo.models.store import model_dir
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.ids import ModelId
from exo.shared.units import human_bytes
from exo.worker.downloads.hub import HubSource
from exo.worker.downloads.transfer import download_files

BAR_WIDTH = 30


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_line(progress: DownloadProgress) -> str:
    """One line: bar, percent, bytes, speed, ETA, files."""
    total = max(progress.bytes_total, 1)
    fraction = min(1.0, progress.bytes_done / total)
    filled = round(fraction * BAR_WIDTH)
    eta = (
        f" ETA {_duration(progress.eta_seconds)}"
        if progress.eta_seconds is not None and progress.status == "downloading"
        else ""
    )
    return (
        f"{progress.model_id} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:6.1%} "
        f"{human_bytes(progress.bytes_done)}/{human_bytes(progress.bytes_total)} "
        f"{human_bytes(int(progress.speed_bytes_per_s))}/s{eta} "
        f"({progress.files_done}/{progress.files_total} files)"
    )


async def download_with_progress_bar(model_id: ModelId, models_dir: Path) -> int:
    """Download every file of the repo; returns the process exit code."""
    dest = model_dir(models_dir, model_id)
    hub = HubSource()
    tty = sys.stderr.isatty()

    def show(progress: DownloadProgress) -> None:
        line = progress_line(progress)
        sys.stderr.write(f"\r{line}\033[K" if tty else f"{line}\n")
        sys.stderr.flush()

    logger.info(f"downloading {model_id} from {hub.endpoint} into {dest}")
    try:
        await download_files([hub], model_id, None, dest, show)
    except DownloadError as error:
        sys.stderr.write("\n" if tty else "")
        logger.error(str(error))
        return 1
    sys.stderr.write("\n" if tty else "")
    logger.info(
        f"done: serve it with 'exo --model {model_id} --models-dir {models_dir}' "
        "or place it across the cluster"
    )
    return 0
