"""`GET /metrics`: the node's serving in Prometheus' text format.

Counters and histograms are kept as requests go (`MetricsMiddleware` counts
requests by API, route and status; the generation service reports first tokens,
token gaps, token counts and how replies end through `observe_generation`).
Gauges and the runners' own counters are read when Prometheus scrapes: queue
depth and in-flight requests from admission control, runner status and prefix
cache counters from the runners, download bytes from the cluster state.

Every app has its own registry, so several apps in one process never collide.
"""

import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, get_args

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.admission import Admission
from exo.shared.cluster_view import ClusterView
from exo.shared.types.ids import ModelId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.tasks import Usage
from exo.worker.served_model import ServedModel

# API and label of the routes requests are counted under; any other path is "other"
# (unbounded label values would grow the registry with every mistyped URL).
API_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/responses": "responses",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/models": "openai",
    "/api/chat": "ollama",
    "/api/generate": "ollama",
    "/api/tags": "ollama",
    "/api/show": "ollama",
    "/api/ps": "ollama",
    "/api/version": "ollama",
    "/api/pull": "ollama",
}
# From a cached one-token reply to a long prefill on a large model.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# From a small model on a fast machine to a large one across a slow ring.
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


def route_labels(path: str) -> tuple[str, str]:
    """(api, route) of a request path."""
    api = API_ROUTES.get(path)
    return (api, path) if api is not None else ("other", "other")


class _ScrapedState(Collector):
    """What is read at scrape time: admission, runners, downloads."""

    def __init__(
        self, models: Mapping[ModelId, ServedModel], cluster: ClusterView, admission: Admission
    ) -> None:
        self.models = models
        self.cluster = cluster
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "exo_queue_depth", "Requests waiting for a slot of the model", labels=["model"]
        )
        running = GaugeMetricFamily(
            "exo_requests_in_flight",
            "Generations holding a slot of the model (its batch, up to --max-concurrent)",
            labels=["model"],
        )
        for model_id, gate in sorted(self.admission.gates.items()):
            queued.add_metric([model_id], gate.queued)
            running.add_metric([model_id], gate.running)
        yield queued
        yield running
        yield from self._runners()
        yield from self._downloads()

    def _runners(self) -> Iterator[Metric]:
        status = GaugeMetricFamily(
            "exo_runner_status", "1 for the runner's current status", labels=["model", "status"]
        )
        cache = {
            name: CounterMetricFamily(f"exo_prefix_cache_{name}", help, labels=["model"])
            for name, help in (
                ("lookups", "Prefix cache lookups"),
                ("hits", "Lookups that reused cached KV (exact or partial)"),
                ("misses", "Lookups that reused nothing"),
                ("tokens_reused", "Prompt tokens served from the cache"),
                ("evictions", "Entries evicted"),
            )
        }
        sizes = {
            name: GaugeMetricFamily(f"exo_prefix_cache_{name}", help, labels=["model"])
            for name, help in (
                ("bytes", "Bytes of KV held in memory"),
                ("byte_budget", "Memory budget of the cache in bytes"),
                ("entries", "Entries in memory"),
                ("disk_bytes", "Bytes of KV on disk"),
            )
        }
        for model_id, model in sorted(self.models.items()):
            for value in get_args(RunnerStatus):
                status.add_metric([model_id, value], float(model.runner.status == value))
            stats = model.runner.cache_stats
            if stats is None:
                continue
            cache["lookups"].add_metric([model_id], stats.lookups)
            cache["hits"].add_metric([model_id], stats.hits_exact + stats.hits_partial)
            cache["misses"].add_metric([model_id], stats.misses)
            cache["tokens_reused"].add_metric([model_id], stats.tokens_reused)
            cache["evictions"].add_metric([model_id], stats.evictions)
            sizes["bytes"].add_metric([model_id], stats.bytes)
            sizes["byte_budget"].add_metric([model_id], stats.byte_budget)
            sizes["entries"].add_metric([model_id], stats.entries)
            sizes["disk_bytes"].add_metric([model_id], stats.disk_bytes)
        yield status
        yield from cache.values()
        yield from sizes.values()

    def _downloads(self) -> Iterator[Metric]:
        done = GaugeMetricFamily(
            "exo_download_bytes", "Bytes of the model this node has", labels=["model", "status"]
        )
        total = GaugeMetricFamily(
            "exo_download_size_bytes", "Bytes of the model this node needs", labels=["model"]
        )
        mine = self.cluster.state.downloads.get(self.cluster.node_id, {})
        for model_id, progress in sorted(mine.items()):
            done.add_metric([model_id, progress.status], progress.bytes_done)
            total.add_metric([model_id], progress.bytes_total)
        yield done
        yield total


@dataclass
class GenerationObserver:
    """Times one generation: its first token and the gaps between the next ones."""

    metrics: "ServingMetrics"
    model_id: ModelId
    started: float
    last_chunk: float | None = None

    def chunk(self) -> None:
        now = time.monotonic()
        if self.last_chunk is None:
            self.metrics.time_to_first_token.labels(self.model_id).observe(now - self.started)
        else:
            self.metrics.inter_token_latency.labels(self.model_id).observe(now - self.last_chunk)
        self.last_chunk = now

    def finished(self, finish_reason: str, usage: Usage) -> None:
        m, model = self.metrics, self.model_id
        m.generations.labels(model, finish_reason).inc()
        m.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        m.generated_tokens.labels(model).inc(usage.completion_tokens)
        m.cached_tokens.labels(model).inc(usage.cached_tokens)
        m.drafted_tokens.labels(model).inc(usage.drafted_tokens)
        m.accepted_draft_tokens.labels(model).inc(usage.accepted_draft_tokens)

    def ended_early(self, reason: Literal["error", "cancelled"]) -> None:
        """It failed, or its client went away."""
        self.metrics.generations.labels(self.model_id, reason).inc()


class ServingMetrics:
    def __init__(
        self, models: Mapping[ModelId, ServedModel], cluster: ClusterView, admission: Admission
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "exo_requests", "HTTP requests by API, route and status", ["api", "route", "status"],
            registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "exo_time_to_first_token_seconds",
            "From a request reaching the generation service (queue wait and prefill "
            "included) to its first streamed text",
            ["model"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "exo_inter_token_latency_seconds",
            "Gap between consecutive pieces of a reply's text (one per decode step)",
            ["model"], buckets=INTER_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.generations = Counter(
            "exo_generations", "Generations by how they ended", ["model", "finish_reason"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "exo_prompt_tokens", "Prompt tokens of finished generations", ["model"], registry=r
        )
        self.generated_tokens = Counter(
            "exo_generated_tokens", "Tokens generated", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "exo_cached_tokens", "Prompt tokens reused from the prefix cache", ["model"],
            registry=r,
        )  # fmt: skip
        self.drafted_tokens = Counter(
            "exo_drafted_tokens", "Draft tokens speculative decoding checked", ["model"],
            registry=r,
        )  # fmt: skip
        self.accepted_draft_tokens = Counter(
            "exo_accepted_draft_tokens", "Draft tokens the model accepted", ["model"],
            registry=r,
        )  # fmt: skip
        self.routed = Counter(
            "exo_routed_requests",
            "Requests this node sent to a replica of the model, by why (cache, load, "
            "least-loaded, round-robin, only) and where (this node, another)",
            ["model", "reason", "target"], registry=r,
        )  # fmt: skip
        self.routed_cached_tokens = Counter(
            "exo_routed_expected_cached_tokens",
            "Prompt tokens the chosen replica was expected to have cached",
            ["model"], registry=r,
        )  # fmt: skip
        self.retried = Counter(
            "exo_retried_requests",
            "Requests run again after their runner or node was lost before their first "
            "token, by where (here: this node's runner restarted; rerouted: another "
            "instance or node)",
            ["model", "where"], registry=r,
        )  # fmt: skip
        r.register(_ScrapedState(models, cluster, admission))

    def observer(self, model_id: ModelId) -> GenerationObserver:
        return GenerationObserver(self, model_id, time.monotonic())

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


_current: ContextVar[ServingMetrics | None] = ContextVar("exo_metrics", default=None)


def observe_route(model_id: ModelId, reason: str, local: bool, cached_tokens: int) -> None:
    """Count where the current request was routed (nothing outside an app)."""
    metrics = _current.get()
    if metrics is not None:
        target = "local" if local else "remote"
        metrics.routed.labels(model_id, reason, target).inc()
        metrics.routed_cached_tokens.labels(model_id).inc(cached_tokens)


def observe_retry(model_id: ModelId, where: Literal["here", "rerouted"] = "here") -> None:
    """Count a request run again before its first token (nothing outside an app)."""
    metrics = _current.get()
    if metrics is not None:
        metrics.retried.labels(model_id, where).inc()


def observe_generation(model_id: ModelId) -> GenerationObserver | None:
    """An observer of the current request's generation; None outside an app."""
    metrics = _current.get()
    return metrics.observer(model_id) if metrics is not None else None


class MetricsMiddleware:
    """Counts every HTTP request by API, route and status, and makes the app's
    metrics reach the generation service."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets when the app fails before answering

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        token = _current.set(self.metrics)
        try:
            await self.app(scope, receive, sending)
        finally:
            _current.reset(token)
            api, route = route_labels(str(scope["path"]))
            self.metrics.requests.labels(api, route, str(status)).inc()
