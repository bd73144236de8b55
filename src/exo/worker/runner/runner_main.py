"""The runner process: loads one model (or one rank's layers of it), owns its KV
prefix cache, generates.

Started by the supervisor as `python -m exo.worker.runner.runner_main`. Reads
`ToRunner` JSON lines on stdin and writes `FromRunner` JSON lines on the
original stdout; everything else printed goes to stderr.

Pipeline ranks: with `MLX_HOSTFILE` (a JSON list, per rank, of one "ip:port")
and `MLX_RANK` in the environment and `--start-layer S --end-layer E
--total-layers N`, the runner is one rank of an `mx.distributed` ring group
holding layers [S, E) of the model's N. With `--prefix-cache-dir`, each rank
keeps its layers' share of the cache's disk tier (agreed with the others: see
`pipeline.py`).
Rank 0 takes `Generate`/`Cancel` and reports task messages; every rank reports
its status and cache stats, and obeys `Shutdown` and the end of stdin; rank 0
serves its tasks one at a time. Without them the runner holds the whole model,
alone, and serves the tasks it holds together (`engine/mlx/batch.py`).
"""

import argparse
import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

import psutil
from loguru import logger
from pydantic import ValidationError

from exo.shared.types.shard import LayerRange
from exo.shared.types.tasks import SampledLogprobs
from exo.worker.runner.blas import PIPELINE_GOMP_SPINCOUNT
from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    FromRunner,
    Generate,
    PrefillProgress,
    Shutdown,
    StatusChanged,
    TaskFailed,
    TaskFinished,
    TaskText,
    ToRunner,
    to_runner_adapter,
)

if TYPE_CHECKING:
    from exo.engine.mlx.batch import ContinuousBatcher
    from exo.engine.mlx.generate import GenerationOutput, TextGenerator
    from exo.engine.mlx.prefix_cache import KVPrefixCache

# Below this share of free RAM the prefix cache evicts regardless of its budget.
LOW_MEMORY_FRACTION = 0.08
IDLE_POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 1.0
# The prefix cache writes to disk only after this long without a request.
PERSIST_AFTER_IDLE_SECONDS = 5.0


def _memory_pressure() -> bool:
    memory = psutil.virtual_memory()
    return memory.available < LOW_MEMORY_FRACTION * memory.total


def runner_command(
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange | None,
    prefix_cache_dir: Path | None = None,
    prefix_cache_disk_bytes: int = 0,
) -> list[str]:
    """The command line that starts a runner: the whole model, or `layers` of it
    as one rank of a ring (`MLX_HOSTFILE` and `MLX_RANK` set in its environment).
    With `prefix_cache_dir` and disk bytes, the prefix cache keeps entries there."""
    command = [
        sys.executable,
        "-m",
        "exo.worker.runner.runner_main",
        "--model-dir",
        str(model_dir),
        "--prefix-cache-bytes",
        str(prefix_cache_bytes),
    ]
    if prefix_cache_dir is not None and prefix_cache_disk_bytes > 0:
        command += ["--prefix-cache-dir", str(prefix_cache_dir)]
        command += ["--prefix-cache-disk-bytes", str(prefix_cache_disk_bytes)]
    if layers is not None:
        command += ["--start-layer", str(layers.start), "--end-layer", str(layers.end)]
        command += ["--total-layers", str(layers.total)]
    return command


class Runner:
    def __init__(self, out: IO[str], inbox: "queue.Queue[ToRunner | None]") -> None:
        self._out = out
        self._inbox = inbox
        self._pending: deque[Generate] = deque()
        self._cancelled: set[str] = set()
        self._active: set[str] = set()  # tasks taken and not ended
        self.pipelined = False

    def send(self, message: FromRunner, flush: bool = True) -> None:
        """Write `message`; `flush=False` leaves it buffered for a later send or
        `flush` (a batch step's messages go out in one write)."""
        self._out.write(message.model_dump_json() + "\n")
        if flush:
            self._out.flush()

    def flush(self) -> None:
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
            known = {task.task_id for task in self._pending} | self._active
            if message.task_id in known:
                self._cancelled.add(message.task_id)
        else:
            self._pending.append(message)
        return True

    def _is_cancelled(self, task_id: str) -> bool:
        if not self._drain_inbox():
            raise SystemExit(0)
        return task_id in self._cancelled

    def asked_to_stop(self, within: float) -> bool:
        """Whether `Shutdown` (or the end of stdin) arrives within `within` seconds."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._inbox.get(timeout=left)
            except queue.Empty:
                return False
            if not self._accept(message):
                return True
        return False

    def _stop_if_asked(self) -> None:
        """Called while waiting on the ring: exit on `Shutdown` (or the end of stdin)."""
        if not self._drain_inbox():
            raise SystemExit(0)

    def _follow(self) -> None:
        """`_stop_if_asked` for ranks > 0, where a task sent by mistake fails at once."""
        self._stop_if_asked()
        while self._pending:
            task = self._pending.popleft()
            self.send(
                TaskFailed(task_id=task.task_id, error="only rank 0 of a pipeline takes tasks")
            )

    def _ready(self, cache: "KVPrefixCache | None") -> None:
        self.send(StatusChanged(status="ready"))
        if cache is not None:
            self.send(CacheStatsReport(stats=cache.stats()))

    def serve(
        self,
        model_dir: Path,
        prefix_cache_bytes: int,
        layers: LayerRange | None,
        disk: tuple[Path, int] | None = None,
    ) -> None:
        self.send(StatusChanged(status="loading"))
        if layers is None:
            self._serve_whole_model(model_dir, prefix_cache_bytes, disk)
        else:
            self.pipelined = True
            self._serve_rank(model_dir, prefix_cache_bytes, layers, disk)

    def _serve_whole_model(
        self, model_dir: Path, prefix_cache_bytes: int, disk: tuple[Path, int] | None
    ) -> None:
        # Imported here so a broken MLX install is reported as a failed runner.
        from exo.engine.mlx.batch import ContinuousBatcher, can_batch
        from exo.engine.mlx.generate import LocalModel, TextGenerator
        from exo.engine.mlx.load import load_for_inference
        from exo.engine.mlx.prefix_cache import KVPrefixCache
        from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace

        model, tokenizer = load_for_inference(model_dir)
        cache = (
            KVPrefixCache(
                prefix_cache_bytes,
                memory_pressure=_memory_pressure,
                disk=DiskTier(disk[0], cache_namespace(model_dir, None), disk[1]) if disk else None,
                decode=tokenizer.decode,
            )
            if prefix_cache_bytes > 0
            else None
        )
        self._ready(cache)
        local = LocalModel(model, tokenizer)
        generator = TextGenerator(local, tokenizer, cache)
        if can_batch(local.make_cache()):
            self._run_batched(ContinuousBatcher(generator), lambda: self._persist_while_idle(cache))
        else:
            logger.info("this model's caches do not batch: requests are served one at a time")
            self._run_tasks(generator, lambda: self._persist_while_idle(cache))
        if cache is not None:
            cache.persist()

    def _persist_while_idle(self, cache: "KVPrefixCache | None") -> None:
        """Once requests pause, write the newest entry not on disk yet (one per idle
        poll, so a request that comes waits for one file at most), then report it."""
        if cache is None or time.monotonic() - cache.last_active < PERSIST_AFTER_IDLE_SECONDS:
            return
        if cache.persist(max_entries=1):
            self.send(CacheStatsReport(stats=cache.stats()))

    def _serve_rank(
        self,
        model_dir: Path,
        prefix_cache_bytes: int,
        layers: LayerRange,
        disk: tuple[Path, int] | None = None,
    ) -> None:
        import mlx.core as mx

        from exo.engine.mlx.generate import TextGenerator
        from exo.engine.mlx.load import load_model_tokenizer, parameter_bytes
        from exo.engine.mlx.pipeline import (
            PipelineDriver,
            PipelineFollower,
            agree_disk_entries,
            handshake,
            ring_prefix_cache,
        )
        from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
        from exo.engine.mlx.ring import PeerLost, join_ring
        from exo.engine.mlx.shard import load_shard

        # Join before loading: ranks start together, while loading times differ
        # (the handshake below waits for the slowest).
        started = time.monotonic()
        link = join_ring(interrupt=self._stop_if_asked)
        joined = time.monotonic()
        logger.info(
            f"joined the pipeline group as rank {link.rank} of {link.size} in {joined - started:.1f}s"
        )
        # Before numba loads libgomp (in `load_shard`), which reads it then.
        os.environ.setdefault("GOMP_SPINCOUNT", PIPELINE_GOMP_SPINCOUNT)
        shard = load_shard(model_dir, layers)
        logger.info(
            f"loaded {layers} ({parameter_bytes(shard) / 1e6:.0f} MB, peak "
            f"{mx.get_peak_memory() / 1e6:.0f} MB) in {time.monotonic() - joined:.1f}s"
        )
        # This rank's share of each entry on disk, in a folder named by its layers.
        tier = (
            DiskTier(disk[0], cache_namespace(model_dir, layers), disk[1])
            if disk and prefix_cache_bytes > 0
            else None
        )
        cache = ring_prefix_cache(link, prefix_cache_bytes, _memory_pressure, tier)
        # Everything slow comes before the handshake: after it, rank 0's heartbeats
        # must start within the followers' idle bound. Rank 0 detokenizes, the last
        # rank samples (constraints need the tokenizer).
        needs_tokenizer = link.rank == 0 or link.is_last
        tokenizer = load_model_tokenizer(model_dir) if needs_tokenizer else None
        stop_if_asked = self._stop_if_asked if link.rank == 0 else self._follow
        disk_on = handshake(
            link, layers, cache is not None, interrupt=stop_if_asked, disk_on=tier is not None
        )
        if cache is not None and disk_on:
            agree_disk_entries(link, cache, stop_if_asked)
        elif cache is not None and tier is not None:
            logger.warning("prefix cache: another pipeline rank keeps no disk tier: none is used")
            cache.detach_disk()
        if link.rank != 0:
            self._ready(cache)
            try:
                PipelineFollower(link, shard, cache, tokenizer).serve(
                    interrupt=self._follow,
                    on_task_start=lambda: self.send(StatusChanged(status="running")),
                    on_task_end=lambda: self._ready(cache),
                    on_persisted=lambda: self._report_cache(cache),
                )
            except SystemExit:  # stopped through stdin: a clean stop too
                if cache is not None:
                    cache.persist()
                raise
            # A clean stop writes what is not on disk yet (the next start's key
            # agreement drops what another rank did not write).
            if cache is not None:
                cache.persist()
            return
        assert tokenizer is not None
        driver = PipelineDriver(link, shard)

        def keep_alive() -> None:
            """Heartbeats; once requests pause, one entry to disk per idle poll, on
            every rank (rank 0 names it)."""
            driver.keep_alive()
            if cache is None or time.monotonic() - cache.last_active < PERSIST_AFTER_IDLE_SECONDS:
                return
            if driver.persist_idle(cache):
                self._report_cache(cache)

        self._ready(cache)
        with contextlib.suppress(SystemExit):
            self._run_tasks(TextGenerator(driver, tokenizer, cache), keep_alive)
        with contextlib.suppress(PeerLost):  # a rank stopped along with us may be gone already
            driver.shutdown()
        if cache is not None:
            cache.persist()

    def _report_cache(self, cache: "KVPrefixCache | None") -> None:
        if cache is not None:
            self.send(CacheStatsReport(stats=cache.stats()))

    def _run_tasks(self, generator: "TextGenerator", keep_alive: Callable[[], None]) -> None:
        """Take tasks in order until shutdown; `keep_alive` runs while idle."""
        from exo.engine.constraint_grammar import ConstraintError
        from exo.engine.mlx.generate import GenerationCancelled
        from exo.engine.mlx.ring import PipelineFailure

        cache = generator.prefix_cache
        while True:
            if not self._pending:
                keep_alive()
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
            self._active.add(task.task_id)
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
                    self._send_output(task, output)
            except GenerationCancelled:
                self.send(TaskFailed(task_id=task.task_id, error="cancelled"))
            except ConstraintError as error:  # the request's fault: no traceback
                self.send(TaskFailed(task_id=task.task_id, error=f"invalid constraint: {error}"))
            except PipelineFailure as error:  # the group is gone: so is every task
                for failed in [task, *self._pending]:
                    self.send(
                        TaskFailed(task_id=failed.task_id, error=str(error), runner_lost=True)
                    )
                self._pending.clear()
                raise
            except Exception as error:  # a bad request must not kill the runner
                logger.exception(f"task {task.task_id} failed")
                self.send(
                    TaskFailed(task_id=task.task_id, error=f"{type(error).__name__}: {error}")
                )
            finally:
                self._active.discard(task.task_id)
                self._cancelled.discard(task.task_id)
            self.send(StatusChanged(status="ready"))
            self._report_cache(cache)

    def _run_batched(self, batcher: "ContinuousBatcher", keep_alive: Callable[[], None]) -> None:
        """Take tasks as they come and serve them together until shutdown;
        `keep_alive` runs while idle."""
        from exo.engine.constraint_grammar import ConstraintError
        from exo.engine.mlx.batch import GenerationFailed, PromptProgress
        from exo.engine.mlx.generate import Finished

        tasks: dict[str, Generate] = {}

        def end(task: Generate, error: str | None = None) -> None:
            """A task is over: failed with `error`, or finished (its messages are out)."""
            tasks.pop(task.task_id, None)
            self._active.discard(task.task_id)
            self._cancelled.discard(task.task_id)
            if error is not None:
                self.send(TaskFailed(task_id=task.task_id, error=error))
            if not tasks:
                self.send(StatusChanged(status="ready"))
            self._report_cache(batcher.prefix_cache)

        while True:
            if batcher.idle and not self._pending:
                keep_alive()
                try:
                    message = self._inbox.get(timeout=IDLE_POLL_SECONDS)
                except queue.Empty:
                    continue
                if not self._accept(message):
                    return
                continue
            if not self._drain_inbox():
                return
            for task_id in self._cancelled & set(tasks):
                batcher.cancel(task_id)
                end(tasks[task_id], "cancelled")
            while self._pending and len(tasks) < batcher.max_batch:
                task = self._pending.popleft()
                if task.task_id in self._cancelled:
                    self._cancelled.discard(task.task_id)
                    continue
                if not tasks:
                    self.send(StatusChanged(status="running"))
                tasks[task.task_id] = task
                self._active.add(task.task_id)
                try:
                    progress = batcher.add(
                        task.task_id, task.tokens, task.params, task.system_prompt_length
                    )
                except ConstraintError as error:  # the request's fault: no traceback
                    end(task, f"invalid constraint: {error}")
                    continue
                except Exception as error:  # a bad request must not kill the runner
                    logger.exception(f"task {task.task_id} failed")
                    end(task, f"{type(error).__name__}: {error}")
                    continue
                self.send(
                    PrefillProgress(task_id=task.task_id, done=progress.done, total=progress.total)
                )
            for task_id, output in batcher.step():
                task = tasks[task_id]
                if isinstance(output, PromptProgress):
                    self.send(
                        PrefillProgress(task_id=task.task_id, done=output.done, total=output.total),
                        flush=False,
                    )
                elif isinstance(output, GenerationFailed):
                    error = output.error
                    logger.opt(exception=error).error(f"task {task_id} failed")
                    end(task, f"{type(error).__name__}: {error}")
                else:
                    self._send_output(task, output, flush=False)
                    if isinstance(output, Finished):
                        end(task)
            self.flush()

    def _send_output(self, task: Generate, output: "GenerationOutput", flush: bool = True) -> None:
        from exo.engine.mlx.generate import TextDelta

        if isinstance(output, TextDelta):
            logprobs = SampledLogprobs(tokens=output.logprobs) if task.params.logprobs else None
            self.send(TaskText(task_id=task.task_id, text=output.text, logprobs=logprobs), flush)
        else:
            finished = TaskFinished(
                task_id=task.task_id,
                finish_reason=output.finish_reason,
                usage=output.usage,
                stop_sequence=output.stop_sequence,
            )
            self.send(finished, flush)


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


def _layers(args: argparse.Namespace) -> LayerRange | None:
    ring_env = "MLX_HOSTFILE" in os.environ and "MLX_RANK" in os.environ
    bounds = (args.start_layer, args.end_layer, args.total_layers)
    if bounds == (None, None, None) and not ring_env:
        return None
    if None in bounds or not ring_env:
        raise ValueError(
            "a pipeline rank needs --start-layer, --end-layer, --total-layers, "
            "MLX_HOSTFILE and MLX_RANK"
        )
    return LayerRange(start=args.start_layer, end=args.end_layer, total=args.total_layers)


def _exit(code: int) -> NoReturn:
    """Leave at once: a pipeline rank's MLX ring threads may be blocked on a dead
    peer, and nothing else is left to clean up once the messages are out."""
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description="exo runner process")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prefix-cache-bytes", type=int, required=True)
    parser.add_argument("--prefix-cache-dir", type=Path, help="the prefix cache's disk tier")
    parser.add_argument("--prefix-cache-disk-bytes", type=int, default=0)
    parser.add_argument("--start-layer", type=int, help="first layer of this pipeline rank")
    parser.add_argument("--end-layer", type=int, help="end (exclusive) of this rank's layers")
    parser.add_argument("--total-layers", type=int, help="the model's layer count")
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
        disk = (
            (args.prefix_cache_dir, args.prefix_cache_disk_bytes)
            if args.prefix_cache_dir is not None and args.prefix_cache_disk_bytes > 0
            else None
        )
        runner.serve(args.model_dir, args.prefix_cache_bytes, _layers(args), disk)
    except SystemExit:
        pass
    except BaseException as error:
        # When the node stops an instance each rank is told so; one that sees a peer
        # leave first was being stopped too, which is no failure.
        if not (runner.pipelined and runner.asked_to_stop(within=STOP_GRACE_SECONDS)):
            logger.error(traceback.format_exc())
            runner.send(StatusChanged(status="failed", error=f"{type(error).__name__}: {error}"))
            if runner.pipelined:
                _exit(1)
            sys.exit(1)
    runner.send(StatusChanged(status="stopped"))
    if runner.pipelined:
        _exit(0)


if __name__ == "__main__":
    main()
