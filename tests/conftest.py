import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from tests import OPENBLAS_IN_PROCESS
from tests.model_factory import make_tiny_llama
from tests.serial import SerialLock, worker_lock

# Tests never reach the real Hugging Face hub (nodes they start inherit this);
# the hub tests point HF_ENDPOINT at a local fake hub and unset it.
os.environ["HF_HUB_OFFLINE"] = "1"
# The suite runs on two workers (pyproject's addopts) on as many cores. OpenMP
# threads that spin while they wait for work (the CPU decode kernel's, in the
# test process and in the runners started here, which inherit this) would
# then take turns with the other worker's: several times slower each. Set here,
# not in the `tests` package, which benchmarks import and must not slow.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_serial_lock = pytest.StashKey[SerialLock | None]()


def pytest_report_header() -> str | None:
    if not sys.platform.startswith("linux"):  # MLX uses Accelerate or Metal there
        return None
    if OPENBLAS_IN_PROCESS:
        return "in-process MLX: OpenBLAS"
    return "in-process MLX: reference BLAS (~8x slower; install libgfortran5 for OpenBLAS)"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory holding the imported built-in model (imported once per run)."""
    path = tmp_path_factory.mktemp("models")
    ensure_default_model(path)
    return path


@pytest.fixture(scope="session")
def smollm_dir(models_dir: Path) -> Path:
    return model_dir(models_dir, DEFAULT_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm_dir)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_serial_lock] = worker_lock(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long tests first, so that the run does not wait on one at its end (each
    xdist worker collects the same order)."""
    items.sort(key=lambda item: item.get_closest_marker("runs_first") is None)


def pytest_unconfigure(config: pytest.Config) -> None:
    lock = config.stash.get(_serial_lock, None)
    if lock is not None:
        lock.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    lock = item.config.stash.get(_serial_lock, None)
    if lock is None:
        yield
        return
    lock.before(item)
    try:
        yield
    finally:
        lock.after(nextitem)
