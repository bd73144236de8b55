"""Runs one runner process and routes its messages to the requests waiting on them.

The runner's status (starting → loading → ready ⇄ running, or failed) is kept
here; a crash fails every waiting request with an error (never a hang) and the
runner is started again after a back-off.
"""

import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.text import TextReceiveStream
from loguru import logger
from pydantic import ValidationError

from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.ids import TaskId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.shard import LayerRange
from exo.shared.types.state import Instance
from exo.worker.runner.blas import runner_environment
from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    Generate,
    Shutdown,
    StatusChanged,
    TaskFailed,
    TaskFinished,
    TaskMessage,
    ToRunner,
    from_runner_adapter,
)
from exo.worker.runner.runner_main import runner_command
from exo.worker.runner.standby import assignment

RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
SHUTDOWN_GRACE_SECONDS = 5.0
SEND_TIMEOUT_SECONDS = 5.0
# Routine transitions between these are logged at DEBUG, the rest at INFO/ERROR.
_BUSY_STATES = {"ready", "running"}


class RunnerUnavailable(Exception):
    """The runner is not able to take requests (it failed and is restarting)."""


# A runner that died or stopped reading: the caller treats the send as lost.
_SEND_ERRORS = (RunnerUnavailable, anyio.BrokenResourceError, OSError, TimeoutError)


class RunnerSupervisor:
    """The runner of one rank of an instance (the whole model, for a single rank)."""

    def __init__(
        self,
        instance: Instance,
        rank: int,
        model_dir: Path,
        prefix_cache_bytes: int,
        cache_dir: Path,
        on_status: Callable[[RunnerStatus, str | None], None] = lambda status, error: None,
        prefix_cache_disk_bytes: int = 0,
        standby: Callable[[], Process | None] = lambda: None,
        speculation: bool = True,
        on_cache_summary: Callable[[tuple[int, ...]], None] = lambda summary: None,
        draft_model_dir: Path | None = None,
    ) -> None:
        """`standby`: hands over a runner process started ahead (`standby.py`), or
        None: one is started then. `speculation`: the runner drafts tokens
        (`draft_model_dir`: with that draft model too).
        `on_cache_summary`: what the prefix cache holds, as it changes."""
        self.instance = instance
        self.rank = rank
        self.model_id = instance.model_id
        part = instance.ranks[rank]
        # None: the whole model, alone; else this rank's layers, on a ring.
        self.layers = (
            LayerRange(start=part.start_layer, end=part.end_layer, total=instance.n_layers)
            if len(instance.ranks) > 1
            else None
        )
        # A rank of a ring is not restarted alone: its peers left the group too.
        self.restart = self.layers is None
        self.model_dir = model_dir
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_cache_disk_bytes = prefix_cache_disk_bytes
        self.speculation = speculation
        self.draft_model_dir = draft_model_dir
        self.cache_dir = cache_dir
        self.status: RunnerStatus = "starting"
        self.error: str | None = None
        self.cache_stats: CacheStats | None = None
        self.restarts = 0
        self._on_status = on_status
        self._on_cache_summary = on_cache_summary
        self._cache_summary: tuple[int, ...] | None = None
        self._standby = standby
        self._process: Process | None = None
        self._write_lock = anyio.Lock()
        self._tasks: dict[TaskId, MemoryObjectSendStream[TaskMessage]] = {}
        self._stopping = False
        self._stop_reason = "the node is shutting down"  # what unfinished tasks are told
        self._exited = anyio.Event()

    def _set_status(self, status: RunnerStatus, error: str | None = None) -> None:
        if status != self.status:
            routine = {status, self.status} <= _BUSY_STATES
            level = "ERROR" if status == "failed" else "DEBUG" if routine else "INFO"
            suffix = f": {error}" if error else ""
            logger.log(level, f"runner for {self.model_id}: {status}{suffix}")
            self._on_status(status, error)
        self.status = status
        self.error = error

    async def run(self) -> None:
        """Keep a runner process alive until cancelled or shut down."""
        failures = 0
        while not self._stopping:
            reached_ready = await self._run_once()
            if self._stopping or not self.restart:
                return
            failures = 0 if reached_ready else failures + 1
            self.restarts += 1
            delay = RESTART_BACKOFF_SECONDS[min(failures, len(RESTART_BACKOFF_SECONDS) - 1)]
            logger.warning(f"runner for {self.model_id} exited; restarting in {delay:.0f}s")
            await anyio.sleep(delay)

    async def _run_once(self) -> bool:
        self._exited = anyio.Event()
        self._set_status("starting")
        command = runner_command(
            self.model_dir,
            self.prefix_cache_bytes,
            self.layers,
            self.cache_dir / "prefix_cache",
            self.prefix_cache_disk_bytes,
            tensor=self.instance.sharding == "tensor",
            speculation=self.speculation,
            draft_model_dir=self.draft_model_dir,
        )
        reached_ready = False
        try:
            ring_env: dict[str, str] = {}
            if self.layers is not None:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                hostfile = self.cache_dir / f"ring-{self.instance.instance_id}.json"
                # "ip:port" per rank, for mx.distributed's ring backend
                hosts = [[host] for host in self.instance.ring_hosts]
                hostfile.write_text(json.dumps(hosts))
                ring_env = {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(self.rank)}
            process = await self._assign_standby(command, ring_env)
            if process is None:
                env = runner_environment(self.cache_dir) | ring_env
                process = await anyio.open_process(command, env=env, stderr=None)
        except OSError as error:  # the runner's failure, never the node's
            self._set_status("failed", f"cannot start the runner: {error}")
            self._fail_all(f"runner failed: {error}")
            self._exited.set()
            return False
        self._process = process
        try:
            assert process.stdout is not None
            buffer = ""
            async for text in TextReceiveStream(process.stdout):
                buffer += text
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    if line.strip():
                        self._dispatch(line)
                        reached_ready = reached_ready or self.status == "ready"
            with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                    await process.wait()
            self._process = None
            if self._stopping:
                self._set_status("stopped")
                self._fail_all(self._stop_reason)
            else:
                reason = self.error or f"runner process exited with code {process.returncode}"
                self._set_status("failed", reason)
                self._fail_all(f"runner failed: {reason}")
            self._exited.set()
        return reached_ready

    async def _assign_standby(self, command: list[str], env: dict[str, str]) -> Process | None:
        """The standby process made this runner, or None when there is none (or it
        died meanwhile)."""
        process = self._standby()
        if process is None:
            return None
        try:
            assert process.stdin is not None
            with anyio.fail_after(SEND_TIMEOUT_SECONDS):
                await process.stdin.send(assignment(command, env))
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError, TimeoutError):
            with suppress(ProcessLookupError):
                process.kill()
            with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                await process.wait()
            return None
        logger.debug(f"runner for {self.model_id}: a standby process took it on")
        return process

    def _dispatch(self, line: str) -> None:
        try:
            message = from_runner_adapter.validate_json(line)
        except ValidationError:
            logger.warning(f"runner sent an unreadable line: {line[:200]!r}")
            return
        if isinstance(message, StatusChanged):
            self._set_status(message.status, message.error)
        elif isinstance(message, CacheStatsReport):
            self.cache_stats = message.stats
            if message.summary != self._cache_summary:
                self._cache_summary = message.summary
                self._on_cache_summary(message.summary)
        else:
            stream = self._tasks.get(message.task_id)
            if stream is None:
                return
            try:
                stream.send_nowait(message)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                logger.warning(f"dropping output of task {message.task_id}: nobody reads it")
            if isinstance(message, TaskFinished | TaskFailed):
                stream.close()
                self._tasks.pop(message.task_id, None)

    def _fail_all(self, reason: str) -> None:
        for task_id, stream in list(self._tasks.items()):
            with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                stream.send_nowait(TaskFailed(task_id=task_id, error=reason, runner_lost=True))
            stream.close()
        self._tasks.clear()

    async def _send(self, message: ToRunner) -> None:
        process = self._process
        if process is None or process.stdin is None:
            raise RunnerUnavailable(self.error or f"runner is {self.status}")
        async with self._write_lock:
            with anyio.fail_after(SEND_TIMEOUT_SECONDS):
                await process.stdin.send((message.model_dump_json() + "\n").encode())

    @asynccontextmanager
    async def generate(
        self, request: Generate
    ) -> AsyncIterator[MemoryObjectReceiveStream[TaskMessage]]:
        """Submit a task and receive its messages; the stream ends after `TaskFinished`
        or `TaskFailed`. Leaving before that cancels the task on the runner."""
        if self.status == "failed" or self._process is None:
            raise RunnerUnavailable(self.error or f"runner is {self.status}")
        # Unbounded: a task's output is bounded by its max_tokens, and a slow
        # client must never make the supervisor drop tokens.
        send, receive = anyio.create_memory_object_stream[TaskMessage](math.inf)
        self._tasks[request.task_id] = send
        try:
            await self._send(request)
            async with receive:
                yield receive
        finally:
            if self._tasks.pop(request.task_id, None) is not None:
                send.close()
                with anyio.CancelScope(shield=True):
                    with suppress(*_SEND_ERRORS):
                        await self._send(Cancel(task_id=request.task_id))

    async def shutdown(self, reason: str = "the node is shutting down") -> None:
        """Ask the runner to exit and wait (bounded) until it has; `run` then
        returns. Its unfinished tasks fail with `reason`."""
        self._stopping = True
        self._stop_reason = reason
        if self._process is None:
            return
        with suppress(*_SEND_ERRORS):
            await self._send(Shutdown())
        with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            await self._exited.wait()
