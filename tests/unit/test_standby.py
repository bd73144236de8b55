"""A runner process started ahead: what makes it a runner, and how it is told apart."""

import json
import subprocess
import sys
from pathlib import Path

from exo.shared.types.shard import LayerRange
from exo.worker.runner.runner_main import runner_command
from exo.worker.runner.standby import (
    RUNNER_PROCESS_NAME,
    Assignment,
    assignment,
    is_runner_process,
    standby_command,
)


def test_an_assignment_carries_the_runner_s_arguments_and_ring_environment() -> None:
    command = runner_command(Path("/models/m"), 1000, LayerRange(start=0, end=2, total=4))
    env = {"MLX_HOSTFILE": "/cache/ring-x.json", "MLX_RANK": "0"}
    line = assignment(command, env)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    given = Assignment.model_validate(json.loads(line))
    assert [sys.executable, "-m", "exo.worker.runner.runner_main", *given.argv] == command
    assert given.env == env


def test_a_tensor_rank_s_command_says_so_with_every_layer() -> None:
    command = runner_command(Path("/models/m"), 0, LayerRange(start=0, end=4, total=4), tensor=True)
    assert command[3:] == [
        "--model-dir", "/models/m", "--prefix-cache-bytes", "0",
        "--start-layer", "0", "--end-layer", "4", "--total-layers", "4", "--tensor",
    ]  # fmt: skip
    pipeline = runner_command(Path("/models/m"), 0, LayerRange(start=0, end=2, total=4))
    assert "--tensor" not in pipeline
    given = Assignment.model_validate(json.loads(assignment(command, {})))
    assert given.argv[-1] == "--tensor"


def test_the_runner_takes_the_tensor_flag() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "exo.worker.runner.runner_main", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "--tensor this rank holds a slice of every layer; needs MLX_HOSTFILE and MLX_RANK" in (
        " ".join(shown.split())
    )


def test_a_standby_counts_as_a_runner_once_assigned() -> None:
    runner = runner_command(Path("/models/m"), 0, None)
    assert is_runner_process(runner, "python")
    assert not is_runner_process(standby_command(), "python")  # waiting
    assert is_runner_process(standby_command(), RUNNER_PROCESS_NAME)  # assigned
    assert not is_runner_process([sys.executable, "-m", "exo.main"], RUNNER_PROCESS_NAME)
