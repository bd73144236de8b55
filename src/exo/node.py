"""A node: the cluster link, a worker (model + runner) and the HTTP API."""

import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import uvicorn
from loguru import logger
from mlx_lm.utils import load_tokenizer

from exo.api.app import ServedModel, create_app
from exo.cluster.auth import secret_fingerprint
from exo.cluster.discovery import MdnsDiscovery
from exo.cluster.link import ClusterLink, LinkTiming
from exo.master.event_log import EventLog, EventLogCorrupted
from exo.master.event_store import EventStore, now_ms
from exo.models.builtin import DEFAULT_MODEL_ID, BuiltinModelMissing, ensure_default_model
from exo.models.gguf_import import GGUFImportError
from exo.models.store import context_length, model_dir, sampling_defaults
from exo.shared.types.events import (
    InstanceCreated,
    InstanceDeleted,
    NodeJoined,
    NodeTelemetryReported,
    RunnerStatusChanged,
)
from exo.shared.types.ids import ModelId, NodeId, new_instance_id
from exo.shared.types.state import Instance
from exo.worker.runner.supervisor import RunnerSupervisor
from exo.worker.telemetry import read_telemetry

READY_ANNOUNCE_TIMEOUT_SECONDS = 600.0
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
    grpc_port: int = 52414
    peers: tuple[str, ...] = ()
    cluster_secret: str = ""
    force_master: bool = False
    worker: bool = True
    api: bool = True
    discovery: bool = True
    timing: LinkTiming = field(default_factory=LinkTiming)


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


def _open_store(node_id: NodeId, data_dir: Path) -> EventStore:
    try:
        return EventStore(node_id, EventLog.open(data_dir / EVENT_LOG_NAME))
    except EventLogCorrupted as error:
        raise NodeStartupError(f"the event log is damaged: {error}") from error


def _advertised_host(host: str) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class _Worker:
    """This node's model: its instance in the cluster state and its runner."""

    instance: Instance
    runner: RunnerSupervisor
    served: ServedModel


async def _start_worker(config: NodeConfig, link: ClusterLink) -> _Worker:
    logger.info(f"preparing model {config.model_id} in {config.models_dir}")
    path = await anyio.to_thread.run_sync(_resolve_model, config)
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, path)
    instance = Instance(
        instance_id=new_instance_id(), model_id=config.model_id, node_id=link.node_id
    )
    runner = RunnerSupervisor(
        config.model_id,
        path,
        config.prefix_cache_bytes,
        config.data_dir / "cache",
        on_status=lambda status, error: link.publish(
            RunnerStatusChanged(
                instance_id=instance.instance_id, node_id=link.node_id, status=status, error=error
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
    link.publish(InstanceCreated(instance=instance))
    return _Worker(instance, runner, served)


async def _keep_this_node_in_the_state(
    config: NodeConfig, link: ClusterLink, joined: NodeJoined, worker: _Worker | None
) -> None:
    """Report telemetry, and rejoin (with the instance) after being timed out."""
    interval = config.timing.node_timeout_seconds / 4
    while True:
        telemetry = await anyio.to_thread.run_sync(read_telemetry, config.models_dir)
        link.publish(NodeTelemetryReported(node_id=link.node_id, telemetry=telemetry))
        await anyio.sleep(interval)
        state = link.state
        if link.master_id is None or (
            link.node_id in state.nodes
            and (worker is None or worker.instance.instance_id in state.instances)
        ):
            continue
        logger.warning("this node is missing from the cluster state; rejoining")
        link.publish(joined)
        if worker is not None:
            link.publish(
                InstanceCreated(instance=worker.instance),
                RunnerStatusChanged(
                    instance_id=worker.instance.instance_id,
                    node_id=link.node_id,
                    status=worker.runner.status,
                    error=worker.runner.error,
                ),
            )


async def run_node(config: NodeConfig) -> None:
    sock = _bind(config.host, config.api_port) if config.api else None
    shown_host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    base_url = f"http://{shown_host}:{config.api_port}"
    node_id = load_node_id(config.data_dir)
    store = _open_store(node_id, config.data_dir)
    advertised = _advertised_host(config.host)
    link = ClusterLink(
        store,
        grpc_host=config.host,
        grpc_port=config.grpc_port,
        advertised_host=advertised,
        secret=config.cluster_secret,
        static_peers=list(config.peers),
        force_master=config.force_master,
        timing=config.timing,
    )
    # Instances this node served before a restart are gone with their runners.
    link.publish(
        *(
            InstanceDeleted(instance_id=i)
            for i, instance in store.state.instances.items()
            if instance.node_id == node_id
        )
    )
    async with anyio.create_task_group() as group:
        await group.start(_run_link, link)
        joined = NodeJoined(
            node_id=node_id,
            grpc_address=link.address,
            api_address=f"{advertised}:{config.api_port}" if config.api else None,
            started_at_ms=now_ms(),
        )
        link.publish(joined)  # first: events about this node's instances need the node
        if config.discovery:
            discovery = MdnsDiscovery(
                node_id,
                config.grpc_port,
                secret_fingerprint(config.cluster_secret),
                addresses=None if config.host in ("0.0.0.0", "") else [advertised],
            )
            group.start_soon(discovery.run, lambda peer: link.add_peer_address(peer.address))
        worker = await _start_worker(config, link) if config.worker else None
        group.start_soon(_keep_this_node_in_the_state, config, link, joined, worker)
        if worker is not None:
            group.start_soon(worker.runner.run)
            group.start_soon(_announce_ready, worker, base_url)
        try:
            if sock is not None:
                models = {worker.served.model_id: worker.served} if worker else {}
                app = create_app(models, link, config.sse_keepalive_seconds)
                server = uvicorn.Server(
                    uvicorn.Config(
                        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
                    )
                )
                logger.info(f"API listening on {base_url}")
                if worker is not None:
                    logger.info(f"try:\n  {_curl_example(base_url, config.model_id)}")
                await server.serve(sockets=[sock])
            else:
                await anyio.sleep_forever()
        finally:
            logger.info("shutting down")
            if worker is not None:
                with anyio.CancelScope(shield=True):
                    await worker.runner.shutdown()
            group.cancel_scope.cancel()


async def _run_link(link: ClusterLink, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    await link.run(on_ready=task_status.started)


async def _announce_ready(worker: _Worker, base_url: str) -> None:
    if await worker.runner.wait_ready(READY_ANNOUNCE_TIMEOUT_SECONDS):
        logger.info(f"ready: {worker.served.model_id} is serving at {base_url}/v1")
