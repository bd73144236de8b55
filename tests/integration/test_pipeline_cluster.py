"""A model placed across two real `exo` nodes answers like one node does (a dense
model, a mixture of experts, a linear-attention hybrid, asked through a node
that serves no rank too), and a rank killed mid-generation fails the request
promptly and is re-placed."""

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletionMessageParam

from exo.models.store import model_dir
from exo.shared.types.ids import ModelId
from exo.worker.runner.standby import is_runner_process
from tests.e2e.node_process import NodeProcess, await_instance
from tests.integration.cluster_process import Cluster, agreed, wait_until
from tests.model_factory import make_tiny_llama, make_tiny_model

pytestmark = pytest.mark.slow

MODEL = ModelId("test-org/tiny-pipeline")
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Count from one to ten, then tell a story."}
]


def runner_pids(node_pid: int) -> list[int]:
    return [
        child.pid
        for child in psutil.Process(node_pid).children(recursive=True)
        if is_runner_process(child.cmdline(), child.name())
    ]


def ask(base_url: str, max_tokens: int = 16) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=max_tokens
    )
    return reply.choices[0].message.content or ""


def await_ready(cluster: Cluster) -> None:
    events = await_instance(cluster.nodes[0].base_url, MODEL)
    # A ring that does not come up is told apart by the nodes' (and runners') logs.
    logs = "\n".join(f"--- {node.base_url}\n{node.log()[-4000:]}" for node in cluster.nodes)
    assert events[-1]["status"] == "ready", f"{events}\n{logs}"


def test_two_ranks_answer_like_one_and_a_killed_rank_is_replaced(
    cluster: Cluster, tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dirs = [tmp_path / f"models{i}" for i in range(2)]
    make_tiny_llama(model_dir(dirs[0], MODEL), smollm_dir, n_layers=6, hidden=64, weight_files=3)
    a, b = (cluster.start(i, model="none", models_dir=dirs[i]) for i in range(2))
    wait_until(lambda: agreed(cluster.nodes), 30, "two nodes agreeing")
    a_id, b_id = a.get("/node_id"), b.get("/node_id")
    wait_until(lambda: MODEL in b.get("/state")["cards"], 20, "the card")

    # One rank on A: the reference answer.
    single = httpx.post(f"{a.base_url}/instance", json={"model_id": MODEL}, timeout=20).json()
    await_ready(cluster)
    reference = ask(b.base_url)
    assert reference
    httpx.delete(f"{a.base_url}/instance/{single['instance_id']}", timeout=20)
    wait_until(lambda: not a.get("/state")["instances"], 20, "the single rank gone")

    # Two ranks: the same tokens, asked through either node.
    placed = httpx.post(
        f"{b.base_url}/place_instance",
        json={"model_id": MODEL, "min_nodes": 2, "max_nodes": 2},
        timeout=20,
    )
    assert placed.status_code == 201, placed.text
    instance = placed.json()
    assert sorted(r["node_id"] for r in instance["ranks"]) == sorted([a_id, b_id])
    await_ready(cluster)
    assert ask(a.base_url) == reference
    assert ask(b.base_url) == reference
    # The ranks speculate: drafts from a predicted output, each verify step one
    # forward around the ring, the same reply.
    predicted = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="x", timeout=120)
    reply = predicted.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        prediction={"type": "content", "content": reference},
    )
    assert reply.choices[0].message.content == reference
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert (reply.usage.completion_tokens_details.accepted_prediction_tokens or 0) > 0

    # Kill the last rank's runner mid-generation: the client hears of it within
    # 10 s, and the master places the model again.
    last_rank = cluster.nodes[[a_id, b_id].index(instance["ranks"][-1]["node_id"])]
    [victim] = runner_pids(last_rank.process.pid)
    client = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="x", timeout=60, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4000, stream=True
    )
    killed_at: float | None = None
    failed_at: float | None = None
    try:
        for received, _ in enumerate(stream):
            if received == 5:
                psutil.Process(victim).send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    except (openai.APIError, httpx.HTTPError):
        failed_at = time.monotonic()
    assert killed_at is not None, "the generation ended before the kill"
    assert failed_at is not None and failed_at - killed_at < 10
    # No runner of the old instance is left; a new instance replaces it.
    old_id = instance["instance_id"]

    def replaced() -> bool:
        state = a.get("/state")
        return old_id not in state["instances"] and any(
            i["model_id"] == MODEL for i in state["instances"].values()
        )

    wait_until(replaced, 30, "the instance placed again")
    await_ready(cluster)
    assert ask(b.base_url) == reference
    assert victim not in runner_pids(last_rank.process.pid)


def ask_model(base_url: str, model: ModelId) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=120)
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=12
    )
    return reply.choices[0].message.content or ""


def serve_and_ask(cluster: Cluster, via: NodeProcess, model: ModelId, body: dict[str, Any]) -> str:
    """Place `model` as `body` says, ask it through `via`, then delete the instance."""
    placed = httpx.post(
        f"{via.base_url}/place_instance", json={"model_id": model, **body}, timeout=20
    )
    assert placed.status_code == 201, placed.text
    instance = placed.json()
    events = await_instance(via.base_url, model)
    logs = "\n".join(f"--- {node.base_url}\n{node.log()[-4000:]}" for node in cluster.nodes)
    assert events[-1]["status"] == "ready", f"{events}\n{logs}"
    answer = ask_model(via.base_url, model)
    httpx.delete(f"{via.base_url}/instance/{instance['instance_id']}", timeout=20)
    wait_until(lambda: not via.get("/state")["instances"], 30, "the instance gone")
    return answer


def test_a_moe_and_a_hybrid_split_both_ways_over_two_nodes_answer_through_a_node_that_serves_none(
    cluster: Cluster, tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dirs = [tmp_path / f"models{i}" for i in range(3)]
    families = {
        ModelId("test-org/tiny-moe"): "qwen3_moe",
        ModelId("test-org/tiny-hybrid"): "qwen3_next",
    }
    for model, family in families.items():  # on A only: B fetches its rank's files from A
        make_tiny_model(family, model_dir(dirs[0], model), smollm_dir, n_layers=6)
    a, b = (cluster.start(i, model="none", models_dir=dirs[i]) for i in range(2))
    api_only = cluster.start(2, models_dir=dirs[2])  # --no-worker: it serves no rank
    wait_until(lambda: agreed(cluster.nodes), 30, "three nodes agreeing")
    workers = sorted([a.get("/node_id"), b.get("/node_id")])
    for model in families:
        wait_until(lambda model=model: model in api_only.get("/state")["cards"], 20, "the card")
        preview = httpx.get(
            f"{api_only.base_url}/instance/previews",
            params={"model_id": model, "min_nodes": 2},
            timeout=20,
        )
        assert preview.status_code == 200, preview.text
        split = serve_and_ask(cluster, api_only, model, {"min_nodes": 2, "max_nodes": 2})
        tensor = serve_and_ask(
            cluster, api_only, model, {"sharding": "tensor", "min_nodes": 2, "max_nodes": 2}
        )
        whole = serve_and_ask(cluster, api_only, model, {"max_nodes": 1})
        assert split and split == whole == tensor, (model, split, tensor, whole)
    assert not set(workers) & {api_only.get("/node_id")}
