"""A full disk at the node level: a real node whose data dir (event log,
models) is a small tmpfs the test mounts (as root, as CI runs; skipped with the
reason elsewhere). The disk fills in the middle of a download, so the download
and then the event log's appends fail: the node stays up, says so (`/health`
degraded with the reason, commands answered 503), and once space is freed it
records again (no acknowledged command lost), the state shows the failed
download with its reason, and the model placed again resumes the partial file
and serves.

A corrupt prefix-cache file on disk is removed and never served:
tests/unit/test_prefix_cache_disk.py::test_corrupt_files_are_removed_and_never_served
(garbage, truncated, empty, a write cut before its rename)."""

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.shared.types.ids import ModelId
from tests.e2e.node_process import NodeProcess, await_instance, running_node
from tests.hub_server import FakeHub
from tests.integration.cluster_process import wait_until
from tests.model_factory import make_tiny_llama
from tests.unit.small_tmpfs import fill, small_tmpfs

pytestmark = pytest.mark.slow

MODEL = ModelId("hub-org/tiny-full-disk")
BIG_FILE = "model-00001-of-00002.safetensors"  # the embedding: ~12 MB
HELD_AT = 2 << 20  # the hub pauses the big file here, while the disk fills


def place(node: NodeProcess) -> httpx.Response:
    return httpx.post(f"{node.base_url}/place_instance", json={"model_id": MODEL}, timeout=30)


def my_instance(node: NodeProcess, instance_id: str | None = None) -> dict[str, Any] | None:
    instances = node.get("/instances")["data"]
    return next((i for i in instances if instance_id in (None, i["instance_id"])), None)


def test_a_node_whose_disk_fills_survives_says_so_and_recovers_when_space_is_freed(
    tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_tiny_llama(tmp_path / "hub" / "repo", smollm_dir, n_layers=2, weight_files=2)
    with (
        small_tmpfs(tmp_path / "disk", "40m") as disk,
        FakeHub({MODEL: repo}) as hub,
    ):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with running_node(
            tmp_path, disk / "models",
            "--min-free-disk-bytes", "0",  # the space check passes: the disk fills later
            "--prefix-cache-disk-bytes", "0",
            model="none", data_dir=disk / "data", ready="api",
        ) as node:  # fmt: skip
            wait_until(
                lambda: any(n["telemetry"] for n in node.get("/state")["nodes"].values()),
                60, "telemetry",
            )  # fmt: skip
            assert node.health()["status"] == "ok"

            # The disk fills while the big file is half downloaded.
            release = hub.hold_after(BIG_FILE, HELD_AT)
            placed = place(node)
            assert placed.status_code == 201, placed.text
            first_id = placed.json()["instance_id"]
            wait_until(lambda: hub.bytes_sent[BIG_FILE] >= HELD_AT, 60, "the download under way")
            filler = fill(disk)
            release.set()

            wait_until(lambda: "the disk is full" in node.log(), 30, "the download failing")
            assert node.process.poll() is None

            # Commands keep coming (each places a model the hub has: its card
            # and instance are events, and its download fails at once, more
            # events): once the log's last page is full, appends fail; the
            # command is refused with a clear 503, and the node says why.
            placed_ids: list[str] = []
            refused: httpx.Response | None = None
            for i in range(100):
                filler_model = f"hub-org/filler-{i}"
                hub.repos[filler_model] = repo
                attempt = httpx.post(
                    f"{node.base_url}/place_instance", json={"model_id": filler_model}, timeout=30
                )
                if attempt.status_code != 201:
                    refused = attempt
                    break
                placed_ids.append(attempt.json()["instance_id"])
            assert refused is not None, "a full disk took every append"
            assert refused.status_code == 503, refused.text
            assert "event log" in refused.json()["error"]["message"], refused.text
            health = node.health()
            assert health["status"] == "degraded", health
            assert "No space left on device" in health["event_log_error"], health
            assert node.process.poll() is None
            print(f"{len(placed_ids)} commands accepted as the disk filled, then a 503: {health}")

            # Space comes back: the node records again, and the state shows the
            # download's failure with its reason; the partial file is kept.
            filler.unlink()
            wait_until(lambda: node.health()["status"] == "ok", 30, "healthy again")

            def failed_rank() -> dict[str, Any] | None:
                instance = my_instance(node, first_id)
                rank = instance["ranks"][0] if instance else None
                return rank if rank and (rank["download"] or {}).get("status") == "failed" else None

            rank = wait_until(failed_rank, 30, "the failed download in the state")
            # Every command acknowledged while the disk filled is in the state.
            assert set(placed_ids) <= set(node.get("/state")["instances"])
            assert "the disk is full" in rank["download"]["error"], rank
            assert rank["runner"]["status"] == "failed", rank
            assert "disk is full" in rank["runner"]["error"], rank
            [partial] = (disk / "models").rglob(f"{BIG_FILE}.partial")
            assert partial.stat().st_size >= HELD_AT

            # Placed again, it resumes the partial file and serves.
            assert node.process.poll() is None
            for instance in node.get("/instances")["data"]:
                httpx.delete(f"{node.base_url}/instance/{instance['instance_id']}", timeout=20)
            wait_until(lambda: my_instance(node) is None, 20, "the failed instances gone")
            assert place(node).status_code == 201
            statuses = [e["status"] for e in await_instance(node.base_url, MODEL, timeout=120)]
            assert statuses[-1] == "ready", statuses
            assert max(hub.offsets(BIG_FILE)) >= HELD_AT  # resumed, not fetched again
            client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=60)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content is not None
            assert node.health()["status"] == "ok"
