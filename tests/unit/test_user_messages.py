"""What a user reads when something goes wrong: in the user's words, naming
what to do, never an internal parameter or exception repr."""

import httpx
import pytest
from starlette.requests import Request

from exo.api.auth import APIAccess, access_error
from exo.api.instances import close_model_ids, instance_previews, known_card
from exo.api.serving import Relay, _relay_refused_key, relay_failed
from exo.master.commands import decide
from exo.master.placement import PlacementError, PlacementRequest, preview
from exo.models.file_source import TransientError
from exo.shared.types.commands import CommandRejected, ForgetNode
from exo.shared.types.events import NodeForgotten
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, InstanceRank, NodeInfo, Relocation, State
from exo.worker.downloads.hub import OFFLINE_ADVICE, hub_unreachable
from exo.worker.plan import stop_reason
from tests.unit.test_instance_routes import KNOWN, NODE, Hub, cluster_of_one, raised

SMOL = ModelId("SmolLM2-135M-Instruct")
A, B, C = NodeId("node-a"), NodeId("node-b"), NodeId("node-c")


def _request(headers: dict[str, str]) -> Request:
    return Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "query_string": b"",
        }
    )


# --- the hub ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            httpx.ConnectError("[Errno -2] Name or service not known"),
            "its name does not resolve: is this machine offline?",
        ),
        (httpx.ConnectError("[Errno 111] Connection refused"), "the connection failed"),
        (httpx.ConnectTimeout("timed out"), "it did not answer in time"),
    ],
)
def test_an_unreachable_hub_says_what_to_do_offline(
    error: httpx.TransportError, reason: str
) -> None:
    message = hub_unreachable("https://huggingface.co", error)
    assert message.startswith("cannot reach the Hugging Face hub at https://huggingface.co")
    assert reason in message
    assert "ConnectError(" not in message and "Errno -2" not in message
    assert "models directory" in message and "HF_ENDPOINT" in message


async def test_the_preview_of_a_hub_model_without_the_hub_gives_the_advice() -> None:
    failure = TransientError(hub_unreachable("https://hf.co", httpx.ConnectError("[Errno -2] x")))
    error = await raised(instance_previews(cluster_of_one().state, Hub(failure), "org/new"))
    assert (error.status, error.code) == (503, "hub_unavailable")
    assert OFFLINE_ADVICE in error.message


# --- did you mean ----------------------------------------------------------------

KNOWN_IDS = [str(SMOL), "mlx-community/Qwen3-0.6B-4bit", "org/known"]


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("SmolLM2-135M-Instruc", [SMOL]),
        ("smollm2-135m-instruct", [SMOL]),
        ("SmolLM2-135-Instruct", [SMOL]),
        ("mlx-community/Qwen3-0.6B-4bt", ["mlx-community/Qwen3-0.6B-4bit"]),
        ("Qwen3-0.6B-4bit", ["mlx-community/Qwen3-0.6B-4bit"]),
        ("meta-llama/Llama-3.2-1B", []),
        ("x", []),
    ],
)
def test_close_model_ids(typed: str, expected: list[str]) -> None:
    assert close_model_ids(typed, KNOWN_IDS) == expected


async def test_a_typo_of_a_local_model_is_answered_without_the_hub() -> None:
    state = cluster_of_one().state
    state = state.model_copy(update={"cards": {**state.cards, SMOL: state.cards[KNOWN]}})
    # The hub would fail: it is not asked for an id that is a typo of a local one.
    error = await raised(
        known_card(state, ModelId("SmolLM2-135M-Instruc"), Hub(TransientError("no network")))
    )
    assert (error.status, error.code) == (404, "model_not_found")
    assert "did you mean SmolLM2-135M-Instruct?" in error.message
    assert "no network" not in error.message


async def test_an_unknown_hub_id_close_to_a_known_one_suggests_it_too() -> None:
    error = await raised(known_card(cluster_of_one().state, ModelId("org/knwn"), Hub()))
    assert "the hub does not either" in error.message
    assert "did you mean org/known?" in error.message


# --- placement -------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        PlacementRequest(min_nodes=2),
        PlacementRequest(min_nodes=3, max_nodes=2),
        PlacementRequest(max_nodes=1, sharding="tensor"),
        PlacementRequest(min_nodes=5, sharding="tensor"),
    ],
)
def test_placement_refusals_name_no_parameter(request_: PlacementRequest) -> None:
    state = cluster_of_one().state
    with pytest.raises(PlacementError) as refused:
        preview(state.cards[KNOWN], state, request_)
    message = str(refused.value)
    assert "min_nodes" not in message and "max_nodes" not in message, message
    assert "telemetry" not in message, message
    assert "at least" in message or "at most" in message, message


async def test_a_preview_of_no_nodes_at_all_names_no_parameter() -> None:
    error = await raised(instance_previews(cluster_of_one().state, Hub(), KNOWN, max_nodes=0))
    assert "max_nodes" not in error.message and "must be 1 or more" in error.message


# --- a runner stopped mid-answer -------------------------------------------------


def _instance(instance_id: str, *nodes: NodeId, moved: Relocation | None = None) -> Instance:
    n = len(nodes)
    ranks = tuple(InstanceRank(node_id=x, start_layer=i * 4 // n, end_layer=(i + 1) * 4 // n)
                  for i, x in enumerate(nodes))  # fmt: skip
    return Instance(instance_id=InstanceId(instance_id), model_id=SMOL, ranks=ranks, moved=moved)


@pytest.mark.parametrize(
    ("moved", "expected"),
    [
        (
            Relocation(from_nodes=(B,), reason="node_lost"),
            "the cluster moved it to node node-a, node-c after node node-b was lost",
        ),
        (
            Relocation(from_nodes=(B,), reason="runner_failed"),
            "after its runner failed on node node-b",
        ),
        (None, "it was deleted or placed again"),
    ],
)
def test_a_stopped_instance_says_where_its_model_went(
    moved: Relocation | None, expected: str
) -> None:
    old = _instance("old", A, B)
    state = State(
        instances={} if moved is None else {InstanceId("new"): _instance("new", A, C, moved=moved)}
    )
    reason = stop_reason(state, old)
    assert expected in reason
    assert "shutting down" not in reason


# --- API keys --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"host": "10.0.0.2:52415"}, "node node-a (studio) at 10.0.0.2:52415 needs an API key"),
        (
            {"host": "10.0.0.2:52415", "authorization": "Bearer wrong"},
            "node node-a (studio) at 10.0.0.2:52415 refused the API key it was sent",
        ),
    ],
)
def test_a_401_names_the_node_and_says_whether_the_key_was_refused(
    headers: dict[str, str], expected: str
) -> None:
    error = access_error(_request(headers), APIAccess(api_key="right"), "node node-a (studio)")
    assert error is not None and error.status == 401
    assert expected in error.message


RELAY = Relay(api_address="10.0.0.3:52415", model_id=SMOL, read_timeout_seconds=30)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"authorization": "Bearer k"}, "refused the API key that this node accepted"),
        ({"x-api-key": "k"}, "the nodes' API keys differ"),
        ({}, "needs an API key, which this node does not"),
    ],
)
def test_a_relayed_401_says_it_is_the_serving_node_that_refused(
    headers: dict[str, str], expected: str
) -> None:
    error = _relay_refused_key(RELAY, _request(headers))
    assert (error.status, error.code) == (401, "relayed_invalid_api_key")
    assert "the node at 10.0.0.3:52415 that serves SmolLM2-135M-Instruct" in error.message
    assert expected in error.message


def test_a_relay_to_a_node_that_is_gone_says_so() -> None:
    error = relay_failed(RELAY, httpx.ConnectError("[Errno 111] Connection refused"))
    assert "refuses connections (it may have stopped)" in error.message
    assert "ConnectError" not in error.message


# --- forgetting a node -----------------------------------------------------------

GONE = NodeInfo(node_id=C, grpc_address=None, started_at_ms=0, last_seen_ms=0, timed_out_at_ms=9)


def test_a_node_that_timed_out_can_be_forgotten() -> None:
    state = State(gone_nodes={C: GONE})
    assert decide(state, ForgetNode(node_id=C)) == [NodeForgotten(node_id=C)]


def test_a_live_or_unknown_node_cannot_be_forgotten() -> None:
    live = cluster_of_one().state
    with pytest.raises(CommandRejected, match="still in the cluster"):
        decide(live, ForgetNode(node_id=NODE))
    with pytest.raises(CommandRejected, match="no node 'ghost' timed out") as refused:
        decide(live, ForgetNode(node_id=NodeId("ghost")))
    assert refused.value.not_found
