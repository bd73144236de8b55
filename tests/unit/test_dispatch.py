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
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel
from tests.unit.test_apply import I1, MODEL, A
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
