"""What a node reports about itself: memory, disk, CPUs, platform, MLX backend."""

import os
import platform
import shutil
from pathlib import Path

import psutil

from exo.engine.mlx.load import backend_name
from exo.shared.types.state import NodeTelemetry


def read_telemetry(models_dir: Path, accepts_instances: bool = True) -> NodeTelemetry:
    memory = psutil.virtual_memory()
    models_dir.mkdir(parents=True, exist_ok=True)
    return NodeTelemetry(
        ram_total=memory.total,
        ram_available=memory.available,
        disk_free=shutil.disk_usage(models_dir).free,
        cpu_count=os.cpu_count() or 1,
        platform=f"{platform.system().lower()}-{platform.machine()}",
        mlx_backend=backend_name(),
        accepts_instances=accepts_instances,
    )
