"""Which instance serves a request: pure, over the cluster state.

Requests go to an instance's first rank (the runner that takes tasks). With
several instances of a model (replicas), the one whose prefix cache holds the
longest prefix of the prompt wins, unless it is much busier (`choose_replica`)."""

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from exo.shared.prefix_digests import cached_prefix_tokens
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import ReplicaReport, State

SERVING = ("ready", "running")
COMING = ("downloading", "starting", "loading")
# Which of a model's instances' statuses `cluster_models` reports: the most advanced.
_ADVANCE = {"failed": 0, "downloading": 1, "starting": 1, "loading": 1, "ready": 2, "running": 2}


RoutingPolicy = Literal["cache-aware", "least-loaded", "round-robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("cache-aware", "least-loaded", "round-robin")
# What a request ahead on a replica costs a new one there, in prompt tokens it
# could prefill meanwhile: little while it runs beside it in the batch (a batch
# decodes its rows together), much when the new one has to wait for a slot:
# as the replica measures it (`ModelGate.wait_tokens`), this until it has.
RUNNING_REQUEST_TOKENS = 128
WAITING_REQUEST_TOKENS = 1024

RouteReason = Literal["cache", "load", "least-loaded", "round-robin", "only"]
# Longest a request this node relayed counts on top of its replica's report
# when no newer report comes (one comes within milliseconds as a rule).
UNREPORTED_SECONDS = 2.0


@dataclass(frozen=True)
class Replica:
    """An instance of the model that serves, as the routing sees it."""

    instance_id: InstanceId
    node_id: NodeId  # its first rank's node, which takes its requests
    api_address: str | None  # None: this node's own (served without a relay)
    load: int  # requests running or waiting on it
    cached: frozenset[int] = frozenset()  # its prefix cache's digests
    wait_tokens: int | None = None  # what a request waiting there costs; None: not measured

    @property
    def local(self) -> bool:
        return self.api_address is None


@dataclass(frozen=True)
class Route:
    replica: Replica
    reason: RouteReason
    cached_tokens: int  # of the prompt, expected in its cache (to within a block)


def serving_replicas(
    state: State,
    model_id: ModelId,
    self_id: NodeId,
    local_load: int | None,
    exclude: Collection[InstanceId] = (),
) -> list[Replica]:
    """The instances of `model_id` that serve, ordered by id: this node's own
    (with `local_load`, None when it has none) and those of other nodes whose
    API is known and whose node the master has not lost."""
    replicas: list[Replica] = []
    for instance_id, instance in sorted(state.instances.items()):
        first = instance.ranks[0].node_id
        node = state.nodes.get(first)
        if (
            instance.model_id != model_id
            or instance_id in exclude
            or node is None
            or node.unreachable_since_ms is not None
            or state.instance_status(instance) not in SERVING
        ):
            continue
        report = state.replicas.get(instance_id)
        cached = report.cached if report else frozenset[int]()
        wait = report.wait_tokens if report else None
        if first == self_id:
            if local_load is not None:
                replicas.append(Replica(instance_id, first, None, local_load, cached, wait))
        elif node.api_address is not None:
            load = report.load if report else 0
            replicas.append(Replica(instance_id, first, node.api_address, load, cached, wait))
    return replicas


@dataclass
class UnreportedSends:
    """Requests this node relayed to other nodes' replicas that their reports
    may not show yet. A replica's load reaches the other nodes through the
    master's event log, so requests routed within milliseconds of each other
    (a batch's replies ending together, their sessions' next turns arriving
    together) would all see the same load and go to the same replica: each
    counts on top of the replica's report until a newer report is applied
    here, or for `UNREPORTED_SECONDS`. A heuristic: the newer report is as a
    rule the one the replica published on the request's arrival, but one it
    published just before (a release) settles it early. (The state keeps an
    unchanged report's object, so `is` tells a newer one.)"""

    # Per replica: (when sent, monotonic seconds; its report in the state then).
    _sent: dict[InstanceId, list[tuple[float, ReplicaReport | None]]] = field(
        default_factory=dict[InstanceId, list[tuple[float, ReplicaReport | None]]]
    )

    def sent(self, replica: InstanceId, state: State, now: float) -> None:
        self._sent.setdefault(replica, []).append((now, state.replicas.get(replica)))

    def added(self, replicas: Sequence[Replica], state: State, now: float) -> list[Replica]:
        """`replicas` with the requests their reports do not show yet in their load."""
        for instance_id in list(self._sent):
            report = state.replicas.get(instance_id)
            sent = [
                (at, seen)
                for at, seen in self._sent[instance_id]
                if seen is report and now - at < UNREPORTED_SECONDS
            ]
            if sent:
                self._sent[instance_id] = sent
            else:
                del self._sent[instance_id]
        # (Only other nodes' replicas are relayed to: this node's load is live.)
        return [
            replace(r, load=r.load + len(self._sent[r.instance_id]))
            if r.instance_id in self._sent
            else r
            for r in replicas
        ]


def load_tokens(load: int, slots: int, wait_tokens: int | None = None) -> int:
    """What `load` requests running or waiting on a replica with `slots` slots
    (its batch, `--max-concurrent`) cost a new request there, in prompt tokens;
    `wait_tokens`: what one it waits for costs (None: `WAITING_REQUEST_TOKENS`)."""
    running = min(load, slots)
    waiting = max(0, load - slots + 1)  # finishing requests the new one waits for
    per_wait = WAITING_REQUEST_TOKENS if wait_tokens is None else wait_tokens
    return RUNNING_REQUEST_TOKENS * running + per_wait * waiting


def choose_replica(
    replicas: Sequence[Replica],
    prompt_digests: Sequence[int] | None,
    policy: RoutingPolicy = "cache-aware",
    turn: int = 0,
    slots: int = 8,
) -> Route:
    """Where a request goes. Cache-aware: the least cost, where a replica costs
    the prompt tokens it has not cached plus what its load costs (`load_tokens`:
    the replica's batch of `slots` slots being full costs most); so the longest
    cached prefix wins unless requests would wait there. Ties (nothing cached
    anywhere, or no prompt digests: a node without the model's tokenizer) go
    to the least loaded, then this node's own. `turn` picks the round-robin
    replica."""
    if not replicas:
        raise ValueError("no replica to choose from")
    cached = {r.instance_id: cached_prefix_tokens(prompt_digests or (), r.cached) for r in replicas}
    if len(replicas) == 1:
        only = replicas[0]
        return Route(only, "only", cached[only.instance_id])
    if policy == "round-robin":
        chosen = replicas[turn % len(replicas)]
        return Route(chosen, "round-robin", cached[chosen.instance_id])

    def by_load(r: Replica) -> tuple[int, bool, str]:
        return (r.load, not r.local, r.instance_id)

    if policy == "least-loaded" or not any(cached.values()):
        chosen = min(replicas, key=by_load)
        return Route(chosen, "least-loaded", cached[chosen.instance_id])

    def cost(r: Replica) -> tuple[int, int, bool, str]:
        return (load_tokens(r.load, slots, r.wait_tokens) - cached[r.instance_id], *by_load(r))

    chosen = min(replicas, key=cost)
    best = max(cached.values())
    reason: RouteReason = "cache" if cached[chosen.instance_id] == best else "load"
    return Route(chosen, reason, cached[chosen.instance_id])


def cluster_models(state: State) -> dict[ModelId, str]:
    """Every model some instance in the cluster serves, with the best status
    (serving, then on its way, then failed)."""
    best: dict[ModelId, str] = {}
    for instance in state.instances.values():
        status = state.instance_status(instance)
        known = best.get(instance.model_id)
        if known is None or _ADVANCE[status] > _ADVANCE[known]:
            best[instance.model_id] = status
    return best


def coming_status(state: State, model_id: ModelId, self_id: NodeId) -> str | None:
    """How far an instance of `model_id` that is about to serve has got: still
    downloading, starting or loading, or ready with its first rank on this node a
    moment before this node's API serves it ("starting"), or failed: its runner
    restarts or the master places it again ("restarting"), or on a node the
    master lost ("moving …"); None when none is."""
    coming: str | None = None
    for _, instance in sorted(state.instances.items()):
        if instance.model_id != model_id:
            continue
        status = state.instance_status(instance)
        if status in COMING:
            return status
        first = instance.ranks[0].node_id
        if status in SERVING and first == self_id:
            return "starting"
        if status == "failed":
            coming = "restarting"
        elif (node := state.nodes.get(first)) and node.unreachable_since_ms is not None:
            # Its node was lost a moment ago: the master places it again.
            coming = coming or "moving off a node that was lost"
    return coming
