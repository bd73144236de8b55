"""HTTP endpoints that place, watch and delete instances, and manage this node's
model files."""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from exo.api.errors import APIError
from exo.master.placement import PlacementError, PlacementRequest, preview
from exo.models.cards import ModelCardError
from exo.models.file_source import DownloadError, SourceUnavailable, TransientError
from exo.models.hub_card import card_from_source
from exo.models.store import InvalidModelId, validate_model_id
from exo.shared.cluster_view import ClusterView
from exo.shared.types.commands import Command, CreateInstance, DeleteInstance, PlaceInstance
from exo.shared.types.events import ModelCardPublished
from exo.shared.types.ids import InstanceId, ModelId, NodeId, new_instance_id
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import Instance, InstanceRank, State
from exo.worker.downloads.hub import HubSource, hub_enabled

HUB_CARD_TIMEOUT_SECONDS = 60.0
# How long POST /place_instance waits for the new instance to show in the state.
PLACED_WAIT_SECONDS = 10.0
AWAIT_DEFAULT_TIMEOUT_SECONDS = 600.0
MAX_AWAIT_TIMEOUT_SECONDS = 86_400.0
AWAIT_KEEPALIVE_SECONDS = 10.0


class InstanceRequest(BaseModel):
    model_id: str
    node_id: str | None = None


class PlaceRequest(BaseModel):
    model_id: str
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int | None = Field(default=None, ge=1)


def model_id_param(value: str, param: str = "model_id") -> ModelId:
    try:
        return validate_model_id(value)
    except InvalidModelId as error:
        raise APIError(
            400, str(error), "invalid_request_error", "invalid_request", param
        ) from error


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
        "ring_hosts": list(instance.ring_hosts),
        "ranks": ranks,
    }


def instance_routes(
    cluster: ClusterView,
    command: Callable[[Command], Awaitable[int]],
    delete_model_files: Callable[[ModelId], Awaitable[bool]] | None = None,
) -> APIRouter:
    router = APIRouter()

    async def known_card(model_id: ModelId) -> ModelCard:
        """The model's card: from the state, else from the hub."""
        card = cluster.state.cards.get(model_id)
        if card is not None:
            return card
        where = "a node's models directory (or a read-only one: EXO_MODELS_READ_ONLY_DIRS)"
        if not hub_enabled():
            raise APIError(
                404,
                f"no node has model {model_id!r} (models the cluster knows: "
                f"{', '.join(sorted(cluster.state.cards)) or 'none'}); put it in {where}",
                "invalid_request_error",
                "model_not_found",
                "model_id",
            )
        try:
            with anyio.fail_after(HUB_CARD_TIMEOUT_SECONDS):
                card = await card_from_source(HubSource(), model_id)
        except SourceUnavailable as error:
            raise APIError(
                404,
                f"no node has model {model_id!r} and the hub does not either ({error}); "
                f"put it in {where}",
                "invalid_request_error",
                "model_not_found",
                "model_id",
            ) from error
        except (TransientError, TimeoutError) as error:
            raise APIError(
                503, f"the hub is unreachable: {error}", "server_error", "hub_unavailable"
            ) from error
        except (DownloadError, ModelCardError) as error:
            raise APIError(
                400, f"cannot describe {model_id}: {error}", "invalid_request_error", "bad_model"
            ) from error
        return card

    async def placed(instance_id: InstanceId, last_idx: int) -> dict[str, Any]:
        """The instance once this node applied the command's last event (bounded wait)."""
        await cluster.wait_until(last_idx, PLACED_WAIT_SECONDS)
        instance = cluster.state.instances.get(instance_id)
        if instance is None:
            return {"instance_id": instance_id, "status": "placed"}
        return instance_view(cluster.state, instance)

    @router.post("/instance", status_code=201)
    async def create_instance(body: InstanceRequest) -> dict[str, Any]:
        """Serve a whole model on one node (this one by default)."""
        model_id = model_id_param(body.model_id)
        card = await known_card(model_id)
        node = NodeId(body.node_id) if body.node_id else cluster.node_id
        instance_id = new_instance_id()
        rank = InstanceRank(node_id=node, start_layer=0, end_layer=card.n_layers)
        last_idx = await command(
            CreateInstance(instance_id=instance_id, model_id=model_id, ranks=(rank,), card=card)
        )
        return await placed(instance_id, last_idx)

    @router.post("/place_instance", status_code=201)
    async def place_instance(body: PlaceRequest) -> dict[str, Any]:
        """Let the master place a model across the cluster's nodes; their workers
        fetch what their ranks need, then start the runners."""
        model_id = model_id_param(body.model_id)
        card = await known_card(model_id)
        instance_id = new_instance_id()
        last_idx = await command(
            PlaceInstance(
                instance_id=instance_id,
                model_id=model_id,
                min_nodes=body.min_nodes,
                max_nodes=body.max_nodes,
                card=card,  # the master publishes it with the instance if it is new
            )
        )
        return await placed(instance_id, last_idx)

    @router.get("/instance/previews")
    async def instance_previews(
        model_id: str, min_nodes: int = 1, max_nodes: int | None = None
    ) -> dict[str, Any]:
        """Every feasible placement of a model on the cluster, best first, or why none fits."""
        card = await known_card(model_id_param(model_id))
        if card.model_id not in cluster.state.cards:
            cluster.publish(ModelCardPublished(card=card))  # a hub model: the cluster knows it now
        try:
            request = PlacementRequest(min_nodes=min_nodes, max_nodes=max_nodes)
            placements = preview(card, cluster.state, request)
        except (PlacementError, ValidationError) as error:
            raise APIError(
                400, str(error), "invalid_request_error", "placement_infeasible"
            ) from error
        return {
            "model_id": card.model_id,
            "placements": [p.model_dump(mode="json") for p in placements],
        }

    @router.get("/instances")
    async def list_instances() -> dict[str, Any]:
        state = cluster.state
        return {"data": [instance_view(state, i) for _, i in sorted(state.instances.items())]}

    @router.delete("/instance/{instance_id}")
    async def delete_instance(instance_id: str) -> dict[str, str]:
        """Stop serving an instance: its runners shut down and unfinished
        downloads stop (partial files are kept for a later resume)."""
        await command(DeleteInstance(instance_id=InstanceId(instance_id)))
        return {"deleted": instance_id}

    @router.get("/instance/await")
    async def await_instance(
        model_id: str, timeout: float = AWAIT_DEFAULT_TIMEOUT_SECONDS
    ) -> StreamingResponse:
        """SSE: the model's instance status (and download progress) as it changes,
        ending with `ready`, `failed` or `timeout`."""
        model = model_id_param(model_id)
        if not 0 < timeout <= MAX_AWAIT_TIMEOUT_SECONDS:
            raise APIError(
                400,
                f"timeout must be > 0 and at most {MAX_AWAIT_TIMEOUT_SECONDS:.0f} seconds",
                "invalid_request_error",
                "invalid_request",
                "timeout",
            )
        if not any(i.model_id == model for i in cluster.state.instances.values()):
            raise APIError(
                404,
                f"no instance of {model!r}: place it first (POST /place_instance)",
                "invalid_request_error",
                "instance_not_found",
                "model_id",
            )

        async def stream() -> AsyncIterator[str]:
            deadline = time.monotonic() + timeout
            last: str | None = None
            last_sent = time.monotonic()
            while True:
                state = cluster.state
                views = [
                    instance_view(state, i) for i in state.instances.values() if i.model_id == model
                ]
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

        return StreamingResponse(stream(), media_type="text/event-stream")

    @router.delete("/models/{model_id:path}")
    async def delete_model(model_id: str) -> dict[str, Any]:
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

    return router
