"""Runner processes for pipeline tests: real `runner_main` processes on a loopback
`mx.distributed` ring, driven over their JSON-lines protocol (as the supervisor
does, but synchronously, with every wait bounded)."""

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.ids import TaskId
from exo.shared.types.shard import LayerRange
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.blas import runner_environment
from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    FromRunner,
    Generate,
    Shutdown,
    StatusChanged,
    TaskFailed,
    TaskFinished,
    TaskText,
    ToRunner,
    from_runner_adapter,
)
from exo.worker.runner.runner_main import runner_command

REPO_ROOT = Path(__file__).resolve().parent.parent
# OpenBLAS worker threads spin ~2^28 cycles (~0.1 s) after each call before they
# sleep. A pipeline rank waits for its neighbour right after computing, and on a
# machine shared by the ranks that spinning takes the cores the neighbour computes
# on (2-rank decode at ~0.5x of 1 rank on 2 cores); 2^22 cycles (~1.5 ms) still
# spans the gaps between one step's calls. Set for every runner, single ones too
# (None: OpenBLAS's default).
OPENBLAS_THREAD_TIMEOUT: str | None = "22"


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_hostfile(directory: Path, ranks: int) -> Path:
    path = directory / f"hosts-{ranks}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]))
    return path


def even_bounds(layers: int, ranks: int) -> list[int]:
    """[0, ..., layers]: rank r holds [bounds[r], bounds[r+1])."""
    return [layers * r // ranks for r in range(ranks + 1)]


def rank_environment(work_dir: Path, hostfile: Path | None, rank: int) -> dict[str, str]:
    env = runner_environment(work_dir / "cache")
    if OPENBLAS_THREAD_TIMEOUT is None:
        env.pop("OPENBLAS_THREAD_TIMEOUT", None)  # the runner environment sets one
    else:
        env["OPENBLAS_THREAD_TIMEOUT"] = OPENBLAS_THREAD_TIMEOUT
    env.pop("MLX_HOSTFILE", None)
    env.pop("MLX_RANK", None)
    if hostfile is not None:
        env |= {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass
class TaskResult:
    text: str = ""
    finished: TaskFinished | None = None
    failed: TaskFailed | None = None
    messages: list[FromRunner] = field(default_factory=list)
    text_times: list[float] = field(default_factory=list[float])  # monotonic, as read


class RunnerProcess:
    """One runner process; its protocol messages are collected by a reader thread."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=REPO_ROOT,
        )
        self.messages: queue.Queue[FromRunner] = queue.Queue()
        self.received: list[FromRunner] = []  # every message, as read
        self.statuses: list[StatusChanged] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.strip():
                message = from_runner_adapter.validate_json(line)
                self.received.append(message)
                if isinstance(message, StatusChanged):
                    self.statuses.append(message)
                self.messages.put(message)

    def send(self, message: ToRunner) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((message.model_dump_json() + "\n").encode())
        self.process.stdin.flush()

    def next_message(self, deadline: float) -> FromRunner:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no message from the runner in time; log: {self.log_path}")
        try:
            return self.messages.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(
                f"no message from the runner in time; log: {self.log_path}"
            ) from None

    def wait_status(self, status: str, timeout: float) -> StatusChanged:
        deadline = time.monotonic() + timeout
        while True:
            message = self.next_message(deadline)
            if isinstance(message, StatusChanged):
                if message.status == status:
                    return message
                if message.status == "failed":
                    raise AssertionError(f"runner failed: {message.error}; log: {self.log_path}")

    def wait_for(self, matches: Callable[[FromRunner], bool], timeout: float) -> FromRunner:
        """The next message that `matches` (the ones before it are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next_message(deadline)
            if matches(message):
                return message

    def submit(self, task_id: str, tokens: Sequence[int], params: GenerationParams) -> None:
        self.send(Generate(task_id=TaskId(task_id), tokens=list(tokens), params=params))

    def collect(self, task_id: str, timeout: float) -> TaskResult:
        """Messages of `task_id` until it finishes or fails (others are skipped)."""
        return self.collect_all([task_id], timeout)[0]

    def collect_all(self, task_ids: Sequence[str], timeout: float) -> list[TaskResult]:
        """Messages of every task in `task_ids` until each finishes or fails, in
        the order of `task_ids` (others are skipped)."""
        results = {task_id: TaskResult() for task_id in task_ids}
        deadline = time.monotonic() + timeout
        while any(r.finished is None and r.failed is None for r in results.values()):
            message = self.next_message(deadline)
            result = results.get(str(getattr(message, "task_id", "")))
            if result is None:
                continue
            result.messages.append(message)
            if isinstance(message, TaskText):
                result.text += message.text
                if message.text:
                    result.text_times.append(time.monotonic())
            elif isinstance(message, TaskFinished):
                result.finished = message
            elif isinstance(message, TaskFailed):
                result.failed = message
        return [results[task_id] for task_id in task_ids]

    def latest_cache_stats(self) -> CacheStats:
        reports = [m for m in self.received if isinstance(m, CacheStatsReport)]
        assert reports, f"no cache stats reported; log: {self.log_path}"
        return reports[-1].stats

    def generate(
        self, task_id: str, tokens: Sequence[int], params: GenerationParams, timeout: float = 120
    ) -> tuple[str, Usage]:
        self.submit(task_id, tokens, params)
        result = self.collect(task_id, timeout)
        assert result.finished is not None, f"task failed: {result.failed}; log: {self.log_path}"
        return result.text, result.finished.usage

    def cancel(self, task_id: str) -> None:
        self.send(Cancel(task_id=TaskId(task_id)))

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Bounded cleanup: Shutdown, then kill."""
        if self.process.poll() is None:
            try:
                self.send(Shutdown())
                self.process.stdin.close()  # pyright: ignore[reportOptionalMemberAccess]
            except OSError:
                pass
            if self.wait_exit(10) is None:
                self.process.send_signal(signal.SIGKILL)
                self.process.wait(10)
        self._log.close()


def start_runner(
    model_dir: Path,
    work_dir: Path,
    prefix_cache_bytes: int,
    hostfile: Path | None = None,
    rank: int = 0,
    layers: LayerRange | None = None,
    prefix_cache_dir: Path | None = None,
    prefix_cache_disk_bytes: int = 0,
    tensor: bool = False,
) -> RunnerProcess:
    command = runner_command(
        model_dir, prefix_cache_bytes, layers, prefix_cache_dir, prefix_cache_disk_bytes, tensor
    )
    name = f"runner-{rank}-of-{hostfile.stem if hostfile else 'single'}.log"
    return RunnerProcess(command, rank_environment(work_dir, hostfile, rank), work_dir / name)


@dataclass
class Pipeline:
    ranks: list[RunnerProcess]

    @property
    def entry(self) -> RunnerProcess:
        return self.ranks[0]


@contextmanager
def running_pipeline(
    model_dir: Path,
    work_dir: Path,
    bounds: Sequence[int],
    prefix_cache_bytes: int = 1 << 30,
    ready_timeout: float = 120,
    prefix_cache_dir: Path | None = None,
    prefix_cache_disk_bytes: int = 1 << 30,
    tensor_ranks: int = 0,
) -> Iterator[Pipeline]:
    """len(bounds) - 1 ranks (one runner, no ring, for a single range), all ready;
    with `tensor_ranks`, that many tensor ranks instead, each holding a slice of
    all `bounds[-1]` layers. With `prefix_cache_dir`, their prefix caches keep a
    disk tier there."""
    count = tensor_ranks or len(bounds) - 1
    hostfile = write_hostfile(work_dir, count) if count > 1 else None
    total = bounds[-1]
    runners = [
        start_runner(
            model_dir,
            work_dir,
            prefix_cache_bytes,
            hostfile,
            rank,
            (
                LayerRange(start=0, end=total, total=total)
                if tensor_ranks
                else LayerRange(start=bounds[rank], end=bounds[rank + 1], total=total)
            )
            if hostfile
            else None,
            prefix_cache_dir,
            prefix_cache_disk_bytes,
            tensor=bool(tensor_ranks),
        )
        for rank in range(count)
    ]
    try:
        for runner in runners:
            runner.wait_status("ready", ready_timeout)
        yield Pipeline(runners)
    finally:
        for runner in runners:
            runner.stop()
