"""The runner process: loads one model, owns its KV prefix cache, generates.

Started by the supervisor as `python -m exo.worker.runner.runner_main`. Reads
`ToRunner` JSON lines on stdin and writes `FromRunner` JSON lines on the
original stdout; everything else printed goes to stderr.
"""

import argparse
import os
import queue
import signal
import sys
import threading
import traceback
from collections import deque
from pathlib import Path
from typing import IO

import psutil
from loguru import logger
from pydantic import ValidationError

from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    Chunk,
    Finished,
    FromRunner,
    Generate,
    PrefillProgress,
    Shutdown,
    StatusChanged,
    TaskFailed,
    ToRunner,
    to_runner_adapter,
)

# Below this share of free RAM the prefix cache evicts regardless of its budget.
LOW_MEMORY_FRACTION = 0.08
IDLE_POLL_SECONDS = 1.0


def _memory_pressure() -> bool:
    memory = psutil.virtual_memory()
    return memory.available < LOW_MEMORY_FRACTION * memory.total


class Runner:
    def __init__(self, out: IO[str], inbox: "queue.Queue[ToRunner | None]") -> None:
        self._out = out
        self._inbox = inbox
        self._pending: deque[Generate] = deque()
        self._cancelled: set[str] = set()
        self._current: str | None = None

    def send(self, message: FromRunner) -> None:
        self._out.write(message.model_dump_json() + "\n")
        self._out.flush()

    def _drain_inbox(self) -> bool:
        """Take waiting messages without blocking; False once shutdown was asked."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if not self._accept(message):
                return False

    def _accept(self, message: ToRunner | None) -> bool:
        if message is None or isinstance(message, Shutdown):
            return False
        if isinstance(message, Cancel):
            known = {task.task_id for task in self._pending} | {self._current}
            if message.task_id in known:
                self._cancelled.add(message.task_id)
        else:
            self._pending.append(message)
        return True

    def _is_cancelled(self, task_id: str) -> bool:
        if not self._drain_inbox():
            raise SystemExit(0)
        return task_id in self._cancelled

    def serve(self, model_dir: Path, prefix_cache_bytes: int) -> None:
        self.send(StatusChanged(status="loading"))
        # Imported here so a broken MLX install is reported as a failed runner.
        from exo.engine.mlx.generate import GenerationCancelled, TextDelta, TextGenerator
        from exo.engine.mlx.load import load_for_inference
        from exo.engine.mlx.prefix_cache import KVPrefixCache

        model, tokenizer = load_for_inference(model_dir)
        cache = (
            KVPrefixCache(prefix_cache_bytes, memory_pressure=_memory_pressure)
            if prefix_cache_bytes > 0
            else None
        )
        generator = TextGenerator(model, tokenizer, cache)
        self.send(StatusChanged(status="ready"))
        if cache is not None:
            self.send(CacheStatsReport(stats=cache.stats()))
        while True:
            if not self._pending:
                try:
                    message = self._inbox.get(timeout=IDLE_POLL_SECONDS)
                except queue.Empty:
                    continue
                if not self._accept(message):
                    return
                continue
            task = self._pending.popleft()
            if task.task_id in self._cancelled:
                self._cancelled.discard(task.task_id)
                continue
            self.send(StatusChanged(status="running"))
            self._current = task.task_id
            try:
                outputs = generator.generate(
                    task.tokens,
                    task.params,
                    task.system_prompt_length,
                    is_cancelled=lambda t=task.task_id: self._is_cancelled(t),
                    on_progress=lambda done, total, t=task.task_id: self.send(
                        PrefillProgress(task_id=t, done=done, total=total)
                    ),
                )
                for output in outputs:
                    if isinstance(output, TextDelta):
                        self.send(Chunk(task_id=task.task_id, text=output.text))
                    else:
                        self.send(
                            Finished(
                                task_id=task.task_id,
                                finish_reason=output.finish_reason,
                                usage=output.usage,
                            )
                        )
            except GenerationCancelled:
                self.send(TaskFailed(task_id=task.task_id, error="cancelled"))
            except Exception as error:  # a bad request must not kill the runner
                logger.exception(f"task {task.task_id} failed")
                self.send(
                    TaskFailed(task_id=task.task_id, error=f"{type(error).__name__}: {error}")
                )
            finally:
                self._current = None
                self._cancelled.discard(task.task_id)
            self.send(StatusChanged(status="ready"))
            if cache is not None:
                self.send(CacheStatsReport(stats=cache.stats()))


def _read_stdin(inbox: "queue.Queue[ToRunner | None]") -> None:
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                inbox.put(to_runner_adapter.validate_json(line))
            except ValidationError:
                logger.error(f"ignoring an unreadable message: {line[:200]!r}")
    finally:
        inbox.put(None)  # the supervisor closed our stdin (or it broke): shut down


def main() -> None:
    parser = argparse.ArgumentParser(description="exo runner process")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prefix-cache-bytes", type=int, required=True)
    args = parser.parse_args()
    # Ctrl-C reaches the whole process group; the node stops us via stdin instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # Keep the protocol on the real stdout; anything else printed goes to stderr.
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("EXO_LOG_LEVEL", "INFO"))

    inbox: queue.Queue[ToRunner | None] = queue.Queue()
    threading.Thread(target=_read_stdin, args=(inbox,), daemon=True).start()
    runner = Runner(protocol_out, inbox)
    try:
        runner.serve(args.model_dir, args.prefix_cache_bytes)
    except SystemExit:
        pass
    except BaseException as error:
        logger.error(traceback.format_exc())
        runner.send(StatusChanged(status="failed", error=f"{type(error).__name__}: {error}"))
        sys.exit(1)
    runner.send(StatusChanged(status="stopped"))


if __name__ == "__main__":
    main()
