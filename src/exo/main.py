"""The `exo` command line."""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

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
from exo.api.http_server import DEFAULT_CLIENT_STALL_SECONDS
from exo.api.model_alias import parse_model_alias
from exo.api.reply_retry import DEFAULT_RETRY_SECONDS
from exo.api.routing import ROUTING_POLICIES
from exo.cluster.auth import validate_secret
from exo.cluster.timing import LinkTiming
from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.local_store import ModelStore
from exo.models.store import InvalidModelId, default_data_dir, model_dir, validate_model_id
from exo.node import NodeConfig, NodeStartupError, run_node
from exo.shared.allocator import keep_large_buffers_in_the_heap
from exo.shared.types.ids import ModelId

DEFAULT_API_PORT = 52415
DEFAULT_GRPC_PORT = 52414
# Where Ollama's own server listens: what --ollama-port is for.
OLLAMA_DEFAULT_PORT = 11434
# Share of RAM the prefix cache may hold by default.
DEFAULT_PREFIX_CACHE_FRACTION = 0.2
# Share of the data dir's free disk the prefix cache's disk tier may hold by default.
DEFAULT_PREFIX_CACHE_DISK_FRACTION = 0.1
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")
# How a runner drafts tokens for speculative decoding; "none": it does not.
SPECULATION_MODES = ("prompt-lookup", "none")
# Values of a switch's environment variable.
SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Flag:
    """A flag whose default an EXO_* environment variable replaces."""

    name: str
    env: str
    help: str
    default: str | None = None  # text, converted by `type` like typed input
    type: Callable[[str], object] = str
    switch: bool = False  # on when given, or when `env` is 1/true/yes/on
    scope: Literal["shared", "node", "cluster"] = "node"  # shared: every command takes it

    def env_value(self) -> str | None:
        return os.environ.get(self.env) or None  # an empty variable counts as unset

    def env_error(self) -> str | None:
        """Why the environment variable's value is not one the flag takes, if it is not."""
        value = self.env_value()
        if value is None:
            return None
        if self.switch:
            if value.strip().lower() in SWITCH_ON + SWITCH_OFF:
                return None
            return (
                f"{self.env}={value!r}: use 1, true, yes or on to turn it on, "
                "0, false, no, off or nothing to turn it off"
            )
        try:
            self.type(value)
        except argparse.ArgumentTypeError as error:
            return f"{self.env}={value!r}: {error}"
        except ValueError:
            return f"{self.env}={value!r}: not a valid {self.name} value"
        return None

    def add_to(self, parser: argparse._ActionsContainer, *, with_default: bool = True) -> None:
        value = self.env_value()
        # A subcommand's copy of a shared flag has no default: the top-level
        # parser's default stands unless the flag is given after the subcommand.
        if not with_default:
            default: object = argparse.SUPPRESS
        elif self.switch:
            default = value is not None and value.strip().lower() in SWITCH_ON
        else:
            default = self.default if value is None else value
        if self.switch:
            parser.add_argument(
                self.name, action="store_true", default=default, help=f"{self.help} ({self.env}=1)"
            )
            return
        shown = "" if not self.default else f"; default {self.default}"
        parser.add_argument(
            self.name, type=self.type, default=default, help=f"{self.help} ({self.env}{shown})"
        )


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _routing(text: str) -> str:
    if text.lower() not in ROUTING_POLICIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(ROUTING_POLICIES)}")
    return text.lower()


def _non_negative_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds >= 0")
    return seconds


def _speculation(text: str) -> str:
    if text.lower() not in SPECULATION_MODES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(SPECULATION_MODES)}")
    return text.lower()


FLAGS: tuple[Flag, ...] = (
    Flag("--data-dir", "EXO_DATA_DIR", "where the node keeps its state", str(default_data_dir()), Path, scope="shared"),
    Flag("--models-dir", "EXO_MODELS_DIR", "where models live, one folder each (default: DATA_DIR/models)", type=Path, scope="shared"),
    Flag("--log-level", "EXO_LOG_LEVEL", f"log level, one of {', '.join(LOG_LEVELS)}", "INFO", _log_level, scope="shared"),
    Flag("--host", "EXO_HOST", "address the HTTP API binds to; 127.0.0.1 keeps it on this machine (the cluster link binds --grpc-host)", "0.0.0.0"),
    Flag("--api-key", "EXO_API_KEY", "key every API request must carry (Authorization: Bearer KEY or x-api-key: KEY), but /health and the dashboard page; every node of a cluster needs the same one"),
    Flag("--api-port", "EXO_API_PORT", "HTTP API port", str(DEFAULT_API_PORT), int),
    Flag("--ollama-port", "EXO_OLLAMA_PORT", f"also serve the HTTP API on this port, with / answering as Ollama's server does, "
         f"for clients that expect Ollama there (e.g. {OLLAMA_DEFAULT_PORT}); off by default", type=int),
    Flag("--models-read-only-dirs", "EXO_MODELS_READ_ONLY_DIRS", f"'{os.pathsep}'-separated model directories used in place and never written (e.g. a shared disk)", ""),
    Flag("--min-free-disk-bytes", "EXO_MIN_FREE_DISK_BYTES", "free disk space downloads never use (default: 1 GiB or 5 %% of the disk, the larger)", type=int),
    Flag("--model", "EXO_MODEL", "model id to serve on this node from the start; 'none': only what is placed here", DEFAULT_MODEL_ID),
    Flag("--prefix-cache-bytes", "EXO_PREFIX_CACHE_BYTES", f"KV prefix cache budget in bytes, 0 disables it (default {DEFAULT_PREFIX_CACHE_FRACTION * 100:.0f}%% of RAM)", type=int),
    Flag("--prefix-cache-disk-bytes", "EXO_PREFIX_CACHE_DISK_BYTES", "bytes of disk the KV prefix cache keeps entries in across restarts, 0 disables it "
         f"(default {DEFAULT_PREFIX_CACHE_DISK_FRACTION * 100:.0f}%% of the data dir's free disk)", type=int),
    Flag("--memory-limit-bytes", "EXO_MEMORY_LIMIT_BYTES", "memory a runner may fill with weights and KV caches: a request whose predicted KV does not fit "
         "waits for running requests, then gets 503 (400 if it never fits) (default: the RAM, or Metal's recommended working set)", type=int),
    Flag("--sse-keepalive-seconds", "EXO_SSE_KEEPALIVE_SECONDS", "longest silence on a stream before an SSE keep-alive comment, e.g. during a long prefill", str(KEEPALIVE_SECONDS), float),
    Flag("--max-concurrent", "EXO_MAX_CONCURRENT", "requests a served model works on at once (its runner's batch)", str(DEFAULT_MAX_CONCURRENT), int),
    Flag("--max-queued", "EXO_MAX_QUEUED", "requests per served model that wait for a free slot; more are refused with 429", str(DEFAULT_MAX_QUEUED), int),
    Flag("--queue-timeout-seconds", "EXO_QUEUE_TIMEOUT_SECONDS", "a request that waits longer for a slot is answered 503", str(DEFAULT_QUEUE_TIMEOUT_SECONDS), float),
    Flag("--max-body-bytes", "EXO_MAX_BODY_BYTES", "largest request body accepted; larger ones are answered 413", str(DEFAULT_MAX_BODY_BYTES), int),
    Flag("--client-stall-seconds", "EXO_CLIENT_STALL_SECONDS", "a client that takes no bytes of an answer this long is disconnected (its generation cancelled); "
         "also the longest a request's headers may take", str(DEFAULT_CLIENT_STALL_SECONDS), float),
    Flag("--model-alias", "EXO_MODEL_ALIAS", "comma-separated PATTERN=MODEL rules naming the served model that answers requests for other model names "
         "(fnmatch patterns, first match wins), e.g. 'claude-*=MODEL'; claude-* names go to the only served model when there is one", ""),
    Flag("--speculation", "EXO_SPECULATION", f"speculative decoding's drafts, one of {', '.join(SPECULATION_MODES)}: "
         "prompt-lookup drafts tokens from the prompt (and a request's prediction), none turns drafting off", "prompt-lookup", _speculation),
    Flag("--draft-model", "EXO_DRAFT_MODEL", "a small model (in the models directory) with the served models' tokenizer, drafting text that copies nothing "
         "for the models this node serves whole; models of another tokenizer are served without it (GET /v1/models says why)"),
    Flag("--retry-seconds", "EXO_RETRY_SECONDS", "how long a request whose runner or node is lost before its first token is run again "
         "(on the restarted runner, another instance, or the model placed again) before it fails; 0 turns retrying off", str(DEFAULT_RETRY_SECONDS), _non_negative_seconds),
    Flag("--routing", "EXO_ROUTING", f"how this node chooses among a model's replicas, one of {', '.join(ROUTING_POLICIES)}: "
         "cache-aware sends a request where the longest prefix of its prompt is cached unless that replica is much busier", "cache-aware", _routing),
    Flag("--no-fetch-images", "EXO_NO_FETCH_IMAGES", "do not fetch images that requests give by http(s) URL (such a request is a 400 asking for the image inline); "
         "for nodes whose network clients should not reach through them", switch=True),
    Flag("--grpc-host", "EXO_GRPC_HOST", "address the cluster link (gRPC) binds to", "0.0.0.0", scope="cluster"),
    Flag("--grpc-port", "EXO_GRPC_PORT", "port of the cluster link (gRPC)", str(DEFAULT_GRPC_PORT), int, scope="cluster"),
    Flag("--peers", "EXO_PEERS", "comma-separated host:grpc_port of other nodes, for networks where discovery is blocked", "", scope="cluster"),
    Flag("--cluster-secret", "EXO_CLUSTER_SECRET", "shared secret; nodes with different secrets never join each other", "", scope="cluster"),
    Flag("--force-master", "EXO_FORCE_MASTER", "this node is master whenever it is up", switch=True, scope="cluster"),
    Flag("--no-worker", "EXO_NO_WORKER", "coordinate only: run no model on this node", switch=True, scope="cluster"),
    Flag("--no-api", "EXO_NO_API", "serve no HTTP API on this node", switch=True, scope="cluster"),
    Flag("--no-discovery", "EXO_NO_DISCOVERY", "do not use mDNS; only --peers", switch=True, scope="cluster"),
    Flag("--node-timeout-seconds", "EXO_NODE_TIMEOUT_SECONDS", "the master removes a node (and its instances) silent for this long", "20", float, scope="cluster"),
)  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    """`exo` alone runs a node; `exo COMMAND` runs a subcommand. Built per call:
    defaults come from the environment as it is now."""
    parser = argparse.ArgumentParser(
        prog="exo",
        usage="%(prog)s [OPTIONS]\n"
        "       %(prog)s download MODEL [OPTIONS]\n"
        "       %(prog)s import-gguf PATH --model-id ID [OPTIONS]",
        description="Run an exo node: an OpenAI-compatible API over a local MLX model. "
        "Every flag has an EXO_* environment variable equivalent.",
    )
    cluster = parser.add_argument_group("cluster")
    for flag in FLAGS:
        flag.add_to(cluster if flag.scope == "cluster" else parser)
    commands = parser.add_subparsers(
        dest="command", title="commands (none: run a node)", metavar="COMMAND"
    )
    # `prog` given: the default would repeat the top-level usage.
    download = commands.add_parser(
        "download",
        prog="exo download",
        help="download a model from the Hugging Face hub",
        description="Download a model from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN) into "
        "the models directory, resuming partial files; Ctrl-C stops, running it again resumes.",
    )
    download.add_argument(
        "model_id", help="hub repo id, e.g. mlx-community/Llama-3.2-1B-Instruct-4bit"
    )
    import_gguf = commands.add_parser(
        "import-gguf",
        prog="exo import-gguf",
        help="import a llama GGUF file as an MLX model",
        description="Import a llama-architecture GGUF file as an MLX model folder.",
    )
    import_gguf.add_argument("path", type=Path, help="the .gguf file")
    import_gguf.add_argument(
        "--model-id", required=True, help="id to serve it under, e.g. my-org/my-model"
    )
    for subcommand in (download, import_gguf):
        for flag in FLAGS:
            if flag.scope == "shared":
                flag.add_to(subcommand, with_default=False)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    # Checked before parsing so that the error names the variable, not its flag.
    for flag in FLAGS:
        if error := flag.env_error():
            parser.error(error)
    args = parser.parse_args(argv)
    if args.command is not None:
        # A node's flag before the subcommand parses, but the subcommand would drop it.
        given = {token.split("=")[0] for token in argv[: argv.index(args.command)]}
        if dropped := sorted(given & {f.name for f in FLAGS if f.scope != "shared"}):
            parser.error(f"{', '.join(dropped)}: not an option of 'exo {args.command}'")
    return args


def models_dir(args: argparse.Namespace) -> Path:
    """One rule for the node and every subcommand: --models-dir, else DATA_DIR/models."""
    return args.models_dir or args.data_dir / "models"


def _download(args: argparse.Namespace) -> None:
    from exo.worker.downloads.cli import download_with_progress_bar

    try:
        model_id = validate_model_id(args.model_id)
    except InvalidModelId as error:
        _fail(str(error))
    try:
        sys.exit(anyio.run(download_with_progress_bar, model_id, models_dir(args)))
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: run the same command again to resume\n")
        sys.exit(130)


def _fail(message: str) -> NoReturn:
    logger.error(message)
    sys.exit(2)


def _import_gguf(args: argparse.Namespace) -> None:
    from exo.models.gguf_import import GGUFImportError, import_gguf

    models = models_dir(args)
    try:
        model_id = validate_model_id(args.model_id)
        path = import_gguf(args.path, model_dir(models, model_id))
    except (InvalidModelId, GGUFImportError) as error:
        _fail(str(error))
    logger.info(f"serve it with: exo --model {model_id} --models-dir {models}")
    print(path)


def _draft_model(args: argparse.Namespace) -> ModelId | None:
    """`--draft-model`, checked: a model of the models directory (the built-in
    one is imported at start), with speculative decoding on."""
    if not args.draft_model:
        return None
    try:
        draft = validate_model_id(args.draft_model)
    except InvalidModelId as error:
        _fail(f"--draft-model: {error}")
    if args.speculation == "none":
        _fail("--draft-model drafts for speculative decoding, which --speculation none turns off")
    store = ModelStore(
        models_dir(args),
        tuple(Path(d) for d in args.models_read_only_dirs.split(os.pathsep) if d.strip()),
    )
    if draft != DEFAULT_MODEL_ID and store.find(draft) is None:
        _fail(
            f"--draft-model {draft}: no such model in {models_dir(args)}; copy its folder "
            f"there or download it first (exo download {draft})"
        )
    return draft


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's settings from its flags; a bad value exits with a sentence."""
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
    if not args.client_stall_seconds > 0:
        _fail("--client-stall-seconds must be a positive number of seconds")
    if args.ollama_port is not None:
        if not 0 < args.ollama_port < 65536:
            _fail("--ollama-port must be a port number (1-65535)")
        if args.ollama_port == args.api_port:
            _fail("--ollama-port must differ from --api-port")
        if args.no_api:
            _fail("--ollama-port serves the HTTP API, which --no-api turns off")
    draft_model = _draft_model(args)
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
    return NodeConfig(
        host=args.host,
        api_port=args.api_port,
        ollama_port=args.ollama_port,
        data_dir=args.data_dir,
        models_dir=models_dir(args),
        model_id=model_id,
        prefix_cache_bytes=cache_bytes,
        prefix_cache_disk_bytes=disk_bytes,
        sse_keepalive_seconds=args.sse_keepalive_seconds,
        admission=admission,
        client_stall_seconds=args.client_stall_seconds,
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
        speculation=args.speculation != "none",
        draft_model=draft_model,
        routing=args.routing,
        retry_seconds=args.retry_seconds,
        fetch_images=not args.no_fetch_images,
    )


def _run_node(args: argparse.Namespace) -> None:
    os.environ["EXO_LOG_LEVEL"] = args.log_level  # runners log at the same level
    config = node_config(args)
    # Runners read their memory admission's settings from their environment.
    if args.memory_limit_bytes is not None:
        if args.memory_limit_bytes <= 0:
            _fail("--memory-limit-bytes must be a positive number of bytes")
        os.environ["EXO_MEMORY_LIMIT_BYTES"] = str(args.memory_limit_bytes)
    os.environ["EXO_QUEUE_TIMEOUT_SECONDS"] = str(config.admission.queue_timeout_seconds)
    keep_large_buffers_in_the_heap()
    try:
        anyio.run(run_node, config)
    except NodeStartupError as error:
        _fail(str(error))
    except KeyboardInterrupt:
        pass


COMMANDS: dict[str | None, Callable[[argparse.Namespace], None]] = {
    None: _run_node,
    "download": _download,
    "import-gguf": _import_gguf,
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
