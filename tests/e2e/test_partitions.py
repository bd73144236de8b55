"""Network partitions with real processes: `exo` nodes, each in its own network
namespace on a private LAN (real mDNS), cut apart by dropping the packets
between them (`NetnsLan.cut`: as a failed switch, nothing refuses), then healed.

- One node of three, the one serving the model (not the master), cut off for
  30 s: longer than the node timeout, so the other side times it out and
  places the model again, while the lone node elects itself and serves on.
- Four nodes cut into halves of two, the model on the half without the master.

While cut, requests (the official `openai` client) to every node of both
sides are answered, or refused with a clear HTTP error, within a bound: never a
hang or a dropped connection. Once healed: one event log on every node (the
same events at the same indices, contiguous, the history before the cut kept),
every node that lost its history reports the events it set aside (`/state` and
its log), the model served by one instance only, and no runner left serving a
history the cluster no longer holds.

One cluster of four is shared by the module (the first test runs three of them)."""

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.models.store import model_dir
from exo.shared.types.ids import ModelId
from tests.e2e.lan_cluster import LanCluster, runner_pids
from tests.e2e.node_process import await_instance
from tests.e2e.test_chaos import assert_one_event_log
from tests.integration.cluster_process import agreed, events, wait_until
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = ModelId("test-org/tiny-partition")
# The issue's cut of one node; the halves' cut is as long as both halves need
# to elect a master and place the model.
ONE_CUT_SECONDS = 30.0
HALVES_CUT_SECONDS = 12.0
NODE_TIMEOUT_SECONDS = "20"  # the default: the 30 s cut outlasts it
# A request sent during a cut ends (answered or refused) within this: a lost
# peer is dropped from membership after 5 s, a relay to it gives up sooner.
ANSWER_BOUND_SECONDS = 20.0
# When (seconds into the cut) a round of requests goes to every node.
ONE_CUT_ROUNDS = (1.0, 12.0)
HALVES_CUT_ROUNDS = (1.0, 9.0)
# After the heal: every node answers within this (rejoin takes 2-5 s; a
# replica whose relays failed during the cut is tried again when it is the
# only one, `ModelRouter.replicas`).
HEALED_BOUND_SECONDS = 30.0


@dataclass
class Outcome:
    """What one request sent during a cut got."""

    node: int
    sent_at: float  # seconds into the cut
    answer: str | None = None
    error: str | None = None  # a clear error: an HTTP status with a message
    unclear: str | None = None  # a dropped connection, a timeout, an error without a message
    seconds: float | None = None


def ask(base_url: str, outcome: Outcome) -> None:
    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="x", timeout=ANSWER_BOUND_SECONDS + 10, max_retries=0
    )
    started = time.monotonic()
    try:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
        )
        outcome.answer = reply.choices[0].message.content or ""
    except openai.APIStatusError as error:
        outcome.error = f"{error.status_code}: {error.message}"
        if not error.message:
            outcome.unclear = f"HTTP {error.status_code} with no message"
    except openai.APIError as error:  # a timeout, a dropped connection
        outcome.unclear = f"{type(error).__name__}: {error!r}"
    finally:
        outcome.seconds = time.monotonic() - started


def during_cut(cluster: LanCluster, nodes: list[int], rounds: tuple[float, ...]) -> list[Outcome]:
    """A round of requests to every node of `nodes` at each of `rounds` seconds
    into the cut (just made); returns when all have ended (or their bound passed)."""
    cut_at = time.monotonic()
    outcomes: list[Outcome] = []
    threads: list[threading.Thread] = []
    for offset in rounds:
        time.sleep(max(0.0, cut_at + offset - time.monotonic()))
        for i in nodes:
            outcome = Outcome(i, time.monotonic() - cut_at)
            outcomes.append(outcome)
            thread = threading.Thread(
                target=ask, args=(cluster.node(i).base_url, outcome), daemon=True
            )
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join(ANSWER_BOUND_SECONDS + 15)
    return outcomes


def assert_answered_or_refused(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        assert outcome.seconds is not None, f"a request hung: {outcome}"
        assert outcome.unclear is None, f"no answer and no clear error: {outcome}"
        assert outcome.answer is not None or outcome.error, outcome
        assert outcome.seconds <= ANSWER_BOUND_SECONDS, f"answered too late: {outcome}"


def summary(outcomes: list[Outcome]) -> str:
    return "; ".join(
        f"node {o.node} at {o.sent_at:.0f}s: "
        + (f"answered in {o.seconds:.1f}s" if o.answer is not None else f"{o.error}"[:100])
        for o in outcomes
    )


def model_instances(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in state["instances"].values() if i["model_id"] == MODEL]


def served_once(cluster: LanCluster, nodes: list[int]) -> bool:
    """The model has one instance in the (agreed) state, and every node runs a
    runner for its ranks there and no other: nothing is left serving a history
    that was set aside."""
    state = cluster.node(nodes[0]).get("/state")
    instances = model_instances(state)
    if len(instances) != 1:
        return False
    ranks = [r["node_id"] for r in instances[0]["ranks"]]
    return all(len(runner_pids(cluster.node(i))) == ranks.count(cluster.ids[i]) for i in nodes)


def log_tails(cluster: LanCluster, nodes: list[int]) -> dict[int, dict[str, Any]]:
    """The last event each node holds (while cut: each side's own history)."""
    return {i: events(cluster.node(i))[-1] for i in nodes}


def assert_set_aside_reported(
    cluster: LanCluster,
    nodes: list[int],
    tails: dict[int, dict[str, Any]],
    before: list[dict[str, Any]],
) -> dict[int, dict[str, Any]]:
    """Nodes whose history at the heal is not in the cluster's log now report
    what they set aside, in `/state` (every node's) and in their log: all of
    their own events since the sides parted (after `before`, at or before
    their last). Returns the reports by node."""
    final = events(cluster.node(nodes[0]))
    diverged = [
        i for i, tail in tails.items() if tail["idx"] >= len(final) or final[tail["idx"]] != tail
    ]

    if not diverged:
        return {}

    def reports() -> dict[int, dict[str, Any]] | None:
        set_aside = cluster.node(nodes[-1]).get("/state")["set_aside"]
        found = {i: set_aside[cluster.ids[i]] for i in diverged if cluster.ids[i] in set_aside}
        return found if len(found) == len(diverged) else None

    found: dict[int, dict[str, Any]] = wait_until(reports, 20, "the set-aside reports")
    for i, report in found.items():
        last = int(tails[i]["idx"])
        assert len(before) <= report["from_idx"] <= last, report
        assert report["events"] >= last + 1 - report["from_idx"], report
        assert f"kept them as {report['kept_as']}" in cluster.node(i).log()
    return found


@pytest.fixture(scope="module")
def partition(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Iterator[LanCluster]:
    models = tmp_path_factory.mktemp("partition-models")  # shared, as a network disk
    make_tiny_llama(model_dir(models, MODEL), smollm_dir, n_layers=4)
    cluster = LanCluster(
        tmp_path_factory.mktemp("partition"), models, 4,
        "--model", "none",
        "--node-timeout-seconds", NODE_TIMEOUT_SECONDS,
    )  # fmt: skip
    try:
        if cluster.lan is None:
            pytest.skip(f"partitions need network namespaces: {cluster.why_loopback}")
        cluster.start_agreeing(0, 1, 2, model=MODEL)
        yield cluster
    finally:
        cluster.close()


def place_on(cluster: LanCluster, i: int) -> dict[str, Any]:
    base_url = cluster.node(i).base_url
    body = {"model_id": MODEL, "node_id": cluster.ids[i]}
    placed = httpx.post(f"{base_url}/instance", json=body, timeout=30)
    assert placed.status_code == 201, placed.text
    assert await_instance(base_url, MODEL, timeout=120)[-1]["status"] == "ready"
    return cluster.state()["instances"][placed.json()["instance_id"]]


def master_index(cluster: LanCluster, i: int) -> int:
    return cluster.index_of(cluster.node(i).get("/state")["master_id"])


def cut_and_heal(
    cluster: LanCluster,
    side: list[int],
    other: list[int],
    seconds: float,
    rounds: tuple[float, ...],
) -> tuple[list[Outcome], dict[int, dict[str, Any]], dict[int, str], float]:
    """Cut `side` from `other` for `seconds` (at least until the requests of
    `rounds` have ended), then heal; returns the requests' outcomes, each
    node's last event and master just before the heal, and when it healed."""
    assert cluster.lan is not None
    cut_at = time.monotonic()
    cluster.lan.cut(side, other)
    try:
        outcomes = during_cut(cluster, side + other, rounds)
        time.sleep(max(0.0, cut_at + seconds - time.monotonic()))
        tails = log_tails(cluster, side + other)
        masters = {i: cluster.node(i).get("/state")["master_id"] for i in side + other}
    finally:
        cluster.lan.heal()
    return outcomes, tails, masters, time.monotonic()


def answering(cluster: LanCluster, i: int, since: float) -> str:
    """Seconds from `since` until node `i` answers a chat (and what it said
    before, when it refused); fails past the bound."""
    refusals: list[str] = []
    while time.monotonic() - since < HEALED_BOUND_SECONDS:
        outcome = Outcome(i, time.monotonic() - since)
        ask(cluster.node(i).base_url, outcome)
        if outcome.answer is not None:
            return f"{time.monotonic() - since:.1f}s" + (
                f" (refused: {refusals})" if refusals else ""
            )
        if len(refusals) < 3:
            refusals.append(f"{outcome.sent_at:.1f}s {outcome.error or outcome.unclear}"[:160])
        time.sleep(0.5)
    raise AssertionError(f"node {i} does not answer after the heal: {refusals}")


def assert_healed(
    cluster: LanCluster, nodes: list[int], before: list[dict[str, Any]], healed_at: float
) -> str:
    """One event log, the model served once and answering on every node;
    returns when each came, in seconds after the heal."""
    running = [cluster.node(i) for i in nodes]
    length = assert_one_event_log(running, before)
    agreed_after = time.monotonic() - healed_at
    wait_until(lambda: served_once(cluster, nodes), HEALED_BOUND_SECONDS, "one instance served")
    once_after = time.monotonic() - healed_at
    answered = {i: answering(cluster, i, healed_at) for i in nodes}  # one after the other
    return (
        f"one log of {length} events {agreed_after:.1f}s after the heal, the model served "
        f"once {once_after:.1f}s after, answering on nodes {answered} after"
    )


def test_one_node_of_three_cut_off_for_30s(partition: LanCluster) -> None:
    cluster = partition
    nodes = [0, 1, 2]
    master = master_index(cluster, 0)
    lone = next(i for i in nodes if i != master)
    rest = [i for i in nodes if i != lone]
    place_on(cluster, lone)
    before = events(cluster.node(master))

    outcomes, tails, masters, healed_at = cut_and_heal(
        cluster, [lone], rest, ONE_CUT_SECONDS, ONE_CUT_ROUNDS
    )

    print(f"one of three cut: {summary(outcomes)}; masters while cut: {masters}")
    assert_answered_or_refused(outcomes)
    # Each side had a master of its own; the lone node kept serving its model.
    assert masters[lone] == cluster.ids[lone]
    assert masters[rest[0]] == masters[rest[1]] == cluster.ids[master]
    # The lone node serves its model on its own; the others may still be loading theirs.
    alone = [o for o in outcomes if o.node == lone]
    assert all(o.answer is not None for o in alone), summary(alone)

    wait_until(lambda: agreed([cluster.node(i) for i in nodes]), HEALED_BOUND_SECONDS, "agreed")
    # The bigger side's history is the one the cluster keeps.
    assert cluster.state()["master_id"] == cluster.ids[master]
    diverged = assert_set_aside_reported(cluster, nodes, tails, before)
    assert list(diverged) == [lone], f"histories set aside: {diverged}"
    print(
        f"one of three healed: set aside: {diverged}, "
        + assert_healed(cluster, nodes, before, healed_at)
    )


def test_four_nodes_cut_in_halves(partition: LanCluster) -> None:
    cluster = partition
    cluster.start(3)
    nodes = [0, 1, 2, 3]
    wait_until(lambda: agreed(cluster.running()), 60, "four nodes agreeing")
    for instance_id in cluster.state()["instances"]:
        httpx.delete(f"{cluster.node(0).base_url}/instance/{instance_id}", timeout=20)
    wait_until(lambda: not cluster.state()["instances"], 30, "no instances")
    master = master_index(cluster, 0)
    half = [master, next(i for i in nodes if i != master)]
    other = [i for i in nodes if i not in half]
    place_on(cluster, other[0])
    wait_until(lambda: agreed(cluster.running()), 30, "four nodes agreeing")
    before = events(cluster.node(master))

    outcomes, tails, masters, healed_at = cut_and_heal(
        cluster, half, other, HALVES_CUT_SECONDS, HALVES_CUT_ROUNDS
    )

    print(f"halves cut: {summary(outcomes)}; masters while cut: {masters}")
    assert_answered_or_refused(outcomes)
    assert masters[half[0]] == masters[half[1]] == cluster.ids[master]
    assert masters[other[0]] == masters[other[1]] != cluster.ids[master]
    serving = [o for o in outcomes if o.node in other and o.sent_at >= HALVES_CUT_ROUNDS[-1]]
    assert all(o.answer is not None for o in serving), summary(serving)

    wait_until(lambda: agreed(cluster.running()), HEALED_BOUND_SECONDS, "agreed")
    diverged = assert_set_aside_reported(cluster, nodes, tails, before)
    # One half's history is kept whole; the other half set its own aside.
    assert sorted(diverged) in (sorted(half), sorted(other)), f"set aside: {diverged}"
    print(
        f"halves healed: master {cluster.state()['master_id']}, set aside: {diverged}, "
        + assert_healed(cluster, nodes, before, healed_at)
    )
