"""A runner process started ahead of need, so that a rank placed on this node
(after a node's death, typically) does not wait for a process to start and import
MLX, mlx_lm and transformers: seconds on a busy machine.

`python -m exo.worker.runner.standby` imports what a runner needs, then waits
for one line on stdin: its assignment, the runner's command-line arguments and
the environment variables of its rank (`assignment`). From there on it is that
runner (`runner_main.main`), reading the rest of stdin as usual. The end of
stdin before an assignment ends it.

While it waits it runs at a lower CPU priority (`STANDBY_NICE`), so that its
imports never slow the runners and requests of the moment; its assignment puts
every thread of it back to the node's priority at once, mid-import if need be.
Only where it may raise its priority back (root, or a large enough
`RLIMIT_NICE`); elsewhere it imports at the normal priority.

Once assigned, its process name is `RUNNER_PROCESS_NAME` (Linux), so that it can
be told from a waiting standby: `is_runner_process`.
"""

import ctypes
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

from pydantic import BaseModel

# What a runner imports: the heavy part of its start (mlx_lm and transformers).
_PRELOAD = (
    "exo.worker.runner.runner_main",
    "exo.engine.mlx.load",
    "exo.engine.mlx.shard",
    "exo.engine.mlx.ring",
    "exo.engine.mlx.generate",
    "exo.engine.mlx.pipeline",
    "exo.engine.mlx.prefix_cache",
    "exo.engine.mlx.prefix_cache_disk",
    "exo.worker.runner.whole_model",
    "exo.worker.runner.split_rank",
    "exo.engine.mlx.few_rows_kernel",  # numba: Linux only, so last
)


# How much lower the priority of a waiting standby is (nice value added).
STANDBY_NICE = 10
RUNNER_PROCESS_NAME = "exo-runner"
_PR_SET_NAME = 15


class Assignment(BaseModel):
    argv: list[str]
    env: dict[str, str]


def is_runner_process(cmdline: Sequence[str], name: str) -> bool:
    """Whether a process (its command line and name) is a runner: one started as
    such, or a standby that was assigned."""
    command = " ".join(cmdline)
    return "exo.worker.runner.runner_main" in command or (
        "exo.worker.runner.standby" in command and name == RUNNER_PROCESS_NAME
    )


def _name_process(name: str) -> None:
    """What `ps -o comm` and `psutil.Process.name()` show for this process (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)


def standby_command() -> list[str]:
    return [sys.executable, "-m", "exo.worker.runner.standby"]


def assignment(runner_command: Sequence[str], env: Mapping[str, str]) -> bytes:
    """The line that makes a standby process the runner `runner_command` starts
    (`runner_main.runner_command`), with `env` added to its environment."""
    argv = list(runner_command[3:])  # after `python -m exo.worker.runner.runner_main`
    return (Assignment(argv=argv, env=dict(env)).model_dump_json() + "\n").encode()


def _preload() -> None:
    import importlib

    for module in _PRELOAD:
        try:
            importlib.import_module(module)
        except Exception:  # a broken install: the runner reports it once assigned
            return


def _may_restore_priority(nice: int) -> bool:
    """Whether this process may set its priority back to `nice` after lowering it."""
    if os.geteuid() == 0:
        return True
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)  # Linux: 20 - the lowest nice
    except (ImportError, AttributeError, OSError):
        return False
    return soft == resource.RLIM_INFINITY or soft >= 20 - nice


def _set_priority(nice: int) -> None:
    """`nice` for every thread of this process (a Linux thread has its own)."""
    tasks = Path("/proc/self/task")
    ids = [int(task.name) for task in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread_id in ids:
        with suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, thread_id, nice)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node stops us via stdin
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = _may_restore_priority(nice)
    if lowered:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, nice + STANDBY_NICE))
    lines: list[str] = []
    assigned = threading.Event()

    def wait_for_assignment() -> None:
        lines.append(sys.stdin.readline())
        if lowered:
            _set_priority(nice)
        assigned.set()

    threading.Thread(target=wait_for_assignment, name="standby", daemon=True).start()
    _preload()
    if not assigned.is_set():
        print(f"standby runner process {os.getpid()} ready", file=sys.stderr, flush=True)
    assigned.wait()
    if lowered:
        _set_priority(nice)  # threads started by the imports meanwhile
    line = lines[0]
    if not line.strip():
        return  # never needed
    given = Assignment.model_validate(json.loads(line))
    _name_process(RUNNER_PROCESS_NAME)
    os.environ.update(given.env)
    sys.argv = [sys.argv[0], *given.argv]
    from exo.worker.runner.runner_main import main as runner_main

    runner_main()


if __name__ == "__main__":
    main()
