from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.node_process import NodeProcess, running_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[NodeProcess]:
    """One `exo` process serving the built-in model, shared by a test module."""
    with running_node(
        tmp_path_factory.mktemp("node"), models_dir, "--sse-keepalive-seconds", "0.3"
    ) as started:
        yield started
