"""Model files move between real `exo` nodes: a node placed on a model it lacks
copies the files from a peer (gRPC FetchFile, no hub), and a node holding one
rank of a model gets only that rank's files."""

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.models.cards import card_from_folder
from exo.models.store import model_dir
from exo.models.weight_files import shard_files
from exo.shared.types.ids import ModelId
from tests.integration.cluster_process import Cluster, agreed, events, wait_until
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = ModelId("test-org/tiny-sharded")


def files_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()} if folder.is_dir() else set()


def download_events(node_events: list[dict[str, Any]], node_id: str) -> list[dict[str, Any]]:
    return [
        e["event"]["progress"]
        for e in node_events
        if e["event"]["kind"] == "download_progressed"
        and e["event"]["node_id"] == node_id
        and e["event"]["progress"]["model_id"] == MODEL
    ]


def test_files_come_from_a_peer_and_shards_get_only_their_files(
    cluster: Cluster, tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No hub: every byte must come from the peer.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    dirs = [tmp_path / f"models{i}" for i in range(3)]
    source = make_tiny_llama(
        model_dir(dirs[0], MODEL), smollm_dir, n_layers=4, weight_files=3, tie_word_embeddings=False
    )
    card = card_from_folder(MODEL, source)
    a, b, c = (cluster.start(i, model="none", models_dir=dirs[i]) for i in range(3))
    wait_until(lambda: agreed(cluster.nodes), 30, "three nodes agreeing")
    a_id, b_id, c_id = (n.get("/node_id") for n in (a, b, c))
    wait_until(lambda: MODEL in b.get("/state")["cards"], 20, "A's card reaching B")

    # 1. The whole model on B alone: B copies every file from A.
    created = httpx.post(
        f"{c.base_url}/instance", json={"model_id": MODEL, "node_id": b_id}, timeout=20
    )
    assert created.status_code == 201, created.text
    instance_id = created.json()["instance_id"]
    wait_until(
        lambda: c.get("/state")["runners"].get(instance_id, {}).get(b_id, {}).get("status")
        == "ready",
        90, "B's runner ready",
    )  # fmt: skip
    copied = model_dir(dirs[1], MODEL)
    assert files_in(copied) == files_in(source)
    for name in files_in(source):
        assert (copied / name).read_bytes() == (source / name).read_bytes()
    for node in (a, b, c):  # every node saw B's progress, from A
        progress = download_events(events(node), b_id)
        assert progress[0]["status"] == "downloading"
        assert progress[-1]["status"] == "complete"
        assert progress[-1]["source"] == f"peer {a_id}"
        assert set(progress[-1]["have_files"]) == files_in(source)
    # It serves, through a node that has no runner of it.
    client = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="x", timeout=60)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    # 2. B deletes its copy; placed across two nodes, A (which has every file)
    # is one of them, and the other fetches only the files of its layers.
    assert httpx.delete(f"{a.base_url}/instance/{instance_id}", timeout=20).status_code == 200
    wait_until(lambda: not b.get("/state")["instances"], 20, "the instance gone")
    deleted = httpx.delete(f"{b.base_url}/models/{MODEL}", timeout=20)
    assert deleted.status_code == 200, deleted.text
    assert not copied.exists()
    wait_until(lambda: MODEL not in c.get("/state")["downloads"].get(b_id, {}), 20, "B's copy gone")
    previews = c.get(f"/instance/previews?model_id={MODEL}&min_nodes=2&max_nodes=2")
    best = previews["placements"][0]
    assert a_id in [r["node_id"] for r in best["ranks"]]  # the node with the files wins
    placed = httpx.post(
        f"{c.base_url}/place_instance",
        json={"model_id": MODEL, "min_nodes": 2, "max_nodes": 2},
        timeout=20,
    )
    assert placed.status_code == 201, placed.text
    ranks = placed.json()["ranks"]
    assert [r["node_id"] for r in ranks] == [r["node_id"] for r in best["ranks"]]
    [other] = [r for r in ranks if r["node_id"] != a_id]
    other_dir = model_dir(dirs[[a_id, b_id, c_id].index(other["node_id"])], MODEL)

    def other_done() -> bool:
        download = c.get("/state")["downloads"].get(other["node_id"], {}).get(MODEL)
        return download is not None and download["status"] == "complete"

    wait_until(other_done, 30, "the other rank's files")
    expected = shard_files(card, other["start_layer"], other["end_layer"])
    assert files_in(other_dir) == expected
    assert expected != files_in(source)  # a strict subset: some weight files stay on A
    assert files_in(source) == files_in(model_dir(dirs[0], MODEL))
