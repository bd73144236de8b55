"""The dashboard in a real browser (headless Chromium) against two real nodes:
the topology, placing the built-in model across both nodes until it is ready,
a streamed chat whose second turn hits the prefix cache, the cache view, and
deleting the instance and a node's copy of the model, a node timing out;
failures as the API reports them. Each view's screenshot
goes to docs/screenshots/, which the README shows."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route, ViewportSize, expect

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import PageErrors, headless_chromium
from tests.e2e.node_process import NodeProcess
from tests.integration.cluster_process import Cluster, agreed, wait_until

pytestmark = pytest.mark.slow

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
VIEWPORT: ViewportSize = {"width": 1280, "height": 820}
READY_MS = 240_000  # B fetches the files it lacks, then both ranks load the model
# Records every runner and download status the instances list ever showed.
WATCH_RANKS = """() => {
  window.seenRanks = new Set();
  new MutationObserver(() => {
    for (const row of document.querySelectorAll("#instances [data-rank]")) {
      window.seenRanks.add(`runner ${row.dataset.runner}`);
      window.seenRanks.add(`download ${row.dataset.download}`);
    }
  }).observe(document.getElementById("instances"), { childList: true, subtree: true });
}"""


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """Two nodes serving nothing: A has the built-in model's files, B none."""
    tmp_path = tmp_path_factory.mktemp("dashboard")
    cluster = Cluster(tmp_path, models_dir)
    try:
        a = cluster.start(0, model="none")
        b = cluster.start(1, model="none", models_dir=tmp_path / "models-b")
        wait_until(lambda: agreed(cluster.nodes), 60, "two nodes agreeing")
        wait_until(
            lambda: all(n["telemetry"] for n in b.get("/state")["nodes"].values()),
            60, "both nodes' telemetry",
        )  # fmt: skip
        yield a, b
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Placing answers once the instance is in the state (up to 10 s) and nodes
    # share two cores here: waits for what the page shows get room.
    expect.set_options(timeout=30_000)
    with headless_chromium() as started:
        yield started


def shoot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


def show(page: Page, view: str) -> None:
    page.click(f"#tabs a[data-view={view}]")
    expect(page.locator(f"#view-{view}")).to_be_visible()


def check_topology(page: Page, a: NodeProcess, b: NodeProcess) -> None:
    state = a.get("/state")
    show(page, "topology")
    cards = page.locator(".node-card[data-status=ready]")
    expect(cards).to_have_count(2)
    for node in (a, b):
        node_id = node.get("/node_id")
        expect(page.locator(f"#topology-svg g.node[data-node-id={node_id}]")).to_have_count(1)
        expect(page.locator(f".node-card[data-node-id={node_id}]")).to_contain_text("RAM")
    expect(page.locator(".node-card[data-master]")).to_have_attribute(
        "data-node-id", state["master_id"]
    )
    expect(page.locator("#topology-svg .master-mark")).to_have_count(1)


def place_across_both(page: Page, a: NodeProcess) -> str:
    show(page, "models")
    page.fill("#model-id", DEFAULT_MODEL_ID)

    # Three nodes cannot be had: the API's reason shows in the view.
    page.fill("#min-nodes", "3")
    page.click("#preview-button")
    refused = httpx.get(
        f"{a.base_url}/instance/previews",
        params={"model_id": DEFAULT_MODEL_ID, "min_nodes": 3},
        timeout=10,
    )
    assert refused.status_code == 400
    expect(page.locator("#place-message.error")).to_contain_text(refused.json()["error"]["message"])

    page.fill("#min-nodes", "2")
    page.click("#preview-button")
    best = page.locator("#previews [data-preview='0']")
    expect(best.locator("tr")).to_have_count(3)  # a header and a rank per node
    expect(best).to_contain_text("memory needed")
    shoot(page, "placement-preview")

    page.evaluate(WATCH_RANKS)
    page.click("#place-button")
    instance = page.locator("#instances [data-instance-id]")
    expect(instance).to_have_count(1)
    expect(instance).to_have_attribute("data-status", "ready", timeout=READY_MS)
    seen = set(page.evaluate("[...window.seenRanks]"))
    # The view followed the ranks through their files and their runners' start.
    assert {"download complete", "runner ready"} <= seen, seen
    assert seen & {"runner starting", "runner loading"}, seen
    copied = page.locator("#instances [data-rank][data-download=complete]")
    expect(copied).to_have_count(2)
    for rank in range(2):  # where each node's files came from
        expect(copied.nth(rank)).to_contain_text("files · from ")
    shoot(page, "placement-ready")
    instance_id = instance.get_attribute("data-instance-id") or ""

    # The picture links the two nodes that serve the instance together.
    show(page, "topology")
    expect(page.locator(f"#topology-svg .link[data-instance-id='{instance_id}']")).to_have_count(1)
    expect(page.locator(".node-card", has_text="rank 1")).to_have_count(1)
    shoot(page, "topology")
    return instance_id


def ask(page: Page, text: str, turn: int) -> dict[str, str | None]:
    page.fill("#chat-text", text)
    page.press("#chat-text", "Enter")
    answer = page.locator(".turn.assistant").nth(turn)
    expect(answer).to_have_attribute("data-outcome", "done", timeout=120_000)
    return {
        "text": answer.locator(".text").text_content(),
        "meta": answer.locator(".meta").text_content(),
        "cached": answer.get_attribute("data-cached"),
    }


def chat(page: Page) -> None:
    show(page, "chat")
    expect(page.locator("#chat-model")).to_have_value(DEFAULT_MODEL_ID)
    page.fill("#chat-max-tokens", "16")
    first = ask(page, "What is the capital of France?", 0)
    assert first["text"], first
    assert "first token" in (first["meta"] or "") and "tokens/s" in (first["meta"] or ""), first
    # The second turn re-sends the first: the prefix cache serves it.
    second = ask(page, "And the capital of Italy?", 1)
    assert second["text"], second
    assert int(second["cached"] or 0) > 0, second
    assert f"cached {second['cached']} of" in (second["meta"] or ""), second
    shoot(page, "chat")

    # Stop ends a long answer early, keeping what came.
    page.fill("#chat-max-tokens", "400")
    page.fill("#chat-text", "Tell me a long story about a lighthouse.")
    page.press("#chat-text", "Enter")
    third = page.locator(".turn.assistant").nth(2)
    expect(third.locator(".text")).not_to_be_empty(timeout=120_000)
    page.click("#chat-stop")
    expect(third).to_have_attribute("data-outcome", "stopped")
    expect(page.locator("#chat-send")).to_be_visible()


def check_cache(page: Page) -> None:
    show(page, "cache")
    runner = page.locator(f".runner[data-model='{DEFAULT_MODEL_ID}']")
    expect(runner).to_have_count(1)
    expect(runner.locator("[data-stat=tokens-reused]")).not_to_have_text("0")
    expect(runner.locator(".chart polyline").first).to_be_attached()
    shoot(page, "cache")


def delete(page: Page, instance_id: str, b: NodeProcess) -> None:
    show(page, "models")
    page.click(f"[data-delete-instance='{instance_id}']")
    expect(page.locator("#instances [data-instance-id]")).to_have_count(0)
    wait_until(lambda: b.get("/instances")["data"] == [], 20, "the instance gone on B")

    # B's copy of the model (fetched for its rank) is deleted from B's own dashboard.
    page.goto(f"{b.base_url}/#models")
    b_id = b.get("/node_id")
    copy = page.locator(f"tr[data-model-id='{DEFAULT_MODEL_ID}'] .copy[data-node-id={b_id}]")
    expect(copy).to_have_count(1)
    copy.locator("[data-delete-copy]").click()
    # (the question is kept across the redraws that every state update makes)
    expect(copy.locator("[data-delete-copy][data-armed]")).to_have_text("Really delete?")
    copy.locator("[data-delete-copy]").click()  # the second click confirms
    expect(copy).to_have_count(0)


def check_timed_out(page: Page, a: NodeProcess, b: NodeProcess) -> None:
    """A node that stops shows as timed out once the master drops it."""
    page.goto(f"{a.base_url}/#topology")
    b_id = b.get("/node_id")
    expect(page.locator(f".node-card[data-node-id={b_id}]")).to_have_attribute(
        "data-status", "ready"
    )
    b.stop()
    expect(page.locator(f".node-card[data-node-id={b_id}]")).to_have_attribute(
        "data-status", "timed out"
    )
    expect(page.locator(f"#topology-svg g.node.timed-out[data-node-id={b_id}]")).to_have_count(1)


def refused_preview(error: str) -> bool:
    """Chromium logs the 400 of the refused preview, which the view shows."""
    return "status of 400" in error and "/instance/previews?" in error


def test_the_split_is_chosen_where_a_model_is_placed(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    """Asked for a tensor split on one node, the view shows the API's refusal;
    on two, SmolLM2's tensor preview: every layer on each node, its 3 KV heads
    split 2 and 1 (with their query heads)."""
    a, _ = nodes
    page = browser.new_page(viewport=VIEWPORT)
    errors = PageErrors(page)
    page.goto(f"{a.base_url}/#models")
    page.fill("#model-id", DEFAULT_MODEL_ID)
    page.select_option("#sharding", "tensor")
    page.fill("#max-nodes", "1")
    page.click("#preview-button")
    refused = httpx.get(
        f"{a.base_url}/instance/previews",
        params={"model_id": DEFAULT_MODEL_ID, "sharding": "tensor", "max_nodes": 1},
        timeout=10,
    )
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "a tensor instance needs at least 2 nodes" in message
    expect(page.locator("#place-message.error")).to_contain_text(message)

    page.fill("#max-nodes", "")
    page.click("#preview-button")
    best = page.locator("#previews [data-preview='0']")
    expect(best).to_have_attribute("data-sharding", "tensor")
    expect(best).to_contain_text("tensor · 2 nodes")
    expect(best.locator("tr")).to_have_count(3)
    expect(best.locator("tr").nth(1)).to_contain_text("all 30, 2 of 3 KV heads")
    expect(best.locator("tr").nth(2)).to_contain_text("all 30, 1 of 3 KV heads")
    assert [e for e in errors.seen if not refused_preview(e)] == [], errors.seen
    page.close()


def test_the_dashboard_places_chats_and_deletes_on_two_nodes(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    a, b = nodes
    page = browser.new_page(viewport=VIEWPORT)
    errors = PageErrors(page)
    page.goto(f"{a.base_url}/")

    check_topology(page, a, b)
    instance_id = place_across_both(page, a)

    # Requests and the cache stats are on the node of the first rank.
    [first_rank] = [i["ranks"][0] for i in a.get("/instances")["data"]]
    front = a if first_rank["node_id"] == a.get("/node_id") else b
    if front is not a:
        page.goto(f"{front.base_url}/#chat")
    chat(page)
    check_cache(page)
    delete(page, instance_id, b)
    check_timed_out(page, a, b)  # the last step: B is gone after it

    # A refused preview is an answer the page shows, not an error of the page.
    assert [e for e in errors.seen if not refused_preview(e)] == [], errors.seen
    page.close()


def test_failures_show_where_they_happen(
    nodes: tuple[NodeProcess, NodeProcess], browser: Browser
) -> None:
    """A failed runner and a failed download, as the API would report them, show
    their reasons in the instance's rank rows and in the node's copies."""
    a, _ = nodes
    a_id = a.get("/node_id")
    failed_download = {
        "model_id": "test-org/broken", "status": "failed", "files_total": 3, "files_done": 1,
        "bytes_total": 3000, "bytes_done": 1000, "source": "hub",
        "error": "the hub answered 404 for model.safetensors",
    }  # fmt: skip
    rank = {
        "node_id": a_id, "start_layer": 0, "end_layer": 4, "download": failed_download,
        "runner": {"instance_id": "i-broken", "node_id": a_id, "status": "failed",
                   "error": "RuntimeError: cannot allocate 2 GB"},
    }  # fmt: skip
    instance = {
        "instance_id": "i-broken", "model_id": "test-org/broken", "status": "failed",
        "ring_hosts": [], "ranks": [rank],
    }  # fmt: skip

    def with_failures(route: Route) -> None:
        if route.request.url.endswith("/instances"):
            route.fulfill(json={"data": [instance]})
            return
        state = route.fetch().json()
        state["downloads"].setdefault(a_id, {})["test-org/broken"] = failed_download
        state["cards"]["test-org/broken"] = state["cards"][DEFAULT_MODEL_ID] | {
            "model_id": "test-org/broken"
        }
        route.fulfill(json=state)

    page = browser.new_page(viewport=VIEWPORT)
    errors = PageErrors(page)
    page.route(lambda url: url.endswith(("/instances", "/state")), with_failures)
    page.goto(f"{a.base_url}/#models")
    row = page.locator("[data-instance-id=i-broken] [data-rank='0']")
    expect(row).to_have_attribute("data-runner", "failed")
    expect(row).to_contain_text("RuntimeError: cannot allocate 2 GB")
    expect(row).to_contain_text("the hub answered 404 for model.safetensors")
    copy = page.locator(f"tr[data-model-id='test-org/broken'] .copy[data-node-id={a_id}]")
    expect(copy).to_contain_text("the hub answered 404 for model.safetensors")
    assert errors.seen == []
    page.close()
