"""A node: imports its model, supervises the runner, serves the HTTP API."""

import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import uvicorn
from loguru import logger
from mlx_lm.utils import load_tokenizer

from exo.api.app import ServedModel, create_app
from exo.master.event_log import EventLog, EventLogCorrupted
from exo.master.master import Master, now_ms
from exo.models.builtin import DEFAULT_MODEL_ID, BuiltinModelMissing, ensure_default_model
from exo.models.gguf_import import GGUFImportError
from exo.models.store import context_length, model_dir, sampling_defaults
from exo.shared.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    MasterElected,
    NodeJoined,
    NodeTelemetryReported,
    RunnerStatusChanged,
)
from exo.shared.types.ids import ModelId, NodeId, new_instance_id
from exo.shared.types.state import Instance
from exo.worker.runner.supervisor import RunnerSupervisor
from exo.worker.telemetry import read_telemetry

READY_ANNOUNCE_TIMEOUT_SECONDS = 600.0
TELEMETRY_INTERVAL_SECONDS = 10.0
EVENT_LOG_NAME = "events.log"


class NodeStartupError(RuntimeError):
    """The node cannot start (port taken, model missing); the message says why."""


@dataclass(frozen=True)
class NodeConfig:
    host: str
    api_port: int
    data_dir: Path
    models_dir: Path
    model_id: ModelId
    prefix_cache_bytes: int
    sse_keepalive_seconds: float


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise NodeStartupError(
            f"cannot listen on {host}:{port} ({error.strerror}); "
            "is another exo running? Choose another port with --api-port"
        ) from error
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _resolve_model(config: NodeConfig) -> Path:
    if config.model_id == DEFAULT_MODEL_ID:
        try:
            return ensure_default_model(config.models_dir)
        except (BuiltinModelMissing, GGUFImportError, OSError) as error:
            raise NodeStartupError(f"cannot prepare the built-in model: {error}") from error
    path = model_dir(config.models_dir, config.model_id)
    if not (path / "config.json").exists():
        raise NodeStartupError(
            f"model {config.model_id!r} is not in {config.models_dir}; "
            "import one with 'exo import-gguf PATH --model-id ID'"
        )
    return path


def _curl_example(base_url: str, model_id: str) -> str:
    return (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": '
        '[{"role": "user", "content": "What is the capital of France?"}]}\''
    )


def load_node_id(data_dir: Path) -> NodeId:
    """This node's id: made once, kept in the data dir so a restart is the same node."""
    path = data_dir / "node_id"
    if path.exists():
        return NodeId(path.read_text().strip())
    data_dir.mkdir(parents=True, exist_ok=True)
    node_id = NodeId(f"node-{uuid.uuid4().hex[:12]}")
    path.write_text(node_id)
    return node_id


def _open_master(node_id: NodeId, data_dir: Path) -> Master:
    try:
        return Master(node_id, EventLog.open(data_dir / EVENT_LOG_NAME))
    except EventLogCorrupted as error:
        raise NodeStartupError(f"the event log is damaged: {error}") from error


class _Publisher:
    """This node's events, each with a fresh id (the master deduplicates by id)."""

    def __init__(self, master: Master) -> None:
        self.master = master

    def __call__(self, *events: Event) -> None:
        self.master.publish(self.master.node_id, [(uuid.uuid4().hex, e) for e in events])


async def _report_telemetry(publish: _Publisher, models_dir: Path) -> None:
    while True:
        telemetry = await anyio.to_thread.run_sync(read_telemetry, models_dir)
        publish(NodeTelemetryReported(node_id=publish.master.node_id, telemetry=telemetry))
        await anyio.sleep(TELEMETRY_INTERVAL_SECONDS)


async def run_node(config: NodeConfig) -> None:
    sock = _bind(config.host, config.api_port)
    shown_host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    base_url = f"http://{shown_host}:{config.api_port}"
    node_id = load_node_id(config.data_dir)
    master = _open_master(node_id, config.data_dir)
    publish = _Publisher(master)
    logger.info(f"node {node_id}: event log at index {master.state.last_idx + 1}")
    publish(
        NodeJoined(node_id=node_id, grpc_address=None, started_at_ms=now_ms()),
        MasterElected(master_id=node_id, term=master.state.master_term + 1),
        # Instances this node served before a restart are gone with their runners.
        *(
            InstanceDeleted(instance_id=i)
            for i, instance in master.state.instances.items()
            if instance.node_id == node_id
        ),
    )

    logger.info(f"preparing model {config.model_id} in {config.models_dir}")
    path = await anyio.to_thread.run_sync(_resolve_model, config)
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, path)
    instance = Instance(instance_id=new_instance_id(), model_id=config.model_id, node_id=node_id)
    publish(InstanceCreated(instance=instance))
    runner = RunnerSupervisor(
        config.model_id,
        path,
        config.prefix_cache_bytes,
        config.data_dir / "cache",
        on_status=lambda status, error: publish(
            RunnerStatusChanged(
                instance_id=instance.instance_id, node_id=node_id, status=status, error=error
            )
        ),
    )
    temperature, top_p = sampling_defaults(path)
    served = ServedModel(
        model_id=config.model_id,
        tokenizer=tokenizer,
        context_length=context_length(path),
        runner=runner,
        created=int(time.time()),
        default_temperature=temperature,
        default_top_p=top_p,
    )
    app = create_app({config.model_id: served}, master, config.sse_keepalive_seconds)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    )

    async def announce_ready() -> None:
        if await runner.wait_ready(READY_ANNOUNCE_TIMEOUT_SECONDS):
            logger.info(f"ready: {config.model_id} is serving at {base_url}/v1")

    logger.info(f"API listening on {base_url} (loading the model; requests wait for it)")
    logger.info(f"try:\n  {_curl_example(base_url, config.model_id)}")
    async with anyio.create_task_group() as group:
        group.start_soon(runner.run)
        group.start_soon(announce_ready)
        group.start_soon(_report_telemetry, publish, config.models_dir)
        try:
            await server.serve(sockets=[sock])
        finally:
            logger.info("shutting down")
            with anyio.CancelScope(shield=True):
                await runner.shutdown()
            group.cancel_scope.cancel()
