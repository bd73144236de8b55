from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.node_process import NodeProcess, running_node


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[NodeProcess]:
    """One `exo` process serving the built-in model, shared by every module that
    does not start a node of its own (a start costs ~25 s of the suite's time):
    tests leave it serving as they found it, and assert on changes, not totals."""
    with running_node(
        tmp_path_factory.mktemp("node"), models_dir, "--sse-keepalive-seconds", "0.3"
    ) as started:
        yield started
