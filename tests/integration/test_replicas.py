"""Two replicas of the built-in model on two real nodes: a session keeps hitting
its own replica's prefix cache whichever node's API receives its turns (a
third node serving none of them included), and goes to the other replica when
its own node freezes; a stream whose replica goes before its first token
continues on the other."""

import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from playwright.sync_api import expect

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import PageErrors, headless_chromium
from tests.e2e.lan_cluster import runner_pids
from tests.e2e.node_process import NodeProcess
from tests.e2e.test_retry import finished_text
from tests.e2e.test_serving_limits import metric
from tests.integration.cluster_process import Cluster, agreed, wait_until

pytestmark = pytest.mark.slow

# A relay that hears nothing for 3 keep-alives (3 s here) gives up: the
# request then goes to the other replica.
KEEPALIVE = ("--sse-keepalive-seconds", "1")
WORDS = [
    "file",
    "function",
    "module",
    "test",
    "value",
    "error",
    "branch",
    "commit",
    "review",
    "agent",
    "patch",
    "line",
]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    """Two nodes, each with a replica of the built-in model (placed with `replicas: 2`)."""
    cluster = Cluster(tmp_path_factory.mktemp("replicas"), models_dir)
    try:
        a = cluster.start(0, *KEEPALIVE, model="none")
        cluster.start(1, *KEEPALIVE, model="none")
        wait_until(lambda: agreed(cluster.nodes), 60, "two nodes agreeing")
        wait_until(
            lambda: all(n["telemetry"] for n in a.get("/state")["nodes"].values()),
            60, "both nodes' telemetry",
        )  # fmt: skip
        response = httpx.post(
            f"{a.base_url}/place_instance",
            json={"model_id": DEFAULT_MODEL_ID, "replicas": 2, "max_nodes": 1},
            timeout=30,
        )
        assert response.status_code == 201, response.text
        placed = response.json()
        assert len(placed["replicas"]) == 2
        assert {r["ranks"][0]["node_id"] for r in placed["replicas"]} == {
            n.get("/node_id") for n in cluster.nodes
        }

        def serving() -> bool:
            instances = a.get("/instances")["data"]
            return len(instances) == 2 and all(i["status"] == "ready" for i in instances)

        wait_until(serving, 180, "both replicas ready")
        for node in cluster.nodes:
            wait_until(lambda n=node: n.runner_status() == "ready", 60, "each API serving")
        yield cluster
    finally:
        for node in cluster.nodes:
            freeze(node, False)  # a frozen node cannot stop
        cluster.stop()


def freeze(node: NodeProcess, frozen: bool) -> None:
    """SIGSTOP (or SIGCONT) the node and its runners."""
    try:
        root = psutil.Process(node.process.pid)
        for process in [root, *root.children(recursive=True)]:
            process.suspend() if frozen else process.resume()
    except psutil.NoSuchProcess:
        pass


def system_prompt(session: int) -> str:
    rng = random.Random(session)
    text = " ".join(rng.choice(WORDS) for _ in range(300))
    return f"You are session {session}'s coding agent. Project notes: {text}"


class Session:
    def __init__(self, number: int) -> None:
        self.number = number
        self.messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": system_prompt(number)}
        ]
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []

    def turn(self, node: NodeProcess) -> float:
        """One turn through `node`'s API; its seconds."""
        turn = len(self.prompt_tokens)
        self.messages.append(
            {"role": "user", "content": f"Step {turn}: what next for line {turn}?"}
        )
        client = OpenAI(base_url=f"{node.base_url}/v1", api_key="none", max_retries=0)
        started = time.monotonic()
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=self.messages,
            max_tokens=8,
            temperature=0,
        )
        seconds = time.monotonic() - started
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        self.prompt_tokens.append(usage.prompt_tokens)
        self.cached_tokens.append(usage.prompt_tokens_details.cached_tokens or 0)
        self.messages.append(
            {"role": "assistant", "content": reply.choices[0].message.content or ""}
        )
        return seconds


def routed(node: NodeProcess, reason: str, target: str) -> float:
    metrics = httpx.get(f"{node.base_url}/metrics", timeout=5).text
    pattern = rf'exo_routed_requests_total\{{model="{re.escape(DEFAULT_MODEL_ID)}",reason="{reason}",target="{target}"\}} (\S+)'
    found = re.search(pattern, metrics)
    return float(found.group(1)) if found else 0.0


SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"


def test_the_dashboard_groups_the_replicas_under_their_model(replicas: Cluster) -> None:
    a = replicas.nodes[0]
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        errors = PageErrors(page)
        page.goto(f"{a.base_url}/#models")
        group = page.locator(f'.replica-group[data-replicas-of="{DEFAULT_MODEL_ID}"]')
        expect(group.locator(".instance")).to_have_count(2, timeout=30_000)
        expect(group.locator(".replica-head")).to_contain_text("2 replicas")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SCREENSHOTS / "models-replicas.png", full_page=True)
        assert errors.seen == []


def test_a_node_without_a_replica_routes_each_session_to_its_cache(
    replicas: Cluster, tmp_path: Path
) -> None:
    """A node that serves no replica (an API-only node, its models directory
    empty) fetches the model's tokenizer from a peer and routes by cache too."""
    a, b = replicas.nodes[:2]
    c = replicas.start(2, *KEEPALIVE, models_dir=tmp_path / "no-models")
    wait_until(lambda: agreed(replicas.nodes), 60, "three nodes agreeing")
    ready = f"routing {DEFAULT_MODEL_ID}'s requests by cache: its tokenizer from peer"
    wait_until(lambda: ready in c.log(), 60, "the tokenizer fetched from a peer")
    # Each session begins on its own node's replica (nothing cached anywhere yet).
    sessions = [Session(10), Session(11)]
    sessions[0].turn(a)
    sessions[1].turn(b)
    for _ in range(2):
        for session in sessions:
            session.turn(c)
    for session in sessions:
        for turn in (1, 2):
            reusable = session.prompt_tokens[turn - 1]
            assert session.cached_tokens[turn] >= 0.95 * reusable, (
                f"session {session.number} turn {turn}: {session.cached_tokens[turn]} of "
                f"{reusable} tokens cached"
            )
    assert routed(c, "cache", "remote") == 4


def test_sessions_keep_their_cache_whichever_node_receives_them_and_move_when_it_freezes(
    replicas: Cluster,
) -> None:
    a, b = replicas.nodes[:2]
    sessions = [Session(n) for n in range(2)]
    for turn in range(3):
        for session in sessions:
            # Round-robin over the nodes' APIs: each turn through the other node.
            session.turn(replicas.nodes[(session.number + turn) % 2])
    for session in sessions:
        for turn in (1, 2):
            reusable = session.prompt_tokens[turn - 1]  # the last turn's prompt, at least
            assert session.cached_tokens[turn] >= 0.95 * reusable, (
                f"session {session.number} turn {turn}: {session.cached_tokens[turn]} of "
                f"{reusable} tokens cached"
            )
    # Half the turns reached the node without the session's cache: relayed for it.
    assert routed(a, "cache", "remote") + routed(b, "cache", "remote") >= 2

    # Session 1 began on B (through B's API, nothing cached anywhere: B's own
    # replica). With B frozen, its next turn through A is answered by A.
    freeze(b, True)
    try:
        seconds = sessions[1].turn(a)
        assert sessions[1].messages[-1].get("content")
        assert seconds < 60
        assert "trying another" in a.log()
        # The frozen replica is left out for a while: the next turn is not delayed.
        sessions[1].turn(a)
        assert sessions[1].cached_tokens[-1] >= 0.95 * sessions[1].prompt_tokens[-2]
    finally:
        freeze(b, False)


def test_a_stream_whose_replica_goes_before_its_first_token_continues_on_the_other(
    replicas: Cluster,
) -> None:
    """A stream answered by B has begun (its head and keep-alives went out)
    when B's replica is deleted and its runner dies before the first token: the
    reply continues on A's replica, inside the answer B began. Last in this
    module: it leaves one replica."""
    a, b = replicas.nodes[:2]
    b_id = b.get("/node_id")

    def b_instances() -> list[str]:
        instances = a.get("/instances")["data"]
        return [i["instance_id"] for i in instances if [r["node_id"] for r in i["ranks"]] == [b_id]]

    def placed_on_b() -> bool:
        placed = httpx.post(
            f"{a.base_url}/instance",
            json={"model_id": DEFAULT_MODEL_ID, "node_id": b_id},
            timeout=30,
        )
        assert placed.status_code in (201, 404), placed.text
        return placed.status_code == 201  # 404 while B is not back in the cluster

    if not b_instances():  # B's replica went when it froze (placed again elsewhere)
        wait_until(placed_on_b, 60, "a replica placed on B, back from its freeze")
    wait_until(lambda: b.runner_status() == "ready", 120, "B's replica serving")
    [instance] = b_instances()

    def others_serve() -> bool:
        instances = b.get("/instances")["data"]
        ready = {i["instance_id"] for i in instances if i["status"] == "ready"}
        return instance in ready and len(ready) >= 2

    wait_until(others_serve, 120, "B's replica and another ready in B's state")
    # A new prompt (cached nowhere) goes to the receiving node's own replica;
    # long enough that its prefill is under way when B's runner freezes.
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system_prompt(20) + " " + system_prompt(21)},
        {"role": "user", "content": "Name the next step."},
    ]
    rerouted = metric(b, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="rerouted")
    client = OpenAI(base_url=f"{b.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    [runner] = runner_pids(b)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, max_tokens=8, temperature=0, stream=True
    )  # returns with the answer's head: B's runner took the request
    os.kill(runner, signal.SIGSTOP)  # no token can come from B from here on
    try:
        response = httpx.delete(f"{b.base_url}/instance/{instance}", timeout=30)
        assert response.status_code == 200, response.text
    finally:
        os.kill(runner, signal.SIGKILL)
    text = finished_text(stream)
    assert "stream whose runner here was lost before its first token on node" in b.log()
    after = metric(b, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="rerouted")
    assert after == rerouted + 1
    # What A alone answers to the same prompt (greedy).
    alone = OpenAI(base_url=f"{a.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = alone.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, max_tokens=8, temperature=0
    )
    assert text == reply.choices[0].message.content
