"""Recovery time with real nodes: the master, serving one rank of a model placed
across two nodes, is killed; the model serves again on the survivors (the
other rank's node and a spare) within 10 s, placed with the same request."""

import signal
import time
from typing import Any

import httpx
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, await_instance
from tests.integration.cluster_process import Cluster, agreed, wait_until

pytestmark = pytest.mark.slow

RECOVERY_SECONDS = 10.0
REPLACED_SECONDS = 5.0
# Far longer than the recovery target: the survivors must not wait for it.
NODE_TIMEOUT_SECONDS = "60"


def chat(node: NodeProcess, timeout: float) -> str | None:
    """A short answer from `node`, or None when it cannot give one now."""
    try:
        response = httpx.post(
            f"{node.base_url}/v1/chat/completions",
            json={
                "model": DEFAULT_MODEL_ID,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=timeout,
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json()["choices"][0]["message"]["content"] or None


def test_the_model_serves_again_within_10s_after_the_master_holding_a_rank_dies(
    cluster: Cluster,
) -> None:
    timeout = ("--node-timeout-seconds", NODE_TIMEOUT_SECONDS)
    master = cluster.start(0, "--force-master", *timeout, model="none")
    other = cluster.start(1, *timeout, model="none")
    wait_until(lambda: agreed(cluster.nodes), 30, "two nodes agreeing")
    master_id, other_id = master.get("/node_id"), other.get("/node_id")
    placing = time.monotonic()
    placed = httpx.post(
        f"{other.base_url}/place_instance",
        json={"model_id": DEFAULT_MODEL_ID, "min_nodes": 2},
        timeout=30,
    )
    assert placed.status_code == 201, placed.text
    assert {r["node_id"] for r in placed.json()["ranks"]} == {master_id, other_id}
    spare = cluster.start(2, *timeout, model="none")  # while the ranks load
    spare_id = spare.get("/node_id")
    assert await_instance(other.base_url, DEFAULT_MODEL_ID, timeout=120)[-1]["status"] == "ready"
    load_seconds = time.monotonic() - placing
    wait_until(lambda: agreed(cluster.nodes), 30, "three nodes agreeing")
    assert chat(other, timeout=30)

    master.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()

    def placed_on_survivors() -> dict[str, Any] | None:
        instances = other.get("/state")["instances"].values()
        return next(
            (i for i in instances if all(r["node_id"] != master_id for r in i["ranks"])), None
        )

    # The link notices at once and the new master places the model again: no
    # node timeout is waited for.
    instance = wait_until(placed_on_survivors, REPLACED_SECONDS, "a placement on the survivors")
    replaced_after = time.monotonic() - killed_at
    assert {r["node_id"] for r in instance["ranks"]} == {other_id, spare_id}
    assert instance["min_nodes"] == 2  # placed again as it was asked for

    # The survivors load the model again. Where that alone takes longer than
    # the target (CPU dequantization on a busy runner), the bound is that load
    # with some slack, after the re-placement.
    budget = max(RECOVERY_SECONDS, replaced_after + 1.25 * load_seconds)
    answer = None
    while answer is None and (left := killed_at + budget - time.monotonic()) > 0:
        answer = chat(other, timeout=left)
        if answer is None:
            time.sleep(0.2)
    recovered_after = time.monotonic() - killed_at
    print(
        f"re-placed {replaced_after:.1f}s and serving {recovered_after:.1f}s after the master's "
        f"death (a fresh placement took {load_seconds:.1f}s to load)"
    )
    assert answer, f"no answer within {budget:.0f}s of the master's death"
    state = other.get("/state")
    assert master_id in state["nodes"]  # not timed out: out of placement only
    assert state["master_id"] in (other_id, spare_id)
