"""The runner process: loads one model (or one rank's layers of it), owns its KV
prefix cache, generates.

Started by the supervisor as `python -m exo.worker.runner.runner_main`. Reads
`ToRunner` JSON lines on stdin (`inbox.py`) and writes `FromRunner` JSON lines
on the original stdout; everything else printed goes to stderr.

Pipeline ranks: with `MLX_HOSTFILE` (a JSON list, per rank, of one "ip:port")
and `MLX_RANK` in the environment and `--start-layer S --end-layer E
--total-layers N`, the runner is one rank of an `mx.distributed` ring group
holding layers [S, E) of the model's N (`split_rank.py`). With
`--prefix-cache-dir`, each rank keeps its layers' share of the cache's disk tier
(agreed with the others: see `engine/mlx/ring_agreements.py`). Rank 0 takes
`Generate`/`Cancel` and reports task messages; every rank reports its status and
cache stats, and obeys `Shutdown` and the end of stdin. Without them the runner
holds the whole model, alone (`whole_model.py`). With `--tensor` as well (and
the layers [0, N) of N), the rank holds a slice of every layer instead
(`split_rank.py`). All serve their tasks in one loop (`serving.py`).

Here: the process's statuses from its start (loading) to its end (stopped, or
failed with the error).
"""

import argparse
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, NoReturn

from loguru import logger
from pydantic import ValidationError

from exo.shared.types.shard import LayerRange
from exo.worker.runner.inbox import Inbox
from exo.worker.runner.protocol import StatusChanged, ToRunner, to_runner_adapter

# A pipeline rank that fails waits this long for the node's word that it was
# being stopped anyway.
STOP_GRACE_SECONDS = 1.0


def runner_command(
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange | None,
    prefix_cache_dir: Path | None = None,
    prefix_cache_disk_bytes: int = 0,
    tensor: bool = False,
    speculation: bool = True,
    draft_model_dir: Path | None = None,
) -> list[str]:
    """The command line that starts a runner: the whole model, or `layers` of it
    as one rank of a ring (`MLX_HOSTFILE` and `MLX_RANK` set in its environment);
    `tensor`: the rank holds a slice of every layer (`layers` are all of them).
    With `prefix_cache_dir` and disk bytes, the prefix cache keeps entries there.
    Without `speculation`, the runner drafts no tokens; with `draft_model_dir`
    (the whole model only), a draft model drafts text that copies nothing."""
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
    if tensor:
        command.append("--tensor")
    if not speculation:
        command.append("--no-speculation")
    if draft_model_dir is not None:
        command += ["--draft-model-dir", str(draft_model_dir)]
    return command


def _read_stdin(messages: "queue.Queue[ToRunner | None]") -> None:
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                messages.put(to_runner_adapter.validate_json(line))
            except ValidationError:
                logger.error(f"ignoring an unreadable message: {line[:200]!r}")
    finally:
        messages.put(None)  # the supervisor closed our stdin (or it broke): stop


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


def _serve(
    out: IO[str],
    inbox: Inbox,
    model_dir: Path,
    prefix_cache_bytes: int,
    layers: LayerRange | None,
    disk: tuple[Path, int] | None,
    tensor: bool,
    speculation: bool,
    draft_model_dir: Path | None = None,
) -> None:
    """Load the whole model, one rank's layers or one rank's slice of every
    layer, and serve until stopped; without `speculation`, drafting no tokens;
    with `draft_model_dir`, drafting with that model too (the whole model only)."""
    # Imported here so that a broken MLX install is reported as a failed runner.
    started = time.monotonic()
    from exo.worker.runner.serving import Runner

    # Most of a runner's start before it loads (MLX, mlx_lm, transformers).
    logger.info(f"imported MLX and mlx_lm in {time.monotonic() - started:.1f}s")
    runner = Runner(out, inbox, speculation=speculation)
    from exo.worker.runner.memory_admission import memory_settings

    memory = memory_settings(os.environ)  # `--memory-limit-bytes` from the node
    if layers is None:
        from exo.worker.runner.whole_model import serve_whole_model

        serve_whole_model(runner, model_dir, prefix_cache_bytes, disk, memory, draft_model_dir)
    else:
        if draft_model_dir is not None:
            raise ValueError("only a runner of the whole model drafts with a draft model")
        from exo.worker.runner.split_rank import serve_split_rank

        serve_split_rank(runner, model_dir, prefix_cache_bytes, layers, disk, tensor, memory)


def _send_status(out: IO[str], status: StatusChanged) -> None:
    out.write(status.model_dump_json() + "\n")
    out.flush()


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
    parser.add_argument(
        "--tensor",
        action="store_true",
        help="this rank holds a slice of every layer; needs MLX_HOSTFILE and MLX_RANK",
    )
    parser.add_argument(
        "--no-speculation",
        dest="speculation",
        action="store_false",
        help="draft no tokens (speculative decoding off)",
    )
    parser.add_argument(
        "--draft-model-dir",
        type=Path,
        help="a small model of the same tokenizer drafting text that copies nothing",
    )
    args = parser.parse_args()
    # Ctrl-C reaches the whole process group; the node stops us via stdin instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # Keep the protocol on the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("EXO_LOG_LEVEL", "INFO"))

    messages: queue.Queue[ToRunner | None] = queue.Queue()
    threading.Thread(target=_read_stdin, args=(messages,), daemon=True).start()
    inbox = Inbox(messages)
    disk = (
        (args.prefix_cache_dir, args.prefix_cache_disk_bytes)
        if args.prefix_cache_dir is not None and args.prefix_cache_disk_bytes > 0
        else None
    )
    _send_status(out, StatusChanged(status="loading"))
    layers: LayerRange | None = None
    try:
        layers = _layers(args)
        _serve(
            out,
            inbox,
            args.model_dir,
            args.prefix_cache_bytes,
            layers,
            disk,
            args.tensor,
            args.speculation,
            args.draft_model_dir if args.speculation else None,
        )
    except BaseException as error:
        # When the node stops an instance each rank is told so; one that sees a peer
        # leave first was being stopped too, which is no failure.
        if not (layers is not None and inbox.stop_arrives(within=STOP_GRACE_SECONDS)):
            logger.error(traceback.format_exc())
            failed = StatusChanged(status="failed", error=f"{type(error).__name__}: {error}")
            _send_status(out, failed)
            if layers is not None:
                _exit(1)
            sys.exit(1)
    _send_status(out, StatusChanged(status="stopped"))
    if layers is not None:
        _exit(0)


if __name__ == "__main__":
    main()
