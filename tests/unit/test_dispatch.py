"""What a client is told when its request is lost before its answer began on
every try (`dispatch`): the model's runner here stands in for one that fails
each time; routing, retrying and the answer are dispatch's own."""

from types import SimpleNamespace
from typing import Any, cast

import pytest
from starlette.requests import Request

from exo.api.dispatch import dispatch
from exo.api.errors import APIError
from exo.api.reply_retry import ReplyRetry, lost_unanswered
from exo.api.serving import ModelRouter
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import InstanceId, ModelId
from exo.worker.served_model import ServedModel
from tests.unit.test_apply import I1, I2, MODEL, A
from tests.unit.test_routing import View, node_info, state_of


async def test_a_request_lost_before_its_answer_on_every_try_is_worth_sending_again() -> None:
    runner = SimpleNamespace(status="ready", restart=True, instance=SimpleNamespace(instance_id=I1))
    local = cast(ServedModel, SimpleNamespace(model_id=MODEL, runner=runner))
    state = state_of({I1: (A, "ready")}).model_copy(update={"nodes": {A: node_info(A)}})
    router = ModelRouter(
        {ModelId(MODEL): local},
        View(A, state),  # type: ignore[arg-type]
        relay_read_timeout_seconds=3.0,
        retry_seconds=0.3,
    )
    tries: list[ServedModel] = []

    async def answer(model: ServedModel, retry: ReplyRetry) -> Any:
        tries.append(model)
        runner.status = "failed"  # lost, and not back within the retry window
        raise lost_unanswered("runner failed: killed")

    def chat_for(model_id: ModelId) -> ChatRequest:
        raise AssertionError("one replica: nothing to compare prompts with")

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": []})  # fmt: skip
    with pytest.raises(APIError) as lost:
        await dispatch(router, MODEL, request, chat_for, answer)
    assert tries == [local]
    assert lost.value.status == 503 and lost.value.headers["Retry-After"] == "2"
    assert "runner failed: killed" in lost.value.message
    assert "send it again shortly" in lost.value.message


def _router_serving(state_instance: str, runner: SimpleNamespace) -> ModelRouter:
    """This node (A) serving MODEL through `runner`, while the state shows the
    instance `state_instance` on A (a re-placement the runner may not have yet)."""
    local = cast(ServedModel, SimpleNamespace(model_id=MODEL, runner=runner))
    state = state_of({InstanceId(state_instance): (A, "ready")})
    return ModelRouter(
        {ModelId(MODEL): local},
        View(A, state.model_copy(update={"nodes": {A: node_info(A)}})),  # type: ignore[arg-type]
        relay_read_timeout_seconds=3.0,
        retry_seconds=0.3,
    )


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": []})  # fmt: skip


def _one_replica(model_id: ModelId) -> ChatRequest:
    raise AssertionError("one replica: nothing to compare prompts with")


async def test_a_request_lost_here_is_answered_by_this_nodes_re_placed_instance() -> None:
    """The runner lost the request; the model was placed again on this node: the
    retry goes to the new instance here, not into a relay to nowhere."""
    runner = SimpleNamespace(status="ready", restart=True, instance=SimpleNamespace(instance_id=I1))
    router = _router_serving(I2, runner)
    tries: list[InstanceId] = []

    async def answer(model: ServedModel, retry: ReplyRetry) -> Any:
        tries.append(model.runner.instance.instance_id)
        if len(tries) == 1:
            runner.instance = SimpleNamespace(instance_id=I2)  # the re-placed runner
            raise lost_unanswered("runner failed: killed")
        return "answered"

    assert await dispatch(router, MODEL, _request(), _one_replica, answer) == "answered"
    assert tries == [I1, I2]


async def test_this_nodes_instance_without_its_runner_is_not_relayed_to() -> None:
    """The state shows a new instance here before this node's runner serves it:
    the request waits for it within --retry-seconds, then is worth sending
    again (a 503 with Retry-After), never a relay without an address (a 500)."""
    runner = SimpleNamespace(status="ready", restart=True, instance=SimpleNamespace(instance_id=I1))
    router = _router_serving(I2, runner)

    async def answer(model: ServedModel, retry: ReplyRetry) -> Any:
        raise lost_unanswered("runner failed: killed")

    with pytest.raises(APIError) as lost:
        await dispatch(router, MODEL, _request(), _one_replica, answer)
    assert lost.value.status == 503 and lost.value.headers["Retry-After"] == "2"
