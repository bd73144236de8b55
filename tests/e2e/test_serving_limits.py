"""Serving many clients, end to end: admission (429, 413), /metrics, and relays
that time out on a frozen node and cancel the generation of a client that left."""

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node
from tests.integration.cluster_process import Cluster, wait_until

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 64 * 1024
KEEPALIVE_SECONDS = 1.0
RELAY_READ_TIMEOUT = 3 * KEEPALIVE_SECONDS  # what the relaying node derives
# How long the relaying node waits for another replica after a failed relay.
RETRY_SECONDS = 2.0
# Greedy continuation of a count: a generation that runs for as long as the test needs.
COUNTING: dict[str, Any] = {
    "model": DEFAULT_MODEL_ID,
    "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "max_tokens": 2000,
    "temperature": 0,
    "stream": True,
}
SHORT_CHAT: dict[str, Any] = {
    "model": DEFAULT_MODEL_ID,
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 4,
    "temperature": 0,
}
SHORT_MESSAGE: dict[str, Any] = {**SHORT_CHAT, "max_tokens": 4}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[NodeProcess]:
    """One slot, one place in the queue, small bodies."""
    with running_node(
        tmp_path_factory.mktemp("limits"),
        models_dir,
        "--max-concurrent", "1",
        "--max-queued", "1",
        "--max-body-bytes", str(MAX_BODY_BYTES),
        "--sse-keepalive-seconds", str(KEEPALIVE_SECONDS),
    ) as started:  # fmt: skip
        yield started


@contextmanager
def streaming(base_url: str, body: dict[str, Any] = COUNTING) -> Iterator[httpx.Response]:
    """A streaming completion; leaving the block disconnects its client."""
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{base_url}/v1/completions", json=body) as response,
    ):
        yield response


def samples(node: NodeProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{node.base_url}/metrics", timeout=5).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(node: NodeProcess, name: str, **labels: str) -> float:
    return samples(node).get((name, frozenset(labels.items())), 0.0)


def test_requests_beyond_the_queue_get_429_with_retry_after(node: NodeProcess) -> None:
    queued: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: queued.append(
            httpx.post(f"{node.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=60)
        )
    )
    with streaming(node.base_url) as running:
        assert running.status_code == 200  # it holds the only slot
        waiter.start()
        wait_until(
            lambda: metric(node, "exo_queue_depth", model=DEFAULT_MODEL_ID) == 1,
            10,
            "the second request waiting in the queue",
        )
        assert metric(node, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 1

        refused = httpx.post(f"{node.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=10)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"

        anthropic = httpx.post(f"{node.base_url}/v1/messages", json=SHORT_MESSAGE, timeout=10)
        assert anthropic.status_code == 429
        assert "retry-after" in anthropic.headers
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
    # The client left: its slot goes to the waiting request, which is answered.
    waiter.join(60)
    assert [r.status_code for r in queued] == [200]
    assert metric(node, "exo_queue_depth", model=DEFAULT_MODEL_ID) == 0


@pytest.mark.parametrize(
    ("path", "body", "error_type"),
    [
        ("/v1/chat/completions", SHORT_CHAT, "invalid_request_error"),
        ("/v1/messages", SHORT_MESSAGE, "request_too_large"),
    ],
)
def test_a_body_2_mib_over_the_limit_gets_413(
    node: NodeProcess, path: str, body: dict[str, Any], error_type: str
) -> None:
    padding = "x" * (MAX_BODY_BYTES + 2 * 1024 * 1024)
    huge = {**body, "messages": [{"role": "user", "content": padding}]}
    started = time.monotonic()
    response = httpx.post(f"{node.base_url}{path}", json=huge, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == error_type
    assert time.monotonic() - started < 10
    # A body within the limit is served as before.
    assert httpx.post(f"{node.base_url}{path}", json=body, timeout=60).status_code == 200


def test_metrics_parse_and_move_with_a_request(node: NodeProcess) -> None:
    before = samples(node)
    reply = httpx.post(f"{node.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=60)
    assert reply.status_code == 200
    usage = reply.json()["usage"]
    after = samples(node)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    route = {"api": "openai", "route": "/v1/chat/completions", "status": "200"}
    assert delta("exo_requests_total", **route) == 1
    model = {"model": DEFAULT_MODEL_ID}
    assert delta("exo_prompt_tokens_total", **model) == usage["prompt_tokens"]
    assert delta("exo_generated_tokens_total", **model) == usage["completion_tokens"]
    assert delta("exo_time_to_first_token_seconds_count", **model) == 1
    assert delta("exo_inter_token_latency_seconds_count", **model) >= 1
    assert delta("exo_prefix_cache_lookups_total", **model) >= 1
    finish = reply.json()["choices"][0]["finish_reason"]
    assert delta("exo_generations_total", finish_reason=finish, **model) == 1
    assert after[("exo_runner_status", frozenset({**model, "status": "ready"}.items()))] == 1
    assert after[("exo_requests_in_flight", frozenset(model.items()))] == 0
    # The built-in model is local (imported, not downloaded): complete, 0 bytes fetched.
    assert ("exo_download_bytes", frozenset({**model, "status": "complete"}.items())) in after


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    """Node 0 serves the model (one slot, no queue); node 1 only relays."""
    started = Cluster(tmp_path_factory.mktemp("relay"), models_dir)
    # Long enough that the master does not drop the frozen node during a test.
    common = (
        "--sse-keepalive-seconds", str(KEEPALIVE_SECONDS),
        "--node-timeout-seconds", "60",
        "--retry-seconds", str(RETRY_SECONDS),
    )  # fmt: skip
    try:
        serving = started.start(
            0, *common, "--max-concurrent", "1", "--max-queued", "0", model=DEFAULT_MODEL_ID
        )
        serving.wait_for_runner("ready")
        relaying = started.start(1, *common)
        wait_until(
            lambda: relaying.get("/v1/models")["data"][0]["status"] == "ready",
            60,
            "the relaying node seeing the model served",
        )
        yield started
    finally:
        started.stop()


def test_a_client_leaving_a_relayed_stream_frees_the_serving_runner(cluster: Cluster) -> None:
    serving, relaying = cluster.nodes
    with streaming(relaying.base_url) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert metric(serving, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 1
    wait_until(
        lambda: (
            metric(serving, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 0
            and serving.runner_status() == "ready"
        ),
        10,
        "the serving node freeing its only slot",
    )
    started = time.monotonic()
    reply = httpx.post(f"{relaying.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=30)
    assert reply.status_code == 200  # not 429: the slot is free
    assert time.monotonic() - started < 15
    assert (
        metric(serving, "exo_generations_total", model=DEFAULT_MODEL_ID, finish_reason="cancelled")
        == 1
    )


def test_a_relay_to_a_frozen_node_ends_within_the_bound_with_a_clear_error(
    cluster: Cluster,
) -> None:
    serving, relaying = cluster.nodes
    answers: dict[str, httpx.Response] = {}

    def ask(path: str, body: dict[str, Any]) -> None:
        answers[path] = httpx.post(f"{relaying.base_url}{path}", json=body, timeout=60)

    askers = [
        threading.Thread(target=ask, args=("/v1/chat/completions", {**SHORT_CHAT, "stream": True})),
        threading.Thread(target=ask, args=("/v1/messages", SHORT_MESSAGE)),
    ]
    serving.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(60)
        elapsed = time.monotonic() - started
    finally:
        serving.process.send_signal(signal.SIGCONT)
    # A liveness check every read timeout, each bounded by it: two periods at
    # most; then no other replica comes within the retry bound.
    assert elapsed < 2 * RELAY_READ_TIMEOUT + RETRY_SECONDS + 3
    # A 504, or, where the master's link lost the frozen node meanwhile (and
    # no other node can take its model), a 503 that says the model waits to be
    # placed again, with Retry-After.
    openai_answer, anthropic_answer = answers["/v1/chat/completions"], answers["/v1/messages"]
    openai_error = openai_answer.json()["error"]
    assert (openai_answer.status_code, openai_error["code"]) in {
        (504, "relay_timeout"),
        (503, "model_not_ready"),
    }, openai_error
    assert {504: "timeout_error", 503: "overloaded_error"}[anthropic_answer.status_code] == (
        anthropic_answer.json()["error"]["type"]
    )
    for answer in (openai_answer, anthropic_answer):
        if answer.status_code == 503:
            assert "placed again as soon as a node can take it" in answer.text
            assert answer.headers["retry-after"] == "2"
    # The model serves through the relaying node again: on the thawed node, or,
    # where the link lost it meanwhile, where the master placed it again.
    wait_until(
        lambda: (
            httpx.post(
                f"{relaying.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=60
            ).status_code
            == 200
        ),
        90,
        "the model serving again",
    )
