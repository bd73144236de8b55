"""The HTTP API of a node: the OpenAI, Anthropic, Responses and Ollama generation
routes, instances and placement, the cluster's state and events, and the dashboard."""

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from exo.api.admission import (
    Admission,
    AdmissionLimits,
    AdmissionMiddleware,
    BodyLimitMiddleware,
)
from exo.api.anthropic_routes import anthropic_routes
from exo.api.auth import AccessMiddleware, APIAccess
from exo.api.dashboard import dashboard_routes
from exo.api.errors import install_error_handlers, invalid
from exo.api.instances import instance_routes, send_command
from exo.api.metrics import MetricsMiddleware, ServingMetrics
from exo.api.model_alias import ModelAlias
from exo.api.ollama_routes import ollama_routes
from exo.api.openai_routes import openai_routes
from exo.api.reply_retry import DEFAULT_RETRY_SECONDS
from exo.api.responses_routes import responses_routes
from exo.api.routing import RoutingPolicy
from exo.api.routing_tokenizers import RoutingModel
from exo.api.serving import ModelRouter, relay_read_timeout
from exo.shared.cluster_view import ClusterView
from exo.shared.event_store import now_ms
from exo.shared.replica_reports import report_load
from exo.shared.types.commands import ForgetNode
from exo.shared.types.ids import ModelId, NodeId
from exo.worker.downloads.hub import HubSource, hub_enabled
from exo.worker.served_model import ServedModel

KEEPALIVE_SECONDS = 10.0


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def node_label(cluster: ClusterView) -> str:
    """ "node 3f2a9c1b (studio.local)": this node as messages name it."""
    info = cluster.state.nodes.get(cluster.node_id)
    host = info.hostname if info else None
    return f"node {cluster.node_id}" + (f" ({host})" if host else "")


def create_app(
    models: dict[ModelId, ServedModel],
    cluster: ClusterView,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
    delete_model_files: Callable[[ModelId], Awaitable[bool]] | None = None,
    aliases: Sequence[ModelAlias] = (),
    limits: AdmissionLimits | None = None,
    access: APIAccess | None = None,
    routing: RoutingPolicy = "cache-aware",
    retry_seconds: float = DEFAULT_RETRY_SECONDS,
    fetch_images: bool = True,
    routing_model: Callable[[ModelId], RoutingModel | None] = lambda model_id: None,
) -> FastAPI:
    app = FastAPI(title="exo", version="0.1.0")
    install_error_handlers(app)
    limits = limits or AdmissionLimits()
    admission = Admission(
        limits, on_load=lambda model_id, load, wait: report_load(cluster, model_id, load, wait)
    )
    metrics = ServingMetrics(models, cluster, admission)
    # The last added runs first: count every request, refuse those without
    # access, refuse large bodies before anything reads them, then admission
    # for the generation routes.
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(
        AccessMiddleware, access=access or APIAccess(), node_label=lambda: node_label(cluster)
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    router = ModelRouter(
        models,
        cluster,
        aliases,
        relay_read_timeout_seconds=relay_read_timeout(keepalive_seconds),
        policy=routing,
        local_load=admission.load,
        slots=limits.max_concurrent,
        retry_seconds=retry_seconds,
        fetch_images=fetch_images,
        routing_model=routing_model,
    )
    app.include_router(openai_routes(router, keepalive_seconds))
    app.include_router(anthropic_routes(router, keepalive_seconds))
    app.include_router(responses_routes(router, keepalive_seconds))

    hub = HubSource() if hub_enabled() else None
    app.include_router(ollama_routes(router, hub, keepalive_seconds))
    app.include_router(instance_routes(cluster, hub, delete_model_files))

    app.include_router(dashboard_routes())

    @app.get("/cluster")
    async def cluster_info() -> dict[str, Any]:
        """This node's view of the cluster link: who is master, where the log
        resumed, and when its link last heard each peer (`heard_ms`, wall-clock
        ms, with this node's clock as `now_ms`: heartbeats are not events)."""
        return {
            "node_id": cluster.node_id,
            "address": cluster.address,
            "master_id": cluster.master_id,
            "resumed_from_idx": cluster.resumed_from_idx,
            "last_applied_idx": cluster.state.last_idx,
            "now_ms": now_ms(),
            "heard_ms": dict(cluster.heard_ms()),
        }

    @app.delete("/nodes/{node_id}")
    async def forget_node(node_id: str) -> dict[str, str]:
        """Forget a node that timed out (the dashboard keeps such nodes visible
        as gone until a user forgets them); a node still in the cluster is a 400."""
        await send_command(cluster, ForgetNode(node_id=NodeId(node_id)))
        return {"forgotten": node_id}

    @app.get("/v1/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        return {
            "data": [
                {
                    "model": m.model_id,
                    "runner_status": m.runner.status,
                    **(m.runner.cache_stats.model_dump() if m.runner.cache_stats else {}),
                }
                for m in models.values()
            ]
        }

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus' text format: requests, queues, latencies, tokens, caches."""
        return metrics.response()

    @app.get("/node_id")
    async def node_id() -> str:
        return cluster.node_id

    @app.get("/state")
    async def state() -> dict[str, Any]:
        return cluster.state.model_dump(mode="json")

    @app.get("/events")
    async def events(from_idx: int = 0) -> StreamingResponse:
        """SSE of indexed events from `from_idx`: the history, then live events."""
        if from_idx < 0:
            raise invalid("from_idx must be >= 0", "from_idx")

        async def stream() -> AsyncIterator[str]:
            async for indexed in cluster.subscribe(from_idx):
                yield f"id: {indexed.idx}\n" + _sse(indexed.model_dump(mode="json"))

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        fault = cluster.event_log_error
        return {
            # degraded: the node serves, but cannot record events (a full disk)
            "status": "ok" if fault is None else "degraded",
            "event_log_error": fault,
            "runners": {
                m.model_id: {
                    "status": m.runner.status,
                    "error": m.runner.error,
                    "restarts": m.runner.restarts,
                }
                for m in models.values()
            },
        }

    return app
