"""The `exo` command line."""

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import anyio
import psutil
from loguru import logger
from pydantic import ValidationError

from exo.api.admission import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_QUEUED,
    DEFAULT_QUEUE_TIMEOUT_SECONDS,
    AdmissionLimits,
)
from exo.api.app import KEEPALIVE_SECONDS
from exo.api.model_alias import parse_model_alias
from exo.cluster.auth import validate_secret
from exo.cluster.timing import LinkTiming
from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.store import InvalidModelId, default_data_dir, model_dir, validate_model_id
from exo.node import NodeConfig, NodeStartupError, run_node
from exo.shared.allocator import keep_large_buffers_in_the_heap

DEFAULT_API_PORT = 52415
DEFAULT_GRPC_PORT = 52414
# Share of RAM the prefix cache may hold by default.
DEFAULT_PREFIX_CACHE_FRACTION = 0.2
# Share of the data dir's free disk the prefix cache's disk tier may hold by default.
DEFAULT_PREFIX_CACHE_DISK_FRACTION = 0.1
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")


def _flag(
    parser: argparse._ActionsContainer, flag: str, env: str, default: Any, help: str, **kw: Any
) -> None:
    """A flag whose default comes from `env` when set. argparse converts (and
    reports bad values of) string defaults with the flag's `type` like any input."""
    shown = "" if default is None else f"; default {default}"
    parser.add_argument(
        flag, default=os.environ.get(env, default), help=f"{help} ({env}{shown})", **kw
    )


def _node_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo",
        description="Run an exo node: an OpenAI-compatible API over a local MLX model. "
        "Every flag has an EXO_* environment variable equivalent.",
        epilog="Other commands: 'exo import-gguf PATH --model-id ID' imports a llama GGUF file; "
        "'exo download MODEL' downloads a model from the Hugging Face hub.",
    )
    _flag(
        parser,
        "--host",
        "EXO_HOST",
        "0.0.0.0",
        "address the HTTP API binds to; 127.0.0.1 keeps it on this machine (the cluster link "
        "binds --grpc-host)",
    )
    _flag(
        parser,
        "--api-key",
        "EXO_API_KEY",
        None,
        "key every API request must carry (Authorization: Bearer KEY or x-api-key: KEY), but "
        "/health and the dashboard page; every node of a cluster needs the same one",
    )
    _flag(parser, "--api-port", "EXO_API_PORT", str(DEFAULT_API_PORT), "HTTP API port", type=int)
    _flag(
        parser,
        "--data-dir",
        "EXO_DATA_DIR",
        str(default_data_dir()),
        "where the node keeps its state",
        type=Path,
    )
    _flag(
        parser,
        "--models-dir",
        "EXO_MODELS_DIR",
        None,
        "where models live, one folder each (default: DATA_DIR/models)",
        type=Path,
    )
    _flag(
        parser,
        "--models-read-only-dirs",
        "EXO_MODELS_READ_ONLY_DIRS",
        "",
        f"'{os.pathsep}'-separated model directories used in place and never written (e.g. a shared disk)",
    )
    _flag(
        parser,
        "--min-free-disk-bytes",
        "EXO_MIN_FREE_DISK_BYTES",
        None,
        "free disk space downloads never use (default: 1 GiB or 5 %% of the disk, the larger)",
        type=int,
    )
    _flag(
        parser,
        "--model",
        "EXO_MODEL",
        DEFAULT_MODEL_ID,
        "model id to serve on this node from the start; 'none': only what is placed here",
    )
    _flag(
        parser,
        "--prefix-cache-bytes",
        "EXO_PREFIX_CACHE_BYTES",
        None,
        f"KV prefix cache budget in bytes, 0 disables it (default {DEFAULT_PREFIX_CACHE_FRACTION * 100:.0f}%% of RAM)",
        type=int,
    )
    _flag(
        parser,
        "--prefix-cache-disk-bytes",
        "EXO_PREFIX_CACHE_DISK_BYTES",
        None,
        "bytes of disk the KV prefix cache keeps entries in across restarts, 0 disables it "
        f"(default {DEFAULT_PREFIX_CACHE_DISK_FRACTION * 100:.0f}%% of the data dir's free disk)",
        type=int,
    )
    _flag(
        parser,
        "--sse-keepalive-seconds",
        "EXO_SSE_KEEPALIVE_SECONDS",
        str(KEEPALIVE_SECONDS),
        "longest silence on a stream before an SSE keep-alive comment, e.g. during a long prefill",
        type=float,
    )
    _flag(
        parser,
        "--max-concurrent",
        "EXO_MAX_CONCURRENT",
        str(DEFAULT_MAX_CONCURRENT),
        "requests a served model works on at once (its runner's batch)",
        type=int,
    )
    _flag(
        parser,
        "--max-queued",
        "EXO_MAX_QUEUED",
        str(DEFAULT_MAX_QUEUED),
        "requests per served model that wait for a free slot; more are refused with 429",
        type=int,
    )
    _flag(
        parser,
        "--queue-timeout-seconds",
        "EXO_QUEUE_TIMEOUT_SECONDS",
        str(DEFAULT_QUEUE_TIMEOUT_SECONDS),
        "a request that waits longer for a slot is answered 503",
        type=float,
    )
    _flag(
        parser,
        "--max-body-bytes",
        "EXO_MAX_BODY_BYTES",
        str(DEFAULT_MAX_BODY_BYTES),
        "largest request body accepted; larger ones are answered 413",
        type=int,
    )
    _flag(
        parser,
        "--model-alias",
        "EXO_MODEL_ALIAS",
        "",
        "comma-separated PATTERN=MODEL rules naming the served model that answers requests for "
        "other model names (fnmatch patterns, first match wins), e.g. 'claude-*=MODEL'; "
        "claude-* names go to the only served model when there is one",
    )
    _flag(
        parser,
        "--log-level",
        "EXO_LOG_LEVEL",
        "INFO",
        "log level",
        type=str.upper,
        choices=LOG_LEVELS,
    )
    cluster = parser.add_argument_group("cluster")
    _flag(
        cluster,
        "--grpc-host",
        "EXO_GRPC_HOST",
        "0.0.0.0",
        "address the cluster link (gRPC) binds to",
    )
    _flag(
        cluster,
        "--grpc-port",
        "EXO_GRPC_PORT",
        str(DEFAULT_GRPC_PORT),
        "port of the cluster link (gRPC)",
        type=int,
    )
    _flag(
        cluster,
        "--peers",
        "EXO_PEERS",
        "",
        "comma-separated host:grpc_port of other nodes, for networks where discovery is blocked",
    )
    _flag(
        cluster,
        "--cluster-secret",
        "EXO_CLUSTER_SECRET",
        "",
        "shared secret; nodes with different secrets never join each other",
    )
    _switch(cluster, "--force-master", "EXO_FORCE_MASTER", "this node is master whenever it is up")
    _switch(cluster, "--no-worker", "EXO_NO_WORKER", "coordinate only: run no model on this node")
    _switch(cluster, "--no-api", "EXO_NO_API", "serve no HTTP API on this node")
    _switch(cluster, "--no-discovery", "EXO_NO_DISCOVERY", "do not use mDNS; only --peers")
    _flag(
        cluster,
        "--node-timeout-seconds",
        "EXO_NODE_TIMEOUT_SECONDS",
        "20",
        "the master removes a node (and its instances) silent for this long",
        type=float,
    )
    return parser  # fmt: skip


def _switch(parser: argparse._ActionsContainer, flag: str, env: str, help: str) -> None:
    default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} ({env}=1)")


def _models_dir_flag(parser: argparse.ArgumentParser) -> None:
    _flag(
        parser,
        "--models-dir",
        "EXO_MODELS_DIR",
        str(default_data_dir() / "models"),
        "where models live",
        type=Path,
    )


def _import_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo import-gguf",
        description="Import a llama-architecture GGUF file as an MLX model folder.",
    )
    parser.add_argument("path", type=Path, help="the .gguf file")
    parser.add_argument(
        "--model-id", required=True, help="id to serve it under, e.g. my-org/my-model"
    )
    _models_dir_flag(parser)
    return parser


def _download_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo download",
        description="Download a model from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN) into "
        "the models directory, resuming partial files; Ctrl-C stops, running it again resumes.",
    )
    parser.add_argument(
        "model_id", help="hub repo id, e.g. mlx-community/Llama-3.2-1B-Instruct-4bit"
    )
    _models_dir_flag(parser)
    return parser


def _download(argv: list[str]) -> None:
    from exo.worker.downloads.cli import download_with_progress_bar

    args = _download_parser().parse_args(argv)
    try:
        model_id = validate_model_id(args.model_id)
    except InvalidModelId as error:
        _fail(str(error))
    try:
        sys.exit(anyio.run(download_with_progress_bar, model_id, args.models_dir))
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: run the same command again to resume\n")
        sys.exit(130)


def _fail(message: str) -> NoReturn:
    logger.error(message)
    sys.exit(2)


def _import_gguf(argv: list[str]) -> None:
    from exo.models.gguf_import import GGUFImportError, import_gguf

    args = _import_parser().parse_args(argv)
    try:
        model_id = validate_model_id(args.model_id)
        path = import_gguf(args.path, model_dir(args.models_dir, model_id))
    except (InvalidModelId, GGUFImportError) as error:
        _fail(str(error))
    logger.info(f"serve it with: exo --model {model_id} --models-dir {args.models_dir}")
    print(path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import-gguf"]:
        _import_gguf(argv[1:])
        return
    if argv[:1] == ["download"]:
        _download(argv[1:])
        return
    args = _node_parser().parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    os.environ["EXO_LOG_LEVEL"] = args.log_level  # runners log at the same level
    try:
        model_id = None if args.model == "none" else validate_model_id(args.model)
    except InvalidModelId as error:
        _fail(str(error))
    try:
        secret = validate_secret(args.cluster_secret)
    except ValueError as error:
        _fail(str(error))
    try:
        aliases = tuple(
            parse_model_alias(rule) for rule in args.model_alias.split(",") if rule.strip()
        )
    except ValueError as error:
        _fail(f"--model-alias: {error}")
    try:
        admission = AdmissionLimits(
            max_concurrent=args.max_concurrent,
            max_queued=args.max_queued,
            queue_timeout_seconds=args.queue_timeout_seconds,
            max_body_bytes=args.max_body_bytes,
        )
    except ValidationError as error:
        first = error.errors()[0]
        _fail(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg'].lower()}")
    cache_bytes = args.prefix_cache_bytes
    if cache_bytes is None:
        cache_bytes = int(psutil.virtual_memory().total * DEFAULT_PREFIX_CACHE_FRACTION)
    if cache_bytes < 0:
        _fail("--prefix-cache-bytes must be 0 (disabled) or a positive number of bytes")
    disk_bytes = args.prefix_cache_disk_bytes
    if disk_bytes is None:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        free = psutil.disk_usage(str(args.data_dir)).free
        disk_bytes = int(free * DEFAULT_PREFIX_CACHE_DISK_FRACTION)
    if disk_bytes < 0:
        _fail("--prefix-cache-disk-bytes must be 0 (disabled) or a positive number of bytes")
    config = NodeConfig(
        host=args.host,
        api_port=args.api_port,
        data_dir=args.data_dir,
        models_dir=args.models_dir or args.data_dir / "models",
        model_id=model_id,
        prefix_cache_bytes=cache_bytes,
        prefix_cache_disk_bytes=disk_bytes,
        sse_keepalive_seconds=args.sse_keepalive_seconds,
        admission=admission,
        model_aliases=aliases,
        api_key=args.api_key or None,
        grpc_host=args.grpc_host,
        grpc_port=args.grpc_port,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        cluster_secret=secret,
        force_master=args.force_master,
        worker=not args.no_worker,
        api=not args.no_api,
        discovery=not args.no_discovery,
        timing=LinkTiming(node_timeout_seconds=args.node_timeout_seconds),
        read_only_models_dirs=tuple(
            Path(d) for d in args.models_read_only_dirs.split(os.pathsep) if d.strip()
        ),
        min_free_disk_bytes=args.min_free_disk_bytes,
    )
    keep_large_buffers_in_the_heap()
    try:
        anyio.run(run_node, config)
    except NodeStartupError as error:
        _fail(str(error))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
