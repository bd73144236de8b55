import os
import shutil
from pathlib import Path

import psutil

from exo.worker.telemetry import read_telemetry


def test_telemetry_reads_this_machine(tmp_path: Path) -> None:
    models = tmp_path / "models"
    telemetry = read_telemetry(models)
    assert models.is_dir()
    assert telemetry.ram_total == psutil.virtual_memory().total
    assert 0 < telemetry.ram_available <= telemetry.ram_total
    assert abs(telemetry.disk_free - shutil.disk_usage(models).free) < 1 << 30
    assert telemetry.cpu_count == os.cpu_count()
    assert telemetry.mlx_backend in ("metal", "cuda", "cpu")
    assert telemetry.platform.split("-")[0] in ("linux", "darwin")
