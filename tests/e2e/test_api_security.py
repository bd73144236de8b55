"""End to end: a real `exo` process with `--api-key`, used by the official
`openai`, `anthropic` and `ollama` clients, and its API and cluster link on separate binds."""

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from playwright.sync_api import expect

from exo.cluster.discovery import default_advertised_addresses
from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import PageErrors, headless_chromium
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = pytest.mark.slow

KEY = "e2e-api-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[NodeProcess]:
    with running_node(
        tmp_path_factory.mktemp("node"), models_dir, "--api-key", KEY, "--grpc-host", "0.0.0.0"
    ) as started:
        yield started


def _openai(node: NodeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key=key, timeout=120, max_retries=0)


def _anthropic(node: NodeProcess, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.base_url, api_key=key, timeout=120, max_retries=0)


def test_the_openai_client_with_the_key_is_answered(node: NodeProcess) -> None:
    reply = _openai(node, KEY).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in (reply.choices[0].message.content or "")


def test_the_openai_client_with_a_wrong_key_is_refused(node: NodeProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        _openai(node, "wrong").models.list()
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"


def test_the_anthropic_client_with_the_key_is_answered(node: NodeProcess) -> None:
    reply = _anthropic(node, KEY).messages.create(
        model=DEFAULT_MODEL_ID,
        max_tokens=30,
        messages=QUESTION,
        extra_body={"temperature": 0},
    )
    assert any("Paris" in block.text for block in reply.content if block.type == "text")


def test_the_anthropic_client_with_a_wrong_key_is_refused(node: NodeProcess) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _anthropic(node, "wrong").messages.create(
            model=DEFAULT_MODEL_ID, max_tokens=5, messages=QUESTION
        )
    assert refused.value.status_code == 401
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_the_ollama_client_with_the_key_is_answered(node: NodeProcess) -> None:
    reply = ollama.Client(host=node.base_url, headers=BEARER, timeout=120).chat(
        model=DEFAULT_MODEL_ID, messages=QUESTION, options={"temperature": 0, "num_predict": 30}
    )
    assert "Paris" in (reply.message.content or "")


def test_the_ollama_client_with_a_wrong_key_is_refused(node: NodeProcess) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=node.base_url, headers={"Authorization": "Bearer wrong"}).list()
    assert refused.value.status_code == 401
    assert "API key" in refused.value.error


@pytest.mark.parametrize(
    "path", ["/cluster", "/state", "/metrics", "/v1/models", "/events", "/api/tags"]
)
def test_every_route_needs_the_key(node: NodeProcess, path: str) -> None:
    assert httpx.get(f"{node.base_url}{path}", timeout=5).status_code == 401


@pytest.mark.parametrize("path", ["/health", "/", "/dashboard/api.js"])
def test_health_and_the_dashboard_page_need_no_key(node: NodeProcess, path: str) -> None:
    assert httpx.get(f"{node.base_url}{path}", timeout=5).status_code == 200


def test_metrics_and_events_answer_with_the_key(node: NodeProcess) -> None:
    metrics = httpx.get(f"{node.base_url}/metrics", headers=BEARER, timeout=5)
    assert metrics.status_code == 200 and "exo_" in metrics.text
    with httpx.stream(
        "GET", f"{node.base_url}/events", headers={"x-api-key": KEY}, timeout=10
    ) as events:
        assert events.status_code == 200
        first = next(line for line in events.iter_lines() if line.startswith("data: "))
    assert "idx" in json.loads(first[6:])


def test_a_rebound_host_is_refused(node: NodeProcess) -> None:
    """A page whose DNS name now points at 127.0.0.1 still sends its own Host."""
    response = httpx.get(
        f"{node.base_url}/v1/models", headers={**BEARER, "Host": "rebind.example:80"}, timeout=5
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden_host"
    cross_site = httpx.post(
        f"{node.base_url}/v1/messages",
        headers={**BEARER, "Origin": "https://evil.example"},
        json={"model": DEFAULT_MODEL_ID, "max_tokens": 1, "messages": []},
        timeout=5,
    )
    assert cross_site.status_code == 403
    assert cross_site.json()["error"]["type"] == "permission_error"


def test_a_loopback_api_leaves_the_cluster_link_on_the_network(node: NodeProcess) -> None:
    """`--host 127.0.0.1` binds the API only; the cluster link binds --grpc-host (0.0.0.0)."""
    lan = default_advertised_addresses()[0]
    if lan == "127.0.0.1":
        pytest.skip("this machine has no network address other than loopback")
    cluster = httpx.get(f"{node.base_url}/cluster", headers=BEARER, timeout=5).json()
    host, port = cluster["address"].rsplit(":", 1)
    assert host == lan
    # Other machines cannot reach this API, so it is not offered for relays.
    state = httpx.get(f"{node.base_url}/state", headers=BEARER, timeout=5).json()
    assert state["nodes"][cluster["node_id"]]["api_address"] is None
    with socket.create_connection((lan, int(port)), timeout=5):
        pass  # the link answers on the network
    api_port = int(node.base_url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((lan, api_port), timeout=5).close()


def test_the_dashboard_asks_for_the_key_once_and_keeps_it(node: NodeProcess) -> None:
    with headless_chromium() as browser:
        page = browser.new_page()
        errors = PageErrors(page)
        page.goto(node.base_url)
        expect(page.locator("#key-form")).to_be_visible(timeout=30_000)
        page.fill("#key-input", KEY)
        page.click("#key-form button[type=submit]")
        cards = page.locator(".node-card")
        expect(cards).to_have_count(1, timeout=30_000)
        expect(page.locator("#key-form")).to_be_hidden()
        page.reload()  # the key stays in the browser
        expect(cards).to_have_count(1, timeout=30_000)
        expect(page.locator("#key-form")).to_be_hidden()
        # Only the refused requests before the key was given may have logged errors.
        assert all("401" in line for line in errors.seen), errors.seen
