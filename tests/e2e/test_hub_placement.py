"""A model only the hub has: previewed from its card (config and index, no
weights), placed, downloaded over the hub's HTTP protocol, then served."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from exo.models.cards import card_from_folder
from exo.shared.types.ids import ModelId
from tests.e2e.node_process import await_instance, running_node
from tests.hub_server import FakeHub
from tests.integration.cluster_process import wait_until
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = ModelId("hub-org/tiny-hub-llama")
BROKEN = ModelId("hub-org/broken-llama")


def test_a_hub_model_is_previewed_placed_downloaded_and_served(
    tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_tiny_llama(tmp_path / "hub" / "repo", smollm_dir, n_layers=4, weight_files=2)
    with FakeHub({MODEL: repo}, token="hf_test") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with running_node(tmp_path, tmp_path / "models", model="none", ready="api") as node:
            wait_until(
                lambda: any(n["telemetry"] for n in node.get("/state")["nodes"].values()),
                60, "telemetry",
            )  # fmt: skip
            previews = httpx.get(
                f"{node.base_url}/instance/previews", params={"model_id": MODEL}, timeout=30
            )
            assert previews.status_code == 200, previews.text
            [rank] = previews.json()["placements"][0]["ranks"]
            assert (rank["start_layer"], rank["end_layer"]) == (0, 4)
            # A preview changes nothing: the card reaches the cluster with the instance.
            assert MODEL not in node.get("/state")["cards"]
            assert not [p for p in hub.bytes_sent if p.endswith(".safetensors")]  # no weights yet

            # Held mid-download: a request for the placed model meanwhile is a
            # 503 to retry (what openai's and anthropic's clients do), not a 404.
            release = hub.hold_after("model-00002-of-00002.safetensors", 64 * 1024)
            placed = httpx.post(
                f"{node.base_url}/place_instance", json={"model_id": MODEL}, timeout=30
            )
            assert placed.status_code == 201, placed.text
            # The card, from the hub's config and index, is now the cluster's.
            card = node.get("/state")["cards"][MODEL]
            assert card["n_layers"] == 4 and card["size_source"] != "safetensors_headers"
            assert (
                card["weight_files"]
                == json.loads(
                    card_from_folder(MODEL, repo).model_dump_json(include={"weight_files"})
                )["weight_files"]
            )
            early = httpx.post(
                f"{node.base_url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                timeout=30,
            )
            assert early.status_code == 503, early.text
            assert early.headers["retry-after"] == "2"
            error = early.json()["error"]
            assert error["code"] == "model_not_ready"
            assert "not ready yet" in error["message"] and MODEL in error["message"]
            release.set()
            statuses = [e["status"] for e in await_instance(node.base_url, MODEL)]
            assert statuses[-1] == "ready", statuses
            assert "waiting" in statuses
            for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
                assert hub.bytes_sent[name] == (repo / name).stat().st_size
            assert set(hub.authorizations) == {"Bearer hf_test"}

            client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=60)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content is not None

            # A file the hub no longer serves: the download fails, and the
            # instance shows it with the reason (no silent wait).
            hub.repos[BROKEN] = repo
            hub.fail_once("model-00002-of-00002.safetensors", 404)
            broken = httpx.post(
                f"{node.base_url}/place_instance", json={"model_id": BROKEN}, timeout=30
            )
            assert broken.status_code == 201, broken.text
            events = await_instance(node.base_url, BROKEN, timeout=60)
            assert events[-1]["status"] == "failed", events
            [rank] = events[-1]["instances"][0]["ranks"]
            assert "download failed" in rank["runner"]["error"]
            assert "model-00002-of-00002.safetensors" in rank["download"]["error"]
            assert rank["download"]["status"] == "failed"

            # Not on the hub either: a 404 that says so.
            missing = httpx.get(
                f"{node.base_url}/instance/previews",
                params={"model_id": "hub-org/absent"},
                timeout=30,
            )
            assert missing.status_code == 404
            assert "the hub does not either" in missing.json()["error"]["message"]
            bad = httpx.get(
                f"{node.base_url}/instance/previews", params={"model_id": "../etc"}, timeout=30
            )
            assert bad.status_code == 400


def test_exo_download_shows_progress_and_resumes(tmp_path: Path, smollm_dir: Path) -> None:
    repo = make_tiny_llama(tmp_path / "hub" / "repo", smollm_dir, n_layers=2, weight_files=2)
    models = tmp_path / "models"
    with FakeHub({MODEL: repo}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url}
        env.pop("HF_HUB_OFFLINE", None)
        weights = "model-00002-of-00002.safetensors"
        size = (repo / weights).stat().st_size
        hub.cut_after(weights, size // 2)

        def download(model: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "exo.main", "download", model]
            return subprocess.run(
                [*command, "--models-dir", str(models)],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        done = download(MODEL)
        assert done.returncode == 0, done.stderr
        folder = models / MODEL.replace("/", "--")
        assert {p.name for p in folder.iterdir()} == {p.name for p in repo.iterdir()}
        assert (folder / weights).read_bytes() == (repo / weights).read_bytes()
        assert hub.offsets(weights) == [0, size // 2]  # the retry resumed mid-file
        assert "100.0%" in done.stderr and "files)" in done.stderr

        missing = download("hub-org/absent")
        assert missing.returncode == 1
        assert "hub-org/absent" in missing.stderr and "not found" in missing.stderr
        invalid = download("../etc")
        assert invalid.returncode == 2 and "invalid model id" in invalid.stderr
