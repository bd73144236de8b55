"""The `exo` command line."""

import argparse
import os
import sys
from pathlib import Path

import anyio
import psutil
from loguru import logger

from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.store import (
    InvalidModelId,
    default_data_dir,
    default_models_dir,
    model_dir,
    validate_model_id,
)
from exo.node import NodeConfig, NodeStartupError, run_node

DEFAULT_API_PORT = 52415
# Share of RAM the prefix cache may hold by default.
DEFAULT_PREFIX_CACHE_FRACTION = 0.2


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _node_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo",
        description="Run an exo node: an OpenAI-compatible API over a local MLX model. "
        "Every flag has an EXO_* environment variable equivalent.",
        epilog="Other commands: 'exo import-gguf PATH --model-id ID' imports a llama GGUF file.",
    )
    parser.add_argument(
        "--host",
        default=_env("EXO_HOST", "0.0.0.0"),
        help="address the API binds to (EXO_HOST; default 0.0.0.0)",
    )
    parser.add_argument(
        "--api-port",
        type=int,
        default=int(_env("EXO_API_PORT", str(DEFAULT_API_PORT))),
        help=f"HTTP API port (EXO_API_PORT; default {DEFAULT_API_PORT})",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(_env("EXO_DATA_DIR", str(default_data_dir()))),
        help="where the node keeps its state (EXO_DATA_DIR)",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=default_models_dir(),
        help="where models live, one folder each (EXO_MODELS_DIR)",
    )
    parser.add_argument(
        "--model",
        default=_env("EXO_MODEL", DEFAULT_MODEL_ID),
        help=f"model id to serve (EXO_MODEL; default the built-in {DEFAULT_MODEL_ID})",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=int(_env("EXO_PREFIX_CACHE_BYTES", "-1")),
        help="byte budget of the KV prefix cache; 0 disables it "
        f"(EXO_PREFIX_CACHE_BYTES; default {DEFAULT_PREFIX_CACHE_FRACTION:.0%} of RAM)",
    )
    parser.add_argument(
        "--sse-keepalive-seconds",
        type=float,
        default=float(_env("EXO_SSE_KEEPALIVE_SECONDS", "10")),
        help="seconds between SSE keep-alive comments while a stream waits, e.g. during "
        "a long prefill (EXO_SSE_KEEPALIVE_SECONDS; default 10)",
    )
    parser.add_argument(
        "--log-level",
        default=_env("EXO_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (EXO_LOG_LEVEL)",
    )
    return parser


def _import_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo import-gguf",
        description="Import a llama-architecture GGUF file as an MLX model folder.",
    )
    parser.add_argument("path", type=Path, help="the .gguf file")
    parser.add_argument(
        "--model-id", required=True, help="id to serve it under, e.g. my-org/my-model"
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=default_models_dir(),
        help="where models live (EXO_MODELS_DIR)",
    )
    return parser


def _fail(message: str) -> None:
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
        return
    logger.info(f"serve it with: exo --model {model_id} --models-dir {args.models_dir}")
    print(path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import-gguf"]:
        _import_gguf(argv[1:])
        return
    args = _node_parser().parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper())
    os.environ["EXO_LOG_LEVEL"] = args.log_level.upper()  # runners log at the same level
    try:
        model_id = validate_model_id(args.model)
    except InvalidModelId as error:
        _fail(str(error))
        return
    cache_bytes = args.prefix_cache_bytes
    if cache_bytes < 0:
        cache_bytes = int(psutil.virtual_memory().total * DEFAULT_PREFIX_CACHE_FRACTION)
    config = NodeConfig(
        host=args.host,
        api_port=args.api_port,
        data_dir=args.data_dir,
        models_dir=args.models_dir,
        model_id=model_id,
        prefix_cache_bytes=cache_bytes,
        sse_keepalive_seconds=args.sse_keepalive_seconds,
    )
    try:
        anyio.run(run_node, config)
    except NodeStartupError as error:
        _fail(str(error))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
