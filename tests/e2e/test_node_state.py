"""End to end: the node's event-sourced state through /state, /events and /node_id."""

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = pytest.mark.slow


def get(node: NodeProcess, path: str) -> object:
    response = httpx.get(f"{node.base_url}{path}", timeout=10)
    response.raise_for_status()
    return response.json()


def read_events(node: NodeProcess, from_idx: int, count: int) -> list[dict]:
    events: list[dict] = []
    with httpx.stream(
        "GET", f"{node.base_url}/events", params={"from_idx": from_idx}, timeout=10
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == count:
                    break
    return events


def settled_state(node: NodeProcess, timeout: float = 10.0) -> dict:
    """The state once this node's telemetry and runner status are in it (both
    travel as events, a moment after the runner reports ready locally)."""
    deadline = time.monotonic() + timeout
    while True:
        state = get(node, "/state")
        assert isinstance(state, dict)
        me = state["nodes"].get(get(node, "/node_id"), {})
        if (me.get("telemetry") and state["runners"] and state["downloads"]) or (
            time.monotonic() > deadline
        ):
            return state
        time.sleep(0.1)


def test_state_shows_this_node_its_instance_and_runner(node: NodeProcess) -> None:
    node_id = get(node, "/node_id")
    state = settled_state(node)
    assert state["master_id"] == node_id
    me = state["nodes"][node_id]
    assert me["telemetry"]["ram_total"] > 0
    assert me["telemetry"]["mlx_backend"] in ("cpu", "metal", "cuda")
    [(instance_id, instance)] = state["instances"].items()
    assert instance == {
        "instance_id": instance_id,
        "model_id": DEFAULT_MODEL_ID,
        "ranks": [{"node_id": node_id, "start_layer": 0, "end_layer": 30}],
        "ring_hosts": [],
        # what re-placement after a lost rank keeps (the node asked for itself)
        "min_nodes": 1,
        "max_nodes": None,
        "sharding": "pipeline",
        "replicas": 1,  # one instance asked for: another serving it is enough
        "moved": None,  # placed as asked, not again after a failure
    }
    assert me["hostname"]  # shown beside the id on the dashboard
    assert me["unreachable_since_ms"] is None
    assert state["gone_nodes"] == {}
    assert state["runners"][instance_id][node_id]["status"] in ("ready", "running")
    # The node told the cluster which models it has: the card and every file.
    assert state["cards"][DEFAULT_MODEL_ID]["n_layers"] == 30
    download = state["downloads"][node_id][DEFAULT_MODEL_ID]
    assert download["status"] == "complete"
    assert "config.json" in download["have_files"]


def test_events_replay_in_order_from_any_index(node: NodeProcess) -> None:
    from_start = read_events(node, 0, 3)
    assert [e["idx"] for e in from_start] == [0, 1, 2]
    # A node alone elects itself, then its join reaches its own master.
    assert [e["event"]["kind"] for e in from_start[:2]] == ["master_elected", "node_joined"]
    assert read_events(node, 1, 2) == from_start[1:]


def test_bad_event_index_is_a_400(node: NodeProcess) -> None:
    r = httpx.get(f"{node.base_url}/events", params={"from_idx": -1}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "from_idx"


def test_a_restarted_node_keeps_its_id_and_history(tmp_path: Path, models_dir: Path) -> None:
    with running_node(tmp_path, models_dir, "--prefix-cache-bytes", "0") as first:
        node_id = get(first, "/node_id")
        before = get(first, "/state")
        assert isinstance(before, dict)
        [old_instance] = before["instances"]
        first_events = read_events(first, 0, before["last_idx"] + 1)
    data_dir = tmp_path / f"data-{first.base_url.rsplit(':', 1)[1]}"
    with running_node(
        tmp_path, models_dir, "--prefix-cache-bytes", "0", data_dir=data_dir
    ) as second:
        assert get(second, "/node_id") == node_id
        after = get(second, "/state")
        assert isinstance(after, dict)
        assert after["last_idx"] > before["last_idx"]
        assert after["master_term"] == before["master_term"] + 1
        cluster = get(second, "/cluster")
        assert isinstance(cluster, dict)
        assert cluster["resumed_from_idx"] == before["last_idx"] + 1 or (
            cluster["resumed_from_idx"] > before["last_idx"]
        )
        assert old_instance not in after["instances"]  # the old runner is gone with the old process
        assert len(after["instances"]) == 1
        # The history is kept: the same events, then the new ones, with no gap.
        replay = read_events(second, 0, after["last_idx"] + 1)
        assert replay[: len(first_events)] == first_events
        assert [e["idx"] for e in replay] == list(range(after["last_idx"] + 1))


def test_placement_previews(node: NodeProcess) -> None:
    node_id = get(node, "/node_id")
    settled_state(node)  # placement needs the node's telemetry
    # The only node serves the model already, and a node holds one instance of a
    # model: no placement, and the preview says why (as POST /place_instance would).
    served = httpx.get(
        f"{node.base_url}/instance/previews", params={"model_id": DEFAULT_MODEL_ID}, timeout=10
    )
    assert served.status_code == 400
    assert f"already has an instance on {node_id}" in served.json()["error"]["message"]
    too_many = httpx.get(
        f"{node.base_url}/instance/previews",
        params={"model_id": DEFAULT_MODEL_ID, "min_nodes": 2},
        timeout=10,
    )
    assert too_many.status_code == 400
    # In the user's words: how many nodes, not a parameter's name.
    message = too_many.json()["error"]["message"]
    assert "on at least 2 nodes: the cluster has 1 node that can run models" in message
    assert "min_nodes" not in message
    unknown = httpx.get(
        f"{node.base_url}/instance/previews", params={"model_id": "nope"}, timeout=10
    )
    assert unknown.status_code == 404


def test_the_dashboard_is_served_and_its_endpoints_answer(node: NodeProcess) -> None:
    page = httpx.get(f"{node.base_url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>exo cluster</title>" in page.text
    # The page's modules are served as JavaScript.
    module = httpx.get(f"{node.base_url}/dashboard/cluster.js", timeout=10)
    assert module.headers["content-type"].startswith("text/javascript")
    # Every read the live view makes answers, with the fields the page renders.
    reads = set(re.findall(r'api\("(/[a-z_]+)"\)', module.text))
    assert reads == {"/node_id", "/state", "/instances", "/cluster"}
    state = httpx.get(f"{node.base_url}/state", timeout=10).json()
    assert {
        "nodes",
        "gone_nodes",
        "master_id",
        "master_term",
        "last_idx",
        "downloads",
    } <= state.keys()
    # The heartbeats the page counts "last heard" from, on the node's clock.
    link = httpx.get(f"{node.base_url}/cluster", timeout=10).json()
    assert {"heard_ms", "now_ms"} <= link.keys()
    [instance] = httpx.get(f"{node.base_url}/instances", timeout=10).json()["data"]
    assert {"instance_id", "model_id", "status", "ranks"} <= instance.keys()
    assert {"node_id", "start_layer", "end_layer", "runner", "download"} <= instance["ranks"][
        0
    ].keys()
    models = httpx.get(f"{node.base_url}/dashboard/models.js", timeout=10).text
    for action in ("/instance/previews?", "/place_instance", "/instance/${"):
        assert action in models
