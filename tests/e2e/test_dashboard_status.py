"""The dashboard tells the truth about nodes, keys and placing, in a real
browser (headless Chromium) against two real nodes: A (open, the master) and
B (with an API key, only B). A SIGKILLed node shows as unreachable within
seconds and its "last heard" counts up; B's own page, once B is dead, greys
out and links to A's dashboard; the key prompt names the node that asked and
says when a key was refused; Enter in the model field previews and does not
place, and any previewed option can be placed. Screenshots go to
docs/screenshots/, as in test_dashboard.py."""

import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import PageErrors, headless_chromium
from tests.e2e.node_process import NodeProcess, start_node
from tests.e2e.test_dashboard import VIEWPORT, shoot, show
from tests.integration.cluster_process import NODE_TIMEOUT, SECRET, Cluster, wait_until

pytestmark = pytest.mark.slow

KEY = "b-only-key"


def get(node: NodeProcess, path: str, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{node.base_url}{path}", headers=headers, timeout=5)
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A (master, open, with the built-in model's files) and B (an API key)."""
    tmp_path = tmp_path_factory.mktemp("dashboard-status")
    cluster = Cluster(tmp_path, models_dir)
    b: NodeProcess | None = None
    try:
        a = cluster.start(0, "--force-master", model="none")
        b = start_node(
            tmp_path,
            tmp_path / "models-b",
            "--peers", cluster.peers,
            "--cluster-secret", SECRET,
            "--node-timeout-seconds", NODE_TIMEOUT,
            "--api-key", KEY,
            model="none",
            data_dir=tmp_path / "node1",
            grpc_port=cluster.ports[1],
        )  # fmt: skip
        cluster.nodes.append(b)

        def both_ready() -> bool:
            states = [get(a, "/state"), get(b, "/state", KEY)]
            return all(
                len(s["nodes"]) == 2 and all(n["telemetry"] for n in s["nodes"].values())
                for s in states
            )

        wait_until(both_ready, 90, "two nodes with telemetry, seen by both")
        yield a, b
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    expect.set_options(timeout=15_000)
    with headless_chromium() as started:
        yield started


def node_id(node: NodeProcess, key: str | None = None) -> str:
    return str(get(node, "/node_id", key))


def test_the_key_prompt_names_the_node_and_says_when_a_key_is_refused(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    _, b = nodes
    b_id = node_id(b, KEY)
    address = b.base_url.removeprefix("http://")
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(f"{b.base_url}/")
    prompt = page.locator("#key-form")
    expect(prompt).to_be_visible()
    expect(prompt).to_have_attribute("data-reason", "missing")
    # Before a key, the node's id and host name come from its 401.
    host = socket.gethostname()
    why = page.locator("#key-why")
    expect(why).to_contain_text(f"Node {b_id} ({host}) at {address} needs an API key")
    shoot(page, "key-prompt")

    page.fill("#key-input", "a wrong key")
    page.click("#key-form button[type=submit]")
    expect(prompt).to_have_attribute("data-reason", "refused")
    expect(why).to_contain_text(f"The key was refused: node {b_id} ({host}) at {address} does not")
    expect(page.locator("#key-forget")).to_be_visible()  # a saved key can be forgotten

    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    expect(page.locator(".node-card")).to_have_count(2)
    expect(prompt).to_be_hidden()
    card = page.locator(f".node-card[data-node-id={b_id}]")
    expect(card).to_contain_text(host)  # host names beside the ids
    expect(card.locator(".badge.this-node")).to_have_count(1)
    # The saved key can be changed or forgotten from the top bar.
    page.click("#key-button")
    expect(page.locator("#key-forget")).to_be_visible()
    page.click("#key-forget")
    expect(prompt).to_have_attribute("data-reason", "missing")
    assert page.evaluate("localStorage.getItem('exo.apiKey')") is None
    page.close()


def test_a_401_relayed_from_another_node_names_that_node(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    """A's dashboard asks A, which relays to B (the serving node), whose key
    differs: the prompt says that it was B that refused the key A accepted."""
    a, b = nodes
    b_address = b.base_url.removeprefix("http://")
    relayed = {
        "error": {
            "message": f"the node at {b_address} that serves {DEFAULT_MODEL_ID} refused the "
            "API key that this node accepted: the nodes' API keys differ",
            "type": "invalid_request_error",
            "code": "relayed_invalid_api_key",
        }
    }

    def refuse(route: Route) -> None:
        route.fulfill(status=401, json=relayed)

    page = browser.new_page(viewport=VIEWPORT)
    page.goto(f"{a.base_url}/")
    expect(page.locator(".node-card")).to_have_count(2)
    page.evaluate("localStorage.setItem('exo.apiKey', 'a key A accepts')")
    page.route(lambda url: url.endswith("/v1/chat/completions"), refuse)
    page.evaluate(
        """() => import("/dashboard/api.js").then((m) => m.api("/v1/chat/completions",
             { method: "POST", body: {} }).catch(() => null))"""
    )
    why = page.locator("#key-why")
    expect(page.locator("#key-form")).to_have_attribute("data-reason", "relayed")
    expect(why).to_contain_text("The key was refused by node")
    expect(why).to_contain_text(f"at {b_address}, the node serving this model")
    expect(why).to_contain_text("the nodes' API keys differ")
    page.evaluate("localStorage.removeItem('exo.apiKey')")
    page.close()


def test_enter_in_the_model_field_previews_and_any_option_can_be_placed(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    a, _ = nodes
    page = browser.new_page(viewport=VIEWPORT)
    errors = PageErrors(page)
    page.goto(f"{a.base_url}/#models")
    show(page, "models")
    page.fill("#model-id", DEFAULT_MODEL_ID)
    page.press("#model-id", "Enter")
    options = page.locator("#previews [data-preview]")
    expect(options.first).to_be_visible()
    assert options.count() >= 2  # A alone, B alone, both
    time.sleep(1)  # a placement would show within this
    assert get(a, "/instances")["data"] == []  # Enter placed nothing
    expect(page.locator("#instances [data-instance-id]")).to_have_count(0)
    shoot(page, "models-enter-previews")

    # "Place this one" places that option as shown (the request is caught here:
    # loading the model is test_dashboard.py's).
    sent: list[dict[str, Any]] = []

    def place(route: Route) -> None:
        sent.append(json.loads(route.request.post_data or "{}"))
        route.fulfill(status=201, json={"instance_id": "i-second", "status": "placed"})

    page.route(lambda url: url.endswith("/place_instance"), place)
    second = options.nth(1)
    shown = [span.get_attribute("title") for span in second.locator(".layer-bar span").all()]
    second.locator("[data-place-option]").click()
    expect(page.locator("#place-message.ok")).to_contain_text("option 2")
    [body] = sent
    assert body["model_id"] == DEFAULT_MODEL_ID
    assert [r["node_id"] for r in body["ranks"]] == shown
    assert errors.seen == [], errors.seen
    page.close()


def test_a_model_whose_lost_instance_is_not_placed_again_shows_why(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    """The node's real `/state`, with two models the master recorded as unplaced
    (one still waited for, one given up on): each gets a card that says why.
    Losing an instance for real is the chaos and soak tests'."""
    a, _ = nodes
    a_id = node_id(a)
    lost = {
        "instance_id": "i-lost",
        "model_id": "org/waiting",
        "ranks": [{"node_id": a_id, "start_layer": 0, "end_layer": 30}],
    }
    now = int(time.time() * 1000)
    unplaced = {
        "org/waiting": {"instance": lost, "since_ms": now - 5000,
                        "reason": "no node has 2.0 GiB free", "given_up": False},
        "org/stopped": {"instance": {**lost, "model_id": "org/stopped"}, "since_ms": now - 5000,
                        "reason": "its runners failed before serving 3 times in 10 minutes",
                        "given_up": True},
    }  # fmt: skip

    def with_unplaced(route: Route) -> None:
        state = route.fetch().json()
        route.fulfill(json={**state, "unplaced": unplaced})

    page = browser.new_page(viewport=VIEWPORT)
    errors = PageErrors(page)
    page.route(lambda url: url.endswith("/state"), with_unplaced)
    page.goto(f"{a.base_url}/#models")
    show(page, "models")
    waiting = page.locator("#instances [data-unplaced='org/waiting']")
    expect(waiting).to_have_attribute("data-status", "waiting for a node")
    expect(waiting).to_contain_text("placed again as soon as a node can take it")
    expect(waiting).to_contain_text("no node has 2.0 GiB free")
    expect(waiting).to_contain_text("s ago")
    stopped = page.locator("#instances [data-unplaced='org/stopped']")
    expect(stopped).to_have_attribute("data-status", "not placed")
    expect(stopped.locator(".error")).to_contain_text("stopped placing it again")
    shoot(page, "models-unplaced")
    assert errors.seen == [], errors.seen
    page.close()


def test_a_killed_node_is_unreachable_at_once_and_its_own_page_links_elsewhere(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    """The last test: B is SIGKILLed. A's page shows it unreachable within 3 s,
    its "last heard" counting up, then timed out, kept until forgotten; B's own
    page greys out what it knew and links to A's dashboard."""
    a, b = nodes
    a_id, b_id = node_id(a), node_id(b, KEY)
    on_a = browser.new_page(viewport=VIEWPORT)
    on_a.goto(f"{a.base_url}/#topology")
    b_card = on_a.locator(f".node-card[data-node-id={b_id}]")
    expect(b_card).to_have_attribute("data-status", "ready")
    # A healthy idle peer is heard every second: it never looks stale.
    heard = b_card.locator("[data-last-heard]")
    time.sleep(3)
    assert _seconds(heard.text_content()) <= 3, heard.text_content()

    on_b = browser.new_page(viewport=VIEWPORT)
    on_b.add_init_script(f"localStorage.setItem('exo.apiKey', {json.dumps(KEY)})")
    on_b.goto(f"{b.base_url}/#topology")
    expect(on_b.locator(".node-card")).to_have_count(2)

    b.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    b.process.wait(10)
    expect(b_card).to_have_attribute("data-status", "unreachable", timeout=3_000)
    assert time.monotonic() - killed < 3.5
    expect(on_a.locator(f"#topology-svg g.node.unreachable[data-node-id={b_id}]")).to_have_count(1)
    expect(b_card).to_contain_text("The master cannot reach this node")
    shoot(on_a, "status-unreachable")

    # "last heard" counts up on screen (redrawn every second: 3.2 s make 2 more).
    first = _seconds(heard.text_content())
    time.sleep(3.2)
    assert _seconds(heard.text_content()) >= first + 2, (first, heard.text_content())

    # B's own page: greyed out, with a link to A's dashboard.
    banner = on_b.locator("#link-error")
    expect(banner).to_contain_text("cannot be reached", timeout=10_000)
    link = banner.locator(f"a.other-dashboard[data-node-id={a_id}]")
    expect(link).to_have_attribute("href", f"{a.base_url}/")
    expect(on_b.locator("body.stale")).to_have_count(1)
    shoot(on_b, "status-own-node-down")

    # Timed out, B stays visible as gone (a reload too) until forgotten.
    expect(b_card).to_have_attribute("data-status", "timed out", timeout=20_000)
    on_a.reload()
    expect(b_card).to_have_attribute("data-status", "timed out")
    assert b_id in get(a, "/state")["gone_nodes"]
    b_card.locator("[data-forget-node]").click()
    expect(b_card).to_have_count(0)
    assert get(a, "/state")["gone_nodes"] == {}
    on_a.close()
    on_b.close()


def _seconds(text: str | None) -> int:
    """ "12 s ago" -> 12 (a minute or more is more than any wait here)."""
    assert text and text.endswith(" s ago"), text
    return int(text.split()[0])
