"""HTTP endpoints that place, watch and delete instances, and manage this node's
model files.

Each route is a function of what it reads and acts on (the cluster, the hub,
this node's model files), testable without a server; `instance_routes` only
wires them to paths."""

import difflib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from exo.api.errors import APIError, invalid
from exo.master.placement import PlacementError, PlacementRequest, preview
from exo.models.cards import ModelCardError
from exo.models.file_source import DownloadError, FileSource, SourceUnavailable, TransientError
from exo.models.hub_card import card_from_source
from exo.models.store import InvalidModelId, validate_model_id
from exo.shared.cluster_view import ClusterView
from exo.shared.types.commands import (
    ClusterUnavailable,
    Command,
    CommandRejected,
    CreateInstance,
    DeleteInstance,
    PlaceInstance,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId, new_instance_id
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import Instance, InstanceRank, Sharding, State
from exo.worker.downloads.hub import OFFLINE_ADVICE

HUB_CARD_TIMEOUT_SECONDS = 60.0
# How long POST /place_instance waits for the new instance to show in the state.
PLACED_WAIT_SECONDS = 10.0
AWAIT_DEFAULT_TIMEOUT_SECONDS = 600.0
MAX_AWAIT_TIMEOUT_SECONDS = 86_400.0
AWAIT_KEEPALIVE_SECONDS = 10.0
MAX_REPLICAS = 64

# Deletes this node's copy of a model; False when it has no writable copy.
DeleteModelFiles = Callable[[ModelId], Awaitable[bool]]


class InstanceRequest(BaseModel):
    model_id: str
    node_id: str | None = None


class PlaceRequest(BaseModel):
    model_id: str
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)
    # "tensor": every node a slice of every layer (at least 2 nodes).
    sharding: Sharding = "pipeline"
    # Instances of the model to place, each on nodes of its own (all or none).
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    # Exactly these ranks (one of `GET /instance/previews`' placements), rather
    # than the best placement the master finds.
    ranks: tuple[InstanceRank, ...] | None = Field(default=None, min_length=1)


def model_id_param(value: str, param: str = "model_id") -> ModelId:
    try:
        return validate_model_id(value)
    except InvalidModelId as error:
        raise invalid(str(error), param) from error


def instance_view(state: State, instance: Instance) -> dict[str, Any]:
    """An instance with its status and each rank's runner and download."""
    runners = state.runners.get(instance.instance_id, {})
    ranks = []
    for rank in instance.ranks:
        runner = runners.get(rank.node_id)
        download = state.downloads.get(rank.node_id, {}).get(instance.model_id)
        ranks.append(
            {
                **rank.model_dump(mode="json"),
                "runner": runner.model_dump(mode="json") if runner else None,
                "download": download.model_dump(mode="json", exclude={"have_files"})
                if download
                else None,
            }
        )
    return {
        "instance_id": instance.instance_id,
        "model_id": instance.model_id,
        "status": state.instance_status(instance),
        "sharding": instance.sharding,
        "ring_hosts": list(instance.ring_hosts),
        "ranks": ranks,
        # Set when the master placed the model again after a failure: from where, why.
        "moved": instance.moved.model_dump(mode="json") if instance.moved else None,
    }


async def send_command(cluster: ClusterView, command: Command) -> int:
    """Send `command`; the index of its last event, or an API error."""
    try:
        return await cluster.send_command(command)
    except CommandRejected as error:
        code = "not_found" if error.not_found else "invalid_request"
        raise APIError(
            404 if error.not_found else 400, str(error), "invalid_request_error", code
        ) from error
    except ClusterUnavailable as error:
        raise APIError(503, str(error), "server_error", "cluster_unavailable") from error


def close_model_ids(model_id: str, known: Iterable[str]) -> list[str]:
    """The known model ids `model_id` may be a typo of, closest first (a short
    name matches its id's last part: "smollm2-135m-instruc" -> SmolLM2-135M-Instruct)."""
    by_name: dict[str, str] = {}
    for known_id in sorted(known):
        by_name.setdefault(known_id.lower(), known_id)
        by_name.setdefault(known_id.rsplit("/", 1)[-1].lower(), known_id)
    wanted = model_id.lower()
    names = difflib.get_close_matches(wanted, by_name, n=6, cutoff=0.75)
    names += difflib.get_close_matches(wanted.rsplit("/", 1)[-1], by_name, n=6, cutoff=0.75)
    return list(dict.fromkeys(by_name[name] for name in names))[:3]


def _did_you_mean(model_id: str, known: Iterable[str]) -> str:
    close = close_model_ids(model_id, known)
    return f"did you mean {' or '.join(close)}? " if close else ""


async def known_card(state: State, model_id: ModelId, hub: FileSource | None) -> ModelCard:
    """The model's card: from the state, else from the hub (None: the hub is
    off). An id close to a model the cluster knows that is not a hub id
    (`org/name`) is a typo: "did you mean …?", without asking the hub."""
    card = state.cards.get(model_id)
    if card is not None:
        return card
    where = "a node's models directory (or a read-only one: EXO_MODELS_READ_ONLY_DIRS)"
    suggestion = _did_you_mean(model_id, state.cards)

    def not_found(why: str) -> APIError:
        return APIError(
            404,
            f"no node has model {model_id!r}{why}: {suggestion}"
            f"to serve it, put its folder in {where}",
            "invalid_request_error",
            "model_not_found",
            "model_id",
        )

    if hub is None or (suggestion and "/" not in model_id):
        known = ", ".join(sorted(state.cards)) or "none"
        raise not_found(f" (models the cluster knows: {known})")
    try:
        with anyio.fail_after(HUB_CARD_TIMEOUT_SECONDS):
            return await card_from_source(hub, model_id)
    except SourceUnavailable as error:
        raise not_found(f" and the hub does not either ({error})") from error
    except TransientError as error:
        raise APIError(503, f"{suggestion}{error}", "server_error", "hub_unavailable") from error
    except TimeoutError as error:
        raise APIError(
            503,
            f"{suggestion}the Hugging Face hub did not answer within "
            f"{HUB_CARD_TIMEOUT_SECONDS:.0f}s; {OFFLINE_ADVICE}",
            "server_error",
            "hub_unavailable",
        ) from error
    except (DownloadError, ModelCardError) as error:
        raise invalid(f"cannot describe {model_id}: {error}", code="bad_model") from error


async def placed(cluster: ClusterView, instance_id: InstanceId, last_idx: int) -> dict[str, Any]:
    """The instance once this node applied the command's last event (bounded wait)."""
    await cluster.wait_until(last_idx, PLACED_WAIT_SECONDS)
    instance = cluster.state.instances.get(instance_id)
    if instance is None:
        return {"instance_id": instance_id, "status": "placed"}
    return instance_view(cluster.state, instance)


def check_fits_on(state: State, node_id: NodeId, card: ModelCard) -> None:
    """The RAM check `POST /place_instance` makes (`placement.preview`), for the
    one node a whole model is created on; a node the state does not know (or
    has no memory of yet) is the master's to refuse."""
    node = state.nodes.get(node_id)
    if node is None or node.telemetry is None:
        return
    alone = state.model_copy(update={"nodes": {node_id: node}})
    try:
        preview(card, alone, PlacementRequest(max_nodes=1))
    except PlacementError as error:
        raise invalid(str(error), "node_id", "placement_infeasible") from error


async def create_instance(
    cluster: ClusterView, hub: FileSource | None, body: InstanceRequest
) -> dict[str, Any]:
    """Serve a whole model on one node (this one by default)."""
    model_id = model_id_param(body.model_id)
    card = await known_card(cluster.state, model_id, hub)
    node = NodeId(body.node_id) if body.node_id else cluster.node_id
    check_fits_on(cluster.state, node, card)
    instance_id = new_instance_id()
    rank = InstanceRank(node_id=node, start_layer=0, end_layer=card.n_layers)
    last_idx = await send_command(
        cluster,
        CreateInstance(instance_id=instance_id, model_id=model_id, ranks=(rank,), card=card),
    )
    return await placed(cluster, instance_id, last_idx)


async def place_instance(
    cluster: ClusterView, hub: FileSource | None, body: PlaceRequest
) -> dict[str, Any]:
    """Let the master place a model across the cluster's nodes; their workers
    fetch what their ranks need, then start the runners."""
    model_id = model_id_param(body.model_id)
    card = await known_card(cluster.state, model_id, hub)
    instance_id = new_instance_id()
    if body.ranks is not None and body.replicas > 1:
        raise invalid("ranks place one instance: leave replicas out, or the ranks", "replicas")
    if body.ranks is not None:  # a previewed placement, as it was shown
        last_idx = await send_command(
            cluster,
            CreateInstance(
                instance_id=instance_id,
                model_id=model_id,
                ranks=body.ranks,
                sharding=body.sharding,
                card=card,
            ),
        )
        return await placed(cluster, instance_id, last_idx)
    replica_ids = tuple(new_instance_id() for _ in range(body.replicas - 1))
    last_idx = await send_command(
        cluster,
        PlaceInstance(
            instance_id=instance_id,
            model_id=model_id,
            min_nodes=body.min_nodes,
            max_nodes=body.max_nodes,
            sharding=body.sharding,
            card=card,  # the master publishes it with the instance if it is new
            replica_ids=replica_ids,
            replicas=body.replicas,
        ),
    )
    first = await placed(cluster, instance_id, last_idx)
    if not replica_ids:
        return first
    # Each replica as one instance is shown (the first's fields at the top, as before).
    return {
        **first,
        "replicas": [first, *[await placed(cluster, i, last_idx) for i in replica_ids]],
    }


async def instance_previews(
    state: State,
    hub: FileSource | None,
    model_id: str,
    min_nodes: int = 1,
    max_nodes: int | None = None,
    sharding: Sharding = "pipeline",
) -> dict[str, Any]:
    """Every feasible placement of a model on the cluster with `sharding`, best
    first, or why none fits. Each says its `sharding` and per node the RAM its
    rank needs (`memory_bytes`), split into weights as loaded (`weight_bytes`)
    and the cache reserve of its layers (`kv_bytes`).

    Reads the state only: a hub model's card serves the preview here and reaches
    the cluster when the model is placed (a GET changes nothing)."""
    card = await known_card(state, model_id_param(model_id), hub)
    try:
        request = PlacementRequest(min_nodes=min_nodes, max_nodes=max_nodes, sharding=sharding)
    except ValidationError as error:
        raise invalid(
            "the number of nodes asked for (at least, at most) must be 1 or more",
            code="placement_infeasible",
        ) from error
    try:
        placements = preview(card, state, request)
    except PlacementError as error:
        raise invalid(str(error), code="placement_infeasible") from error
    return {
        "model_id": card.model_id,
        "sharding": sharding,
        "placements": [p.model_dump(mode="json") for p in placements],
    }


def list_instances(state: State) -> dict[str, Any]:
    return {"data": [instance_view(state, i) for _, i in sorted(state.instances.items())]}


async def delete_instance(cluster: ClusterView, instance_id: str) -> dict[str, str]:
    """Stop serving an instance: its runners shut down and unfinished
    downloads stop (partial files are kept for a later resume)."""
    await send_command(cluster, DeleteInstance(instance_id=InstanceId(instance_id)))
    return {"deleted": instance_id}


def await_instance(cluster: ClusterView, model_id: str, timeout: float) -> StreamingResponse:
    """SSE: the model's instance status (and download progress) as it changes,
    ending with `ready`, `failed` or `timeout`."""
    model = model_id_param(model_id)
    if not 0 < timeout <= MAX_AWAIT_TIMEOUT_SECONDS:
        raise invalid(
            f"timeout must be > 0 and at most {MAX_AWAIT_TIMEOUT_SECONDS:.0f} seconds", "timeout"
        )
    if not any(i.model_id == model for i in cluster.state.instances.values()):
        raise APIError(
            404,
            f"no instance of {model!r}: place it first (POST /place_instance)",
            "invalid_request_error",
            "instance_not_found",
            "model_id",
        )
    return StreamingResponse(
        instance_updates(cluster, model, timeout), media_type="text/event-stream"
    )


async def instance_updates(
    cluster: ClusterView, model: ModelId, timeout: float
) -> AsyncIterator[str]:
    """The SSE events of `await_instance`: one per change of the model's
    instances, keep-alives between, until a final status or `timeout`."""
    deadline = time.monotonic() + timeout
    last: str | None = None
    last_sent = time.monotonic()
    while True:
        state = cluster.state
        views = [instance_view(state, i) for i in state.instances.values() if i.model_id == model]
        ready = [v for v in views if v["status"] in ("ready", "running")]
        status = (
            "ready"
            if ready
            else "failed"
            if views and all(v["status"] == "failed" for v in views)
            else "gone"
            if not views
            else "waiting"
        )
        payload = json.dumps({"status": status, "instances": ready or views})
        if payload != last:
            yield f"data: {payload}\n\n"
            last, last_sent = payload, time.monotonic()
        elif time.monotonic() - last_sent >= AWAIT_KEEPALIVE_SECONDS:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        if status != "waiting":
            return
        if time.monotonic() >= deadline:
            yield f"data: {json.dumps({'status': 'timeout', 'instances': views})}\n\n"
            return
        # Until the next event is applied (the status changes only then),
        # the deadline or a keep-alive is due.
        wake_at = min(deadline, last_sent + AWAIT_KEEPALIVE_SECONDS)
        await cluster.wait_until(state.last_idx + 1, max(0.0, wake_at - time.monotonic()))


async def delete_model(
    cluster: ClusterView, delete_model_files: DeleteModelFiles | None, model_id: str
) -> dict[str, Any]:
    """Delete this node's copy of a model (refused while an instance here uses it)."""
    model = model_id_param(model_id)
    if delete_model_files is None:
        raise APIError(404, "this node keeps no models", "invalid_request_error", "not_found")
    users = [
        i.instance_id
        for i in cluster.state.instances.values()
        if i.model_id == model and cluster.node_id in i.node_ids
    ]
    if users:
        raise APIError(
            409,
            f"{model} is in use here by instance {', '.join(users)}; delete it first",
            "invalid_request_error",
            "model_in_use",
        )
    if not await delete_model_files(model):
        raise APIError(
            404, f"no writable copy of {model} here", "invalid_request_error", "not_found"
        )
    return {"deleted": model, "node_id": cluster.node_id}


def instance_routes(
    cluster: ClusterView,
    hub: FileSource | None,
    delete_model_files: DeleteModelFiles | None = None,
) -> APIRouter:
    """The routes above at their paths. `hub`: where cards of models no node
    has come from (None: nowhere); `delete_model_files`: None on a node that
    keeps no models."""
    router = APIRouter()

    @router.post("/instance", status_code=201)
    async def _create_instance(body: InstanceRequest) -> dict[str, Any]:
        return await create_instance(cluster, hub, body)

    @router.post("/place_instance", status_code=201)
    async def _place_instance(body: PlaceRequest) -> dict[str, Any]:
        return await place_instance(cluster, hub, body)

    @router.get("/instance/previews")
    async def _instance_previews(
        model_id: str,
        min_nodes: int = 1,
        max_nodes: int | None = None,
        sharding: Sharding = "pipeline",
    ) -> dict[str, Any]:
        return await instance_previews(cluster.state, hub, model_id, min_nodes, max_nodes, sharding)

    @router.get("/instances")
    async def _list_instances() -> dict[str, Any]:
        return list_instances(cluster.state)

    @router.delete("/instance/{instance_id}")
    async def _delete_instance(instance_id: str) -> dict[str, str]:
        return await delete_instance(cluster, instance_id)

    @router.get("/instance/await")
    async def _await_instance(
        model_id: str, timeout: float = AWAIT_DEFAULT_TIMEOUT_SECONDS
    ) -> StreamingResponse:
        return await_instance(cluster, model_id, timeout)

    @router.delete("/models/{model_id:path}")
    async def _delete_model(model_id: str) -> dict[str, Any]:
        return await delete_model(cluster, delete_model_files, model_id)

    return router
