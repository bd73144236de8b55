"""Which status the API reports for a model, and when a request for a placed
model is worth retrying (503) rather than unknown (404): pure, over the state."""

from dataclasses import dataclass

import pytest

from exo.api.routing import cluster_models, coming_status
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import State
from tests.unit.test_apply import I1, I2, I3, MODEL, TELEMETRY, A, B, inst, runner

Runs = dict[InstanceId, tuple[NodeId, RunnerStatus | None]]


def state_of(statuses: Runs) -> State:
    """Instances of MODEL by id: (the node of its one rank, its runner's status)."""
    instances = {i: inst(i, node) for i, (node, _) in statuses.items()}
    runners = {
        i: {node: runner(i, node, status)}
        for i, (node, status) in statuses.items()
        if status is not None
    }
    return State(instances=instances, runners=runners)


@pytest.mark.parametrize("order", [(I1, I2), (I2, I1)])
def test_the_most_advanced_instance_names_a_model_s_status(
    order: tuple[InstanceId, InstanceId],
) -> None:
    runs: Runs = {I1: (A, "failed"), I2: (B, "loading")}
    state = state_of({i: runs[i] for i in order})
    assert cluster_models(state) == {MODEL: "loading"}
    runs[I1] = (A, "running")
    assert cluster_models(state_of({i: runs[i] for i in order})) == {MODEL: "running"}


@pytest.mark.parametrize(
    ("status", "first_rank", "expected"),
    [
        (None, B, "downloading"),
        ("starting", B, "starting"),
        ("loading", B, "loading"),
        # Serving on this node, whose API does not serve it yet: a moment away.
        ("ready", A, "starting"),
        ("running", A, "starting"),
        # Failed: its runner restarts, or the master places it again.
        ("failed", A, "restarting"),
        ("stopped", B, "restarting"),
        # Serving elsewhere but not reachable from here: nothing to wait for.
        ("ready", B, None),
    ],
)
def test_a_request_is_worth_retrying_only_for_an_instance_on_its_way(
    status: RunnerStatus | None, first_rank: NodeId, expected: str | None
) -> None:
    state = state_of({I1: (first_rank, status)})
    assert coming_status(state, MODEL, A) == expected
    assert coming_status(state, ModelId("org/other"), A) is None


def test_an_instance_on_a_node_the_master_just_lost_is_worth_a_retry() -> None:
    """Between the master marking its node unreachable and the model placed
    again, a node applying the log sees it serving there: a 503, not a 404."""
    lost = NodeInfo(node_id=B, grpc_address=None, started_at_ms=0, last_seen_ms=0,
                    unreachable_since_ms=5)  # fmt: skip
    state = state_of({I1: (B, "ready")}).model_copy(update={"nodes": {B: lost}})
    assert coming_status(state, MODEL, A) == "moving off a node that was lost"
    view = View(A, state)
    router = ModelRouter({}, view, relay_read_timeout_seconds=3.0)  # type: ignore[arg-type]
    with pytest.raises(APIError) as moving:
        router.find(MODEL)
    assert moving.value.status == 503 and moving.value.headers == {"Retry-After": "2"}
    assert "its instance is moving off a node that was lost" in moving.value.message


# --- replicas: which one serves a request --------------------------------------------

from exo.api.errors import APIError  # noqa: E402
from exo.api.routing import (  # noqa: E402
    RUNNING_REQUEST_TOKENS,
    UNREPORTED_SECONDS,
    WAITING_REQUEST_TOKENS,
    Replica,
    RoutingPolicy,
    UnreportedSends,
    choose_replica,
    load_tokens,
    serving_replicas,
)
from exo.api.serving import ModelRouter  # noqa: E402
from exo.shared.apply import apply  # noqa: E402
from exo.shared.prefix_digests import DIGEST_TOKENS, prefix_digests  # noqa: E402
from exo.shared.types.events import (  # noqa: E402
    IndexedEvent,
    NodeTelemetryReported,
    ReplicaReported,
)
from exo.shared.types.state import (  # noqa: E402
    Instance,
    InstanceRank,
    NodeInfo,
    ReplicaReport,
    UnplacedModel,
)

PROMPT = list(range(40 * DIGEST_TOKENS))
BLOCKS = prefix_digests(PROMPT)


def replica(
    name: str, cached_blocks: int, load: int, local: bool = False, wait: int | None = None
) -> Replica:
    return Replica(
        InstanceId(name),
        NodeId(f"node-{name}"),
        None if local else f"{name}:52415",
        load,
        frozenset(BLOCKS[:cached_blocks]),
        wait,
    )


SLOTS = 4  # each replica's batch


@pytest.mark.parametrize(
    ("replicas", "policy", "chosen", "reason"),
    [
        # The longest cached prefix wins...
        ([replica("a", 2, 0), replica("b", 12, 0)], "cache-aware", "b", "cache"),
        # ... even on a busier replica, while its batch has room (a block per request)...
        ([replica("a", 12, 3), replica("b", 2, 0)], "cache-aware", "a", "cache"),
        # ... but not where the request would wait for a slot (8 blocks per wait)...
        ([replica("a", 12, 4), replica("b", 2, 0)], "cache-aware", "b", "load"),
        # ... unless the cached prefix is worth the wait.
        ([replica("a", 30, 4), replica("b", 2, 0)], "cache-aware", "a", "cache"),
        # A wait as the replica measured it (a slot frees while 256 tokens prefill
        # there): the session stays with its cache one waiting request longer...
        ([replica("a", 12, 5, wait=256), replica("b", 2, 0)], "cache-aware", "a", "cache"),
        # ... and leaves it where a slot frees rarely.
        ([replica("a", 12, 4, wait=2048), replica("b", 2, 0)], "cache-aware", "b", "load"),
        # Nothing cached anywhere: the least loaded, then this node's own.
        ([replica("a", 0, 3), replica("b", 0, 1)], "cache-aware", "b", "least-loaded"),
        ([replica("a", 0, 1), replica("b", 0, 1, local=True)], "cache-aware", "b", "least-loaded"),
        # Equal caches and loads: this node's own.
        ([replica("a", 5, 1), replica("b", 5, 1, local=True)], "cache-aware", "b", "cache"),
        # Other policies ignore the cache.
        ([replica("a", 12, 2), replica("b", 0, 1)], "least-loaded", "b", "least-loaded"),
        ([replica("a", 12, 0)], "cache-aware", "a", "only"),
    ],
)
def test_the_routing_rule(
    replicas: list[Replica], policy: RoutingPolicy, chosen: str, reason: str
) -> None:
    route = choose_replica(replicas, BLOCKS, policy, slots=SLOTS)
    assert (route.replica.instance_id, route.reason) == (chosen, reason)
    expected = len(route.replica.cached) * DIGEST_TOKENS
    assert route.cached_tokens == expected


@pytest.mark.parametrize(
    ("load", "cost"),
    [
        (0, 0),
        (3, 3 * RUNNING_REQUEST_TOKENS),
        (4, 4 * RUNNING_REQUEST_TOKENS + WAITING_REQUEST_TOKENS),  # the next one waits
        (6, 4 * RUNNING_REQUEST_TOKENS + 3 * WAITING_REQUEST_TOKENS),
    ],
)
def test_what_load_costs(load: int, cost: int) -> None:
    assert load_tokens(load, SLOTS) == cost
    # A measured wait replaces the default per request waited for.
    waiting = max(0, load - SLOTS + 1)
    assert load_tokens(load, SLOTS, 300) == cost - waiting * (WAITING_REQUEST_TOKENS - 300)


def test_without_the_prompt_s_digests_the_least_loaded_serves() -> None:
    replicas = [replica("a", 12, 2), replica("b", 0, 1)]
    assert choose_replica(replicas, None).replica.instance_id == "b"


def test_round_robin_takes_turns() -> None:
    replicas = [replica("a", 12, 0), replica("b", 0, 5)]
    chosen = [
        choose_replica(replicas, BLOCKS, "round-robin", t).replica.instance_id for t in range(4)
    ]
    assert chosen == ["a", "b", "a", "b"]


def node_info(node_id: NodeId, unreachable: bool = False) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, grpc_address=f"{node_id}:52414", api_address=f"{node_id}:52415",
        started_at_ms=0, last_seen_ms=0, unreachable_since_ms=1 if unreachable else None,
    )  # fmt: skip


def test_the_replicas_that_serve() -> None:
    C = NodeId("node-c")
    state = state_of({I1: (A, "running"), I2: (B, "ready"), I3: (C, "ready")}).model_copy(
        update={
            "nodes": {A: node_info(A), B: node_info(B), C: node_info(C, unreachable=True)},
            "replicas": {I2: ReplicaReport(cached=frozenset({7}), load=3)},
        }
    )
    replicas = serving_replicas(state, MODEL, A, local_load=2)
    assert [(r.instance_id, r.api_address, r.load, r.cached) for r in replicas] == [
        (I1, None, 2, frozenset()),  # this node's, with its own load
        (I2, "node-b:52415", 3, frozenset({7})),  # node C is unreachable
    ]
    # This node's API does not serve the model (yet): its instance is left out.
    assert [r.instance_id for r in serving_replicas(state, MODEL, A, None)] == [I2]
    assert serving_replicas(state, MODEL, A, 2, exclude={I2}) == replicas[:1]
    assert serving_replicas(state, ModelId("org/other"), A, 0) == []


def test_requests_relayed_here_count_on_a_replica_until_its_report_shows_them() -> None:
    """Sessions whose turns arrive together (a batch's replies ended together),
    each cached on the busier replica B and routed by this node A: the first
    leaves B for C, the next sees C's load with it and stays with B, the third
    sees B's with that one."""
    C = NodeId("node-c")
    reports = {I2: ReplicaReport(cached=frozenset(BLOCKS[:5]), load=4, wait_tokens=400),
               I3: ReplicaReport(load=2, wait_tokens=400)}  # fmt: skip
    state = state_of({I2: (B, "ready"), I3: (C, "ready")}).model_copy(
        update={"nodes": {A: node_info(A), B: node_info(B), C: node_info(C)}, "replicas": reports}
    )
    unreported = UnreportedSends()
    chosen: list[InstanceId] = []
    for _ in range(3):
        replicas = unreported.added(serving_replicas(state, MODEL, A, None), state, now=10.0)
        route = choose_replica(replicas, BLOCKS, slots=SLOTS)
        unreported.sent(route.replica.instance_id, state, now=10.0)
        chosen.append(route.replica.instance_id)
    assert chosen == [I3, I2, I3]
    # Without the count, each would have seen the same loads and left B.
    bare = serving_replicas(state, MODEL, A, None)
    assert choose_replica(bare, BLOCKS, slots=SLOTS).replica.instance_id == I3

    def loads(state: State, now: float) -> list[int]:
        return [
            r.load for r in unreported.added(serving_replicas(state, MODEL, A, None), state, now)
        ]

    assert loads(state, 10.5) == [4 + 1, 2 + 2]
    # C's next report shows its requests (the relays reached it): C's count is settled.
    newer = state.model_copy(
        update={"replicas": {**reports, I3: ReplicaReport(load=4, wait_tokens=400)}}
    )
    assert loads(newer, 10.5) == [4 + 1, 4]
    # Without a newer report, a relayed request counts for a bounded time only.
    assert loads(newer, 10.0 + UNREPORTED_SECONDS) == [4, 4]


@dataclass
class View:
    """The parts of a `ClusterView` the router reads."""

    node_id: NodeId
    state: State
    behind: int = 0

    def events_behind(self) -> int:
        return self.behind


def test_the_router_counts_what_it_relays_until_a_newer_report_is_applied() -> None:
    reports = {I2: ReplicaReport(load=1), I3: ReplicaReport(load=1)}
    C = NodeId("node-c")
    view = View(
        A,
        state_of({I2: (B, "ready"), I3: (C, "ready")}).model_copy(
            update={"nodes": {A: node_info(A), B: node_info(B), C: node_info(C)},
                    "replicas": reports}
        ),
    )  # fmt: skip
    router = ModelRouter({}, view, relay_read_timeout_seconds=3.0)  # type: ignore[arg-type]

    def loads() -> list[int]:
        return [r.load for r in router.replicas(MODEL)]

    [to_b, _] = router.replicas(MODEL)
    router.relay_to(to_b, MODEL)
    router.relay_to(to_b, MODEL)
    assert loads() == [3, 1]
    # Events that leave B's report alone (through `apply`, as the node applies
    # them) keep the count: the state keeps the report's object.
    telemetry = NodeTelemetryReported(node_id=C, telemetry=TELEMETRY)
    view.state = apply(view.state, IndexedEvent(idx=5, at_ms=5, origin=C, event=telemetry))
    assert loads() == [3, 1]
    report = ReplicaReported(node_id=B, instance_id=I2, load=3)
    view.state = apply(view.state, IndexedEvent(idx=6, at_ms=6, origin=B, event=report))
    assert loads() == [3, 1]  # B's own count now


def test_a_model_missing_from_a_node_behind_the_master_is_worth_a_retry() -> None:
    """A node that set its history aside (resumed after a SIGSTOP, say) starts
    empty and catches up: a model it does not know yet may be served."""
    view = View(A, State(), behind=120)
    router = ModelRouter({}, view, relay_read_timeout_seconds=3.0)  # type: ignore[arg-type]
    with pytest.raises(APIError) as behind:
        router.find(MODEL)
    assert behind.value.status == 503
    assert behind.value.headers == {"Retry-After": "2"}
    assert "catching up with the cluster's state, 120 events behind" in behind.value.message
    view.behind = 0
    with pytest.raises(APIError) as caught_up:
        router.find(MODEL)
    assert caught_up.value.status == 404
    assert "Available models: none" in caught_up.value.message


def test_a_model_whose_lost_instance_waits_for_a_node_is_worth_a_retry_unless_given_up() -> None:
    lost = Instance(
        instance_id=InstanceId("lost"),
        model_id=ModelId(MODEL),
        ranks=(InstanceRank(node_id=B, start_layer=0, end_layer=4),),
    )
    waiting = UnplacedModel(instance=lost, since_ms=0, reason="no node has room for it")
    view = View(A, State(unplaced={ModelId(MODEL): waiting}))
    router = ModelRouter({}, view, relay_read_timeout_seconds=3.0)  # type: ignore[arg-type]
    with pytest.raises(APIError) as coming:
        router.find(MODEL)
    assert coming.value.status == 503
    assert coming.value.headers == {"Retry-After": "2"}
    assert "placed again as soon as a node can take it (no node has room for it)" in (
        coming.value.message
    )
    stopped = waiting.model_copy(update={"given_up": True, "reason": "its runners failed"})
    view.state = State(unplaced={ModelId(MODEL): stopped})
    with pytest.raises(APIError) as given_up:
        router.find(MODEL)
    assert given_up.value.status == 503 and "Retry-After" not in given_up.value.headers
    assert given_up.value.code == "model_not_placed"
    assert "stopped placing it again: its runners failed" in given_up.value.message
