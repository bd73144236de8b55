from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster_process import Cluster


@pytest.fixture
def cluster(tmp_path: Path, models_dir: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path, models_dir)
    try:
        yield started
    finally:
        started.stop()
