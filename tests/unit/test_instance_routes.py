"""The instance routes as functions over a one-node cluster built in the test:
its commands are decided by the master's `decide` and folded by `apply`, so a
placement shows in the state as it would on a node."""

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from exo.api.errors import APIError, install_error_handlers
from exo.api.instances import (
    InstanceRequest,
    PlaceRequest,
    await_instance,
    create_instance,
    delete_instance,
    delete_model,
    instance_previews,
    instance_routes,
    instance_updates,
    list_instances,
    place_instance,
)
from exo.master.commands import decide
from exo.models.file_source import RemoteFile, SourceUnavailable, TransientError
from exo.shared.apply import apply
from exo.shared.types.commands import ClusterUnavailable, Command, PlaceInstance
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    ModelCardPublished,
    NodeJoined,
    NodeTelemetryReported,
    RunnerStatusChanged,
)
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import NodeTelemetry, State
from tests.unit.sharded_card import GB, MB, sharded_card

NODE = NodeId("node-a")
PEER = NodeId("node-b")  # a second node, in `cluster_of_two`
KNOWN = ModelId("org/known")  # the state has its card
EVEN = ModelId("org/even")  # its card's heads split in two
ON_HUB = ModelId("hub-org/tiny")  # only the hub has it
HUB_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
    "vocab_size": 100,
    "torch_dtype": "bfloat16",
}


class LocalCluster:
    """A `ClusterView` of one node that is also the master."""

    def __init__(self, reachable: bool = True) -> None:
        self.node_id = NODE
        self.address = "127.0.0.1:52414"
        self.resumed_from_idx = 0
        self.master_id: NodeId | None = NODE
        self.event_log_error: str | None = None
        self.state = State()
        self.reachable = reachable
        self.commands: list[Command] = []
        self.published: list[Event] = []

    def index(self, *events: Event) -> int:
        """Apply `events` as the master's next ones; the index of the last."""
        for event in events:
            indexed = IndexedEvent(
                idx=self.state.last_idx + 1, at_ms=1, origin=self.node_id, event=event
            )
            self.state = apply(self.state, indexed)
        return self.state.last_idx

    def events_behind(self) -> int:
        return 0  # the master

    def subscribe(self, from_idx: int) -> AsyncIterator[IndexedEvent]:
        raise NotImplementedError  # no route here reads the event stream

    async def send_command(self, command: Command) -> int:
        self.commands.append(command)
        if not self.reachable:
            raise ClusterUnavailable("no master answered")
        return self.index(*decide(self.state, command))

    async def wait_until(self, idx: int, timeout: float) -> bool:
        return self.state.last_idx >= idx

    def publish(self, *events: Event) -> None:
        self.published.extend(events)

    def heard_ms(self) -> dict[NodeId, int]:
        return {}


class Hub:
    """A `FileSource` with one repo, `ON_HUB`'s config (no weights are read);
    `failure`: what every call raises instead."""

    def __init__(self, failure: Exception | None = None) -> None:
        self.name = "hub"
        self.failure = failure
        self.files = {"config.json": json.dumps(HUB_CONFIG).encode()}

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        if self.failure is not None:
            raise self.failure
        if model_id != ON_HUB:
            raise SourceUnavailable(f"{model_id} not found on the hub")
        sizes = {"model.safetensors": 10**6} | {p: len(d) for p, d in self.files.items()}
        return [RemoteFile(path=path, size=size) for path, size in sizes.items()]

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        yield self.files[path][offset:]


def cluster_of_one(reachable: bool = True) -> LocalCluster:
    """NODE with 16 GB free and `KNOWN`'s card."""
    cluster = LocalCluster(reachable)
    telemetry = NodeTelemetry(
        ram_total=16 * GB, ram_available=16 * GB, disk_free=100 * GB,
        cpu_count=8, platform="darwin", mlx_backend="metal",
    )  # fmt: skip
    cluster.index(
        NodeJoined(node_id=NODE, grpc_address=cluster.address, started_at_ms=0),
        NodeTelemetryReported(node_id=NODE, telemetry=telemetry),
        ModelCardPublished(card=sharded_card(KNOWN)),
    )
    return cluster


def cluster_of_two() -> LocalCluster:
    """`cluster_of_one` and PEER, with 16 GB free too, and `EVEN`'s card."""
    cluster = cluster_of_one()
    telemetry = cluster.state.nodes[NODE].telemetry
    assert telemetry is not None
    cluster.index(
        NodeJoined(node_id=PEER, grpc_address="127.0.0.2:52414", started_at_ms=0),
        NodeTelemetryReported(node_id=PEER, telemetry=telemetry),
        ModelCardPublished(card=sharded_card(EVEN, n_kv_heads=2, intermediate_size=128)),
    )
    return cluster


async def raised(call: Awaitable[Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        await call
    return caught.value


async def test_a_preview_of_a_hub_model_publishes_nothing() -> None:
    cluster = cluster_of_one()
    before = cluster.state
    previews = await instance_previews(cluster.state, Hub(), ON_HUB)
    [rank] = previews["placements"][0]["ranks"]
    assert (rank["node_id"], rank["start_layer"], rank["end_layer"]) == (NODE, 0, 4)
    assert cluster.state == before and ON_HUB not in cluster.state.cards
    assert cluster.commands == [] and cluster.published == []


async def test_a_preview_says_each_nodes_weights_and_kv() -> None:
    [first, *_] = (await instance_previews(cluster_of_one().state, Hub(), ON_HUB))["placements"]
    # HUB_CONFIG: 4 layers, keys and values of one 16-wide KV head per token, a
    # 4096-token context; float16 on Metal.
    assert first["kv_bytes"] == {NODE: 4 * 2 * 16 * 2 * 4096}
    assert first["weight_bytes"][NODE] > 0
    assert first["memory_bytes"][NODE] == first["weight_bytes"][NODE] + first["kv_bytes"][NODE]


async def test_the_previews_route_publishes_nothing() -> None:
    cluster = cluster_of_one()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(instance_routes(cluster, Hub()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        ok = await client.get("/instance/previews", params={"model_id": ON_HUB})
        refused = await client.get("/instance/previews", params={"model_id": "../etc"})
    assert ok.status_code == 200, ok.text
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "model_id"
    assert ON_HUB not in cluster.state.cards
    assert cluster.commands == [] and cluster.published == []


async def test_placing_a_hub_model_publishes_its_card_with_the_instance() -> None:
    cluster = cluster_of_one()
    first = (await instance_previews(cluster.state, Hub(), ON_HUB))["placements"][0]
    placed = await place_instance(cluster, Hub(), PlaceRequest(model_id=ON_HUB))
    assert placed["model_id"] == ON_HUB and placed["status"] == "downloading"
    assert placed["ranks"][0]["node_id"] == first["ranks"][0]["node_id"]
    [command] = cluster.commands
    assert isinstance(command, PlaceInstance) and command.card is not None
    assert cluster.state.cards[ON_HUB] == command.card
    assert cluster.published == []  # the master indexed the card, no node published it
    assert list_instances(cluster.state)["data"] == [placed]


async def test_a_whole_model_is_created_on_this_node_and_deleted() -> None:
    cluster = cluster_of_one()
    created = await create_instance(cluster, None, InstanceRequest(model_id=KNOWN))
    [rank] = created["ranks"]
    assert (rank["node_id"], rank["start_layer"], rank["end_layer"]) == (NODE, 0, 4)
    instance_id = created["instance_id"]
    assert await delete_instance(cluster, instance_id) == {"deleted": instance_id}
    assert cluster.state.instances == {}


async def test_a_tensor_preview_says_so_and_each_nodes_share() -> None:
    previews = await instance_previews(cluster_of_two().state, Hub(), EVEN, sharding="tensor")
    assert previews["sharding"] == "tensor"
    [only] = previews["placements"]  # two nodes hold one tensor instance
    assert only["sharding"] == "tensor"
    assert [(r["node_id"], r["start_layer"], r["end_layer"]) for r in only["ranks"]] == [
        (NODE, 0, 4),
        (PEER, 0, 4),
    ]
    # Half of the 4 x 100 MB layers and the 50 MB embedding and head whole, each.
    assert only["weight_bytes"] == {NODE: 300 * MB, PEER: 300 * MB}
    # 4 layers of keys and values of 2 KV heads of 32 over 4096 tokens in fp16, halved.
    half_kv = 4 * 2 * 2 * 32 * 4096 * 2 // 2
    assert only["kv_bytes"] == {NODE: half_kv, PEER: half_kv}
    pipeline = await instance_previews(cluster_of_two().state, Hub(), EVEN)
    assert {p["sharding"] for p in pipeline["placements"]} == {"pipeline"}


async def test_placing_by_tensors_gives_each_rank_every_layer() -> None:
    cluster = cluster_of_two()
    placed = await place_instance(cluster, Hub(), PlaceRequest(model_id=EVEN, sharding="tensor"))
    assert placed["sharding"] == "tensor" and placed["status"] == "downloading"
    assert [(r["start_layer"], r["end_layer"]) for r in placed["ranks"]] == [(0, 4), (0, 4)]
    [command] = cluster.commands
    assert isinstance(command, PlaceInstance) and command.sharding == "tensor"
    [instance] = cluster.state.instances.values()
    assert instance.sharding == "tensor"


async def test_a_bad_sharding_is_a_400_naming_it() -> None:
    cluster = cluster_of_two()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(instance_routes(cluster, Hub()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        preview = await client.get(
            "/instance/previews", params={"model_id": EVEN, "sharding": "diagonal"}
        )
        placed = await client.post("/place_instance", json={"model_id": EVEN, "sharding": "rows"})
        tensor = await client.get(
            "/instance/previews", params={"model_id": EVEN, "sharding": "tensor"}
        )
    for refused in (preview, placed):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"].endswith("sharding")
        assert "'pipeline' or 'tensor'" in error["message"]
    assert cluster.commands == []
    assert tensor.status_code == 200, tensor.text
    assert tensor.json()["placements"][0]["sharding"] == "tensor"


async def test_heads_a_tensor_split_does_not_divide_are_a_400_before_any_download() -> None:
    cluster = cluster_of_two()
    request = PlaceRequest(model_id=KNOWN, sharding="tensor")  # KNOWN has one KV head
    error = await raised(place_instance(cluster, Hub(), request))
    assert (error.status, error.code) == (400, "invalid_request")
    assert (
        "cannot split org/known by tensors: across 2 nodes, 2 ranks need 2 KV heads at least, it has 1"
        in (error.message)
    )
    assert cluster.state.instances == {}
    error = await raised(instance_previews(cluster.state, Hub(), KNOWN, sharding="tensor"))
    assert (error.status, error.code) == (400, "placement_infeasible")


Call = Callable[[LocalCluster], Awaitable[Any]]

# fmt: off
ERRORS: list[tuple[str, Call, int, str, str]] = [
    ("bad model id", lambda c: instance_previews(c.state, Hub(), "../etc"),
     400, "invalid_request", "../etc"),
    ("bad model id placed", lambda c: place_instance(c, Hub(), PlaceRequest(model_id="a/b/c")),
     400, "invalid_request", "a/b/c"),
    ("no hub", lambda c: instance_previews(c.state, None, ON_HUB),
     404, "model_not_found", "models the cluster knows: org/known"),
    ("not on the hub", lambda c: instance_previews(c.state, Hub(), "org/absent"),
     404, "model_not_found", "the hub does not either"),
    ("hub unreachable", lambda c: instance_previews(c.state, Hub(TransientError("reset")), ON_HUB),
     503, "hub_unavailable", "reset"),
    ("too few nodes", lambda c: instance_previews(c.state, Hub(), KNOWN, min_nodes=2),
     400, "placement_infeasible", "on at least 2 nodes: the cluster has 1 node that can run models"),
    ("bad max_nodes", lambda c: instance_previews(c.state, Hub(), KNOWN, max_nodes=0),
     400, "placement_infeasible", "must be 1 or more"),
    ("tensor on one node", lambda c: instance_previews(c.state, Hub(), KNOWN, sharding="tensor"),
     400, "placement_infeasible", "a tensor instance needs at least 2"),
    ("unknown node",
     lambda c: create_instance(c, None, InstanceRequest(model_id=KNOWN, node_id="ghost")),
     404, "not_found", "ghost"),
    ("unknown instance", lambda c: delete_instance(c, "nope"),
     404, "not_found", "nope"),
    ("no models here", lambda c: delete_model(c, None, KNOWN),
     404, "not_found", "keeps no models"),
]
# fmt: on


@pytest.mark.parametrize(
    ("call", "status", "code", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
async def test_errors(call: Call, status: int, code: str, message: str) -> None:
    error = await raised(call(cluster_of_one()))
    assert (error.status, error.code) == (status, code), error.message
    assert message in error.message


async def test_no_master_is_a_503_and_the_command_was_tried() -> None:
    cluster = cluster_of_one(reachable=False)
    error = await raised(place_instance(cluster, None, PlaceRequest(model_id=KNOWN)))
    assert (error.status, error.code) == (503, "cluster_unavailable")
    assert len(cluster.commands) == 1


async def test_a_model_in_use_here_is_not_deleted() -> None:
    cluster = cluster_of_one()
    deleted: list[ModelId] = []

    async def delete_files(model_id: ModelId) -> bool:
        deleted.append(model_id)
        return model_id == KNOWN

    created = await create_instance(cluster, None, InstanceRequest(model_id=KNOWN))
    error = await raised(delete_model(cluster, delete_files, KNOWN))
    assert (error.status, error.code) == (409, "model_in_use")
    assert created["instance_id"] in error.message and deleted == []
    await delete_instance(cluster, created["instance_id"])
    assert await delete_model(cluster, delete_files, KNOWN) == {"deleted": KNOWN, "node_id": NODE}
    error = await raised(delete_model(cluster, delete_files, ModelId("org/other")))
    assert (error.status, error.code) == (404, "not_found")


def test_await_refuses_a_bad_timeout_and_an_unplaced_model() -> None:
    cluster = cluster_of_one()
    with pytest.raises(APIError) as bad:
        await_instance(cluster, KNOWN, timeout=0)
    assert (bad.value.status, bad.value.param) == (400, "timeout")
    with pytest.raises(APIError) as unplaced:
        await_instance(cluster, KNOWN, timeout=1)
    assert (unplaced.value.status, unplaced.value.code) == (404, "instance_not_found")


async def test_await_ends_with_ready_once_the_runner_is() -> None:
    cluster = cluster_of_one()
    created = await create_instance(cluster, None, InstanceRequest(model_id=KNOWN))
    cluster.index(
        RunnerStatusChanged(
            instance_id=InstanceId(created["instance_id"]), node_id=NODE, status="ready"
        )
    )
    events = [event async for event in instance_updates(cluster, KNOWN, timeout=5)]
    [event] = events
    payload = json.loads(event.removeprefix("data: "))
    assert payload["status"] == "ready"
    assert payload["instances"][0]["instance_id"] == created["instance_id"]


async def test_a_whole_model_too_large_for_its_node_is_refused_as_placement_would() -> None:
    cluster = cluster_of_one()
    hub = Hub()
    # Keys and values of 1024 heads 16384 wide, over 512 layers: terabytes of KV reserve.
    wide = {"num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 16384}
    huge = HUB_CONFIG | wide | {"num_hidden_layers": 512}
    hub.files["config.json"] = json.dumps(huge).encode()
    error = await raised(create_instance(cluster, hub, InstanceRequest(model_id=ON_HUB)))
    assert (error.status, error.code, error.param) == (400, "placement_infeasible", "node_id")
    assert f"{ON_HUB} needs" in error.message and "free" in error.message
    assert cluster.commands == [] and cluster.state.instances == {}
    # What fits is created, and the same model twice on one node is refused.
    await create_instance(cluster, None, InstanceRequest(model_id=KNOWN))
    again = await raised(create_instance(cluster, None, InstanceRequest(model_id=KNOWN)))
    assert (again.status, again.code) == (400, "placement_infeasible")
