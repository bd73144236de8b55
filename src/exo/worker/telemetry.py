"""What a node reports about itself: memory, disk, CPUs, platform, MLX backend,
and whether it can write its event log; reported again only when it changed
materially (`telemetry_changed`).

The node process never imports MLX: runners import it, so a broken MLX install
shows as a failed runner rather than a node that cannot start. The backend is
asked once of a child Python instead."""

import functools
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
from loguru import logger
from pydantic import TypeAdapter, ValidationError

from exo.shared.types.state import MlxBackend, NodeTelemetry

BACKEND_PROBE = "from exo.engine.mlx.backend import backend_name; print(backend_name())"
BACKEND_PROBE_TIMEOUT_SECONDS = 60.0
# What a node whose MLX cannot be imported reports: its runners will fail, and
# the CPU's float32 weights make the largest memory estimate for placement.
FALLBACK_BACKEND: MlxBackend = "cpu"
# Smaller moves of free memory (a fraction of the node's RAM) or free disk (a
# fraction of the last reported free space, at least the minimum) are not reported.
RAM_CHANGE_FRACTION = 0.05
DISK_CHANGE_FRACTION = 0.05
DISK_CHANGE_MIN_BYTES = 64 << 20


@functools.cache
def mlx_backend() -> MlxBackend:
    """Where MLX runs on this machine, as a child process finds it (once)."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", BACKEND_PROBE],
            capture_output=True,
            text=True,
            timeout=BACKEND_PROBE_TIMEOUT_SECONDS,
            check=True,
        )
        return TypeAdapter(MlxBackend).validate_python(probe.stdout.strip())
    except subprocess.CalledProcessError as error:
        reason = error.stderr.strip().splitlines()[-1:] or [f"exit status {error.returncode}"]
        logger.warning(f"MLX cannot be imported ({reason[0]}); reporting {FALLBACK_BACKEND}")
    except (subprocess.TimeoutExpired, ValidationError) as error:
        logger.warning(f"cannot tell the MLX backend ({error}); reporting {FALLBACK_BACKEND}")
    return FALLBACK_BACKEND


def read_telemetry(
    models_dir: Path, accepts_instances: bool = True, event_log_error: str | None = None
) -> NodeTelemetry:
    memory = psutil.virtual_memory()
    models_dir.mkdir(parents=True, exist_ok=True)
    return NodeTelemetry(
        ram_total=memory.total,
        ram_available=memory.available,
        disk_free=shutil.disk_usage(models_dir).free,
        cpu_count=os.cpu_count() or 1,
        platform=f"{platform.system().lower()}-{platform.machine()}",
        mlx_backend=mlx_backend(),
        accepts_instances=accepts_instances,
        event_log_error=event_log_error,
    )


def telemetry_changed(reported: NodeTelemetry | None, current: NodeTelemetry) -> bool:
    """Whether `current` differs from what the cluster holds (`reported`) enough
    to be worth an event: memory or free disk moved by more than the thresholds,
    or any other fact changed. Liveness comes from the link's heartbeats, so an
    idle node writes nothing to the log."""
    if reported is None:
        return True
    ram_moved = abs(current.ram_available - reported.ram_available)
    disk_moved = abs(current.disk_free - reported.disk_free)
    return (
        ram_moved > RAM_CHANGE_FRACTION * current.ram_total
        or disk_moved > max(DISK_CHANGE_MIN_BYTES, DISK_CHANGE_FRACTION * reported.disk_free)
        or current.model_copy(
            update={"ram_available": reported.ram_available, "disk_free": reported.disk_free}
        )
        != reported
    )
