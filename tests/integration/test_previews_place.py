"""`POST /place_instance` places what `GET /instance/previews` shows first, on
real nodes, also when a node already serves the model (it is no candidate)."""

from pathlib import Path

import httpx
import pytest

from exo.models.store import model_dir
from exo.shared.types.ids import ModelId
from tests.integration.cluster_process import Cluster, agreed, wait_until
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = ModelId("test-org/tiny-previewed")


def layout(ranks: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    return [(r["node_id"], r["start_layer"], r["end_layer"]) for r in ranks]


def test_placing_places_the_first_preview(
    cluster: Cluster, tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dirs = [tmp_path / f"models{i}" for i in range(2)]
    make_tiny_llama(model_dir(dirs[0], MODEL), smollm_dir, n_layers=4)
    a, b = (cluster.start(i, model="none", models_dir=dirs[i]) for i in range(2))
    wait_until(lambda: agreed(cluster.nodes), 30, "two nodes agreeing")
    a_id = a.get("/node_id")
    wait_until(
        lambda: sum(bool(n["telemetry"]) for n in b.get("/state")["nodes"].values()) == 2,
        60, "both nodes' telemetry",
    )  # fmt: skip
    wait_until(lambda: MODEL in b.get("/state")["cards"], 20, "A's card reaching B")

    # A, which has the files, serves the model: it would rank first, but a node
    # holds one instance of a model, so neither the preview nor the placement uses it.
    served = httpx.post(
        f"{b.base_url}/instance", json={"model_id": MODEL, "node_id": a_id}, timeout=20
    )
    assert served.status_code == 201, served.text
    previews = httpx.get(f"{b.base_url}/instance/previews", params={"model_id": MODEL}, timeout=20)
    assert previews.status_code == 200, previews.text
    placements = previews.json()["placements"]
    assert all(a_id not in [r["node_id"] for r in p["ranks"]] for p in placements)
    first = placements[0]
    # RAM each node needs: the tiny model's weights as loaded plus its KV reserve.
    assert set(first["memory_bytes"]) == {r["node_id"] for r in first["ranks"]}
    assert all(memory > 0 for memory in first["memory_bytes"].values())

    placed = httpx.post(f"{b.base_url}/place_instance", json={"model_id": MODEL}, timeout=20)
    assert placed.status_code == 201, placed.text
    assert layout(placed.json()["ranks"]) == layout(first["ranks"])

    # Both nodes serve it now: nothing left to preview, and the preview says why.
    full = httpx.get(f"{b.base_url}/instance/previews", params={"model_id": MODEL}, timeout=20)
    assert full.status_code == 400
    assert "already has an instance on" in full.json()["error"]["message"]
