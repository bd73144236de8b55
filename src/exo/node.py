"""A node: the cluster link, a worker (model + runner) and the HTTP API."""

import math
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from loguru import logger

from exo.api.admission import AdmissionLimits
from exo.api.app import create_app
from exo.api.auth import APIAccess, is_loopback_address
from exo.api.http_server import DEFAULT_CLIENT_STALL_SECONDS, api_server
from exo.api.model_alias import ModelAlias
from exo.api.ollama_routes import with_ollama_root
from exo.api.reply_retry import DEFAULT_RETRY_SECONDS
from exo.api.routing import RoutingPolicy
from exo.api.routing_tokenizers import RoutingTokenizers
from exo.cluster.discovery import MdnsDiscovery, default_advertised_addresses
from exo.cluster.link import ClusterLink
from exo.cluster.timing import LinkTiming
from exo.cluster.tls import NodeCertificate
from exo.master.master import Master
from exo.models.builtin import BuiltinModelMissing
from exo.models.cards import ModelCardError, card_from_folder
from exo.models.gguf_import import GGUFImportError
from exo.models.local_store import ModelStore, ModelUnavailable
from exo.shared.allocator import release_free_memory_periodically
from exo.shared.data_dir import DataDirInUse, DataDirLock
from exo.shared.event_log import EventLog, EventLogCorrupted
from exo.shared.event_store import EventStore, now_ms
from exo.shared.state_snapshot import SnapshotCorrupted
from exo.shared.types.commands import ClusterUnavailable, CommandRejected, CreateInstance
from exo.shared.types.events import (
    InstanceDeleted,
    NodeJoined,
    NodeTelemetryReported,
    RunnerStatusChanged,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId, new_instance_id
from exo.shared.types.state import InstanceRank
from exo.worker.downloads.disk_space import DiskSpace
from exo.worker.downloads.sources import model_sources
from exo.worker.telemetry import read_telemetry, telemetry_changed
from exo.worker.worker import Worker, publish_local_models

EVENT_LOG_NAME = "events.log"
# How often the models directories are looked at for folders added while running.
MODEL_FOLDERS_SCAN_SECONDS = 2.0


class NodeStartupError(RuntimeError):
    """The node cannot start (port taken, model missing); the message says why."""


@dataclass(frozen=True)
class NodeConfig:
    host: str
    api_port: int
    data_dir: Path
    models_dir: Path
    model_id: ModelId | None  # served from the start; None: only what is placed here
    prefix_cache_bytes: int
    sse_keepalive_seconds: float
    prefix_cache_disk_bytes: int = 0
    model_aliases: tuple[ModelAlias, ...] = ()
    api_key: str | None = None  # None: the API is open to whoever reaches it
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 52414
    peers: tuple[str, ...] = ()
    cluster_secret: str = ""
    force_master: bool = False
    worker: bool = True
    api: bool = True
    discovery: bool = True
    timing: LinkTiming = field(default_factory=LinkTiming)
    read_only_models_dirs: tuple[Path, ...] = ()
    min_free_disk_bytes: int | None = None  # None: 1 GiB or 5 % of the disk
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    # A client that takes no bytes of an answer, or sends none of its request,
    # this long is cut off (`exo.api.http_server`).
    client_stall_seconds: float = DEFAULT_CLIENT_STALL_SECONDS
    # Speculative decoding (prompt-lookup drafts) in this node's runners.
    speculation: bool = True
    # A small model drafting for the models this node serves whole (`--draft-model`).
    draft_model: ModelId | None = None
    # A second port of the HTTP API, where `/` answers as Ollama's server does.
    ollama_port: int | None = None
    # How the API chooses among a model's replicas (`exo.api.routing`).
    routing: RoutingPolicy = "cache-aware"
    # How long a request lost before its first token is retried (`exo.api.reply_retry`).
    retry_seconds: float = DEFAULT_RETRY_SECONDS
    # Images that requests give by http(s) URL are fetched (`exo.api.images`);
    # False (--no-fetch-images): such a request is a 400.
    fetch_images: bool = True

    def model_store(self) -> ModelStore:
        return ModelStore(self.models_dir, self.read_only_models_dirs)


def _bind(host: str, port: int, flag: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise NodeStartupError(
            f"cannot listen on {host}:{port} ({error.strerror}); "
            f"is another exo (or Ollama) running? Choose another port with {flag}"
        ) from error
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _model_layers(config: NodeConfig, store: ModelStore) -> int:
    """The layer count of this node's model; fails at start-up, with a clear
    message, if this node cannot serve it."""
    assert config.model_id is not None
    try:
        path = store.resolve(config.model_id)
        return card_from_folder(config.model_id, path).n_layers
    except (
        ModelUnavailable,
        BuiltinModelMissing,
        GGUFImportError,
        ModelCardError,
        OSError,
    ) as error:
        raise NodeStartupError(f"cannot serve {config.model_id}: {error}") from error


def _curl_example(base_url: str, model_id: str) -> str:
    return (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": '
        '[{"role": "user", "content": "What is the capital of France?"}]}\''
    )


def load_identity(data_dir: Path) -> NodeCertificate:
    """This node's certificate, whose key its id is a digest of: made once, kept
    in the data dir so that a restart is the same node."""
    certificate = NodeCertificate.load_or_create(data_dir / "tls")
    # An older exo kept a random id here; the certificate's replaces it.
    old = data_dir / "node_id"
    if old.exists():
        logger.warning(
            f"this node's id is now {certificate.node_id}, its certificate's "
            f"(it was {old.read_text().strip()!r}: other nodes time that id out)"
        )
        old.unlink()
    return certificate


def _open_store(node_id: NodeId, data_dir: Path) -> EventStore:
    try:
        return EventStore(node_id, EventLog.open(data_dir / EVENT_LOG_NAME))
    except (EventLogCorrupted, SnapshotCorrupted) as error:
        raise NodeStartupError(f"the event log is damaged: {error}") from error


def _advertised_host(host: str) -> str:
    """The address peers dial: the bound one, or for a wildcard bind this
    machine's first LAN address (the same one mDNS advertises)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return default_advertised_addresses()[0]


def _api_address(config: NodeConfig, advertised: str) -> str | None:
    """Where other nodes reach this node's API (to relay requests for its models):
    None when they cannot, an API bound to loopback behind a link that is not."""
    if not config.api:
        return None
    if config.host in ("0.0.0.0", "::", ""):
        return f"{advertised}:{config.api_port}"
    if is_loopback_address(config.host) and not is_loopback_address(advertised):
        return None  # on another machine, this address is that machine
    return f"{config.host}:{config.api_port}"


async def _watch_model_folders(
    link: ClusterLink,
    models: ModelStore,
    publish_models: Callable[[Collection[str] | None], Awaitable[None]],
) -> None:
    """Tell the cluster about model folders put into the models directories while
    the node runs, once a folder has stopped changing for a scan (a copy in
    progress waits), unless the cluster knows the model already (a download
    here writes into its folder)."""
    previous = await anyio.to_thread.run_sync(models.folders_signature)
    tried = previous
    while True:
        await anyio.sleep(MODEL_FOLDERS_SCAN_SECONDS)
        now = await anyio.to_thread.run_sync(models.folders_signature)
        settled, previous = now & previous, now
        new = {
            name
            for name, _ in settled - tried
            if name.replace("--", "/", 1) not in link.state.cards
        }
        tried = tried | settled
        if new:
            await publish_models(new)


async def _keep_this_node_in_the_state(
    config: NodeConfig,
    link: ClusterLink,
    joined: NodeJoined,
    stale: frozenset[InstanceId],
    n_layers: int,
    publish_models: Callable[[], Awaitable[None]],
) -> None:
    """Report telemetry (when it changed materially); ask for an instance of this
    node's model once joined; and rejoin (asking again) after the master timed
    this node out (or it took the master's history after a partition), telling
    again which models it has: a timeout took them out of the state, and
    without them no instance with a rank here would start on the other nodes."""
    telemetry_every = config.timing.node_timeout_seconds / 4
    heartbeat = config.timing.heartbeat_seconds
    wanted = config.model_id if config.worker else None
    last_join = time.monotonic()
    last_telemetry = -math.inf  # the first report goes out at once
    while True:
        now = time.monotonic()
        if now - last_telemetry >= telemetry_every:
            telemetry = await anyio.to_thread.run_sync(
                read_telemetry, config.models_dir, config.worker, link.store.fault
            )
            known = link.state.nodes.get(link.node_id)
            if telemetry_changed(known.telemetry if known else None, telemetry):
                link.publish(NodeTelemetryReported(node_id=link.node_id, telemetry=telemetry))
            last_telemetry = now
        state = link.state
        if link.master_id is not None and link.node_id not in state.nodes:
            if now - last_join > telemetry_every:  # the join of a moment ago may be in flight
                logger.warning("this node is missing from the cluster state; rejoining")
                link.publish(joined)
                await publish_models()
                last_join = now
                wanted = config.model_id if config.worker else None
        elif (
            wanted is not None
            and link.master_id is not None
            and not stale & state.instances.keys()  # the old ones are deleted first
        ):
            mine = [i for i in state.instances.values() if link.node_id in i.node_ids]
            if not any(i.model_id == wanted for i in mine):
                rank = InstanceRank(node_id=link.node_id, start_layer=0, end_layer=n_layers)
                try:
                    await link.send_command(
                        CreateInstance(
                            instance_id=new_instance_id(), model_id=wanted, ranks=(rank,)
                        )
                    )
                except ClusterUnavailable as error:
                    logger.warning(f"could not place {wanted} on this node yet: {error}")
                    await anyio.sleep(heartbeat)
                    continue  # asked again once a master answers
                except CommandRejected as error:
                    logger.warning(f"could not place {wanted} on this node: {error}")
            wanted = None
        await anyio.sleep(heartbeat)


async def run_node(config: NodeConfig) -> None:
    try:
        lock = DataDirLock.acquire(config.data_dir)
    except DataDirInUse as error:
        raise NodeStartupError(str(error)) from error
    with lock:  # held for the node's life: one process owns the data dir
        await _run_node(config)


async def _run_node(config: NodeConfig) -> None:
    socks = [_bind(config.host, config.api_port, "--api-port")] if config.api else []
    if socks and config.ollama_port is not None:
        socks.append(_bind(config.host, config.ollama_port, "--ollama-port"))
    shown_host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    base_url = f"http://{shown_host}:{config.api_port}"
    certificate = load_identity(config.data_dir)
    node_id = certificate.node_id
    store = _open_store(node_id, config.data_dir)
    advertised = _advertised_host(config.grpc_host)
    models = config.model_store()
    master = Master(
        store,
        node_timeout_seconds=config.timing.node_timeout_seconds,
        duty_interval_seconds=config.timing.heartbeat_seconds,
        heard_ms=lambda: link.membership.heard_ms(),
    )
    link = ClusterLink(
        store,
        master,
        grpc_host=config.grpc_host,
        grpc_port=config.grpc_port,
        advertised_host=advertised,
        secret=config.cluster_secret,
        static_peers=list(config.peers),
        timing=config.timing,
        certificate=certificate,
        force_master=config.force_master,
        discovering=config.discovery,
        model_store=models,
    )
    # Instances this node served before a restart are gone with their runners.
    stale = frozenset(i for i, inst in store.state.instances.items() if node_id in inst.node_ids)
    # A single-rank one is deleted (the node asks for its --model again); a rank
    # of a ring fails, so the master places the whole instance again.
    for instance_id in sorted(stale):
        if len(store.state.instances[instance_id].ranks) == 1:
            link.publish(InstanceDeleted(instance_id=instance_id))
        else:
            link.publish(
                RunnerStatusChanged(
                    instance_id=instance_id,
                    node_id=node_id,
                    status="failed",
                    error="the node restarted",
                )
            )
    n_layers = 0
    if config.worker and config.model_id is not None:
        logger.info(f"preparing model {config.model_id} in {config.models_dir}")
        n_layers = await anyio.to_thread.run_sync(_model_layers, config, models)

    def announce(model_id: ModelId) -> None:
        logger.info(f"ready: {model_id} is serving at {base_url}/v1")

    # Downloads and fetched tokenizers reserve their space against one floor.
    disk_space = DiskSpace(config.min_free_disk_bytes)
    worker = (
        Worker(
            link,
            models,
            config.data_dir / "cache",
            config.prefix_cache_bytes,
            config.cluster_secret,
            prefix_cache_disk_bytes=config.prefix_cache_disk_bytes,
            on_ready=announce,
            stale=stale,
            disk_space=disk_space,
            speculation=config.speculation,
            draft_model=config.draft_model,
        )
        if config.worker
        else None
    )
    async with anyio.create_task_group() as group:
        group.start_soon(store.run)  # fsyncs the event log off the event loop
        group.start_soon(release_free_memory_periodically)
        await group.start(_run_link, link)
        group.start_soon(master.run)  # its duties, while this node is master
        joined = NodeJoined(
            node_id=node_id,
            grpc_address=link.address,
            api_address=_api_address(config, advertised),
            started_at_ms=now_ms(),
            hostname=socket.gethostname() or None,
        )
        link.publish(joined)  # first: events about this node's instances need the node

        async def publish_models(only: Collection[str] | None = None) -> None:
            if worker is not None:
                await worker.publish_local_models(only)
            else:
                await publish_local_models(link, models, only)

        await publish_models()
        if config.discovery:
            discovery = MdnsDiscovery(
                node_id,
                config.grpc_port,
                addresses=None if config.grpc_host in ("0.0.0.0", "") else [advertised],
            )
            group.start_soon(discovery.run, lambda peer: link.add_peer_address(peer.address))
        group.start_soon(
            _keep_this_node_in_the_state, config, link, joined, stale, n_layers, publish_models
        )
        group.start_soon(_watch_model_folders, link, models, publish_models)
        if worker is not None:
            group.start_soon(worker.run)
        served_models = worker.served if worker else {}
        routing_tokenizers = RoutingTokenizers(
            link,
            models,
            config.data_dir / "routing-tokenizers",
            lambda model_id: model_sources(
                link.state, model_id, node_id, config.cluster_secret, certificate
            ),
            disk_space,
        )
        if socks and config.routing == "cache-aware":
            group.start_soon(routing_tokenizers.run)
        try:
            if socks:
                access = APIAccess.for_bind(config.host, config.api_key)
                if access.open_to_the_network:
                    logger.warning(
                        f"the API on {config.host}:{config.api_port} is open to anyone on the "
                        "network: set --api-key, or --host 127.0.0.1 to keep it on this machine"
                    )
                app = create_app(
                    served_models,
                    link,
                    config.sse_keepalive_seconds,
                    worker.delete_model_files if worker else None,
                    config.model_aliases,
                    limits=config.admission,
                    access=access,
                    routing=config.routing,
                    retry_seconds=config.retry_seconds,
                    fetch_images=config.fetch_images,
                    routing_model=routing_tokenizers.get,
                )
                served = (
                    app if config.ollama_port is None else with_ollama_root(app, config.ollama_port)
                )
                server = api_server(served, config.client_stall_seconds)
                logger.info(f"API listening on {base_url} (dashboard: {base_url}/)")
                if config.ollama_port is not None:
                    logger.info(f"Ollama API also on http://{shown_host}:{config.ollama_port}")
                if worker is not None and config.model_id is not None:
                    logger.info(f"try:\n  {_curl_example(base_url, config.model_id)}")
                await server.serve(sockets=socks)
            else:
                await anyio.sleep_forever()
        finally:
            logger.info("shutting down")
            group.cancel_scope.cancel()


async def _run_link(link: ClusterLink, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    await link.run(on_ready=task_status.started)
