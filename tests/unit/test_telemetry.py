import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from loguru import logger

from exo.engine.mlx.backend import backend_name
from exo.shared.types.state import NodeTelemetry
from exo.worker.telemetry import mlx_backend, read_telemetry, telemetry_changed


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    mlx_backend.cache_clear()
    yield
    mlx_backend.cache_clear()


def test_telemetry_reads_this_machine(tmp_path: Path, fresh_probe: None) -> None:
    models = tmp_path / "models"
    telemetry = read_telemetry(models)
    assert models.is_dir()
    assert telemetry.ram_total == psutil.virtual_memory().total
    assert 0 < telemetry.ram_available <= telemetry.ram_total
    assert abs(telemetry.disk_free - shutil.disk_usage(models).free) < 1 << 30
    assert telemetry.cpu_count == os.cpu_count()
    # The child process finds the backend this process's MLX reports.
    assert telemetry.mlx_backend == backend_name()
    assert telemetry.platform.split("-")[0] in ("linux", "darwin")


def test_a_broken_mlx_install_reports_cpu_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_probe: None
) -> None:
    broken = tmp_path / "broken" / "mlx"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libmlx.so: cannot open shared object')")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        assert read_telemetry(tmp_path / "models").mlx_backend == "cpu"
    finally:
        logger.remove(sink)
    [warning] = warnings
    assert "MLX cannot be imported" in warning
    assert "libmlx.so: cannot open shared object" in warning


GIB = 1 << 30
REPORTED = NodeTelemetry(
    ram_total=32 * GIB, ram_available=16 * GIB, disk_free=100 * GIB, cpu_count=8,
    platform="linux-x86_64", mlx_backend="cpu",
)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "material"),
    [
        ({}, False),
        ({"ram_available": 16 * GIB + GIB}, False),  # 1 GiB of 32: under 5 %
        ({"ram_available": 16 * GIB - 2 * GIB}, True),  # 2 GiB of 32: over 5 %
        ({"disk_free": 97 * GIB}, False),  # 3 % of the free disk
        ({"disk_free": 90 * GIB}, True),  # 10 %
        ({"cpu_count": 4}, True),
        ({"accepts_instances": False}, True),
        ({"event_log_error": "cannot write the event log: disk full"}, True),
    ],
)
def test_only_a_material_change_is_reported(change: dict[str, object], material: bool) -> None:
    assert telemetry_changed(REPORTED, REPORTED.model_copy(update=change)) is material


def test_a_nearly_full_disk_is_reported_in_smaller_steps() -> None:
    """The threshold follows the free space: near full, 100 MiB matters."""
    low = REPORTED.model_copy(update={"disk_free": GIB})
    assert telemetry_changed(low, low.model_copy(update={"disk_free": GIB - (100 << 20)}))
    assert not telemetry_changed(low, low.model_copy(update={"disk_free": GIB - (10 << 20)}))


def test_telemetry_the_cluster_does_not_hold_yet_is_reported() -> None:
    assert telemetry_changed(None, REPORTED)
