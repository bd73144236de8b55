"""When a request lost before its first token runs again (`reply_retry`), and
how a routed stream's answer waits for its first token (`held_until`).
The runner here is a stand-in with a status: what is tested is the waiting."""

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

import anyio
import pytest

from exo.api.errors import APIError
from exo.api.generation import held_until
from exo.api.reply_retry import ReplyRetry, is_unanswered, lost_unanswered
from exo.api.reply_stream import KeepAlive, ReplyEvent, TextPiece
from exo.shared.types.ids import ModelId
from exo.worker.served_model import ServedModel

MODEL = ModelId("test-org/model")


@dataclass
class Runner:
    status: str
    restart: bool = True  # a whole-model runner restarts by itself


def served(runner: Runner) -> ServedModel:
    return cast(Any, type("Served", (), {"model_id": MODEL, "runner": runner})())


def retry(
    models: dict[ModelId, ServedModel], elsewhere: bool = False, routed: bool = False
) -> ReplyRetry:
    return ReplyRetry(2.0, models.get, lambda model_id: elsewhere, routed=routed)


async def test_a_restarting_runner_is_waited_for_until_it_serves() -> None:
    runner = Runner("failed")
    model = served(runner)
    waiting = retry({MODEL: model}, elsewhere=True)  # restarting here beats elsewhere

    async def comes_back() -> None:
        await anyio.sleep(0.3)
        runner.status = "loading"
        await anyio.sleep(0.3)
        runner.status = "ready"

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(comes_back)
        assert await waiting.runner_back(MODEL) is model
    assert 0.5 <= time.monotonic() - started < 1.5


async def test_a_model_placed_here_again_is_taken() -> None:
    models: dict[ModelId, ServedModel] = {MODEL: served(Runner("stopped", restart=False))}
    waiting = retry(models)

    async def placed_again() -> None:
        await anyio.sleep(0.3)
        models[MODEL] = served(Runner("ready"))

    back: ServedModel | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(placed_again)
        back = await waiting.runner_back(MODEL)
    assert back is models[MODEL]


@pytest.mark.parametrize(
    ("routed", "elsewhere"),
    [(True, False), (False, True)],
    ids=["routed: its routing node sends it on", "served elsewhere: routed there"],
)
async def test_a_request_that_can_go_elsewhere_does_not_wait(routed: bool, elsewhere: bool) -> None:
    models = {MODEL: served(Runner("stopped", restart=False))}
    waiting = retry(models, elsewhere=elsewhere, routed=routed)
    started = time.monotonic()
    assert await waiting.runner_back(MODEL) is None
    assert time.monotonic() - started < 0.1


async def test_nothing_to_wait_for_ends_at_the_deadline_counted_from_the_first_loss() -> None:
    waiting = ReplyRetry(0.5, lambda model_id: None, lambda model_id: False)
    deadline = waiting.deadline()
    await anyio.sleep(0.2)
    assert waiting.deadline() == deadline  # one window per request
    started = time.monotonic()
    assert await waiting.runner_back(MODEL) is None
    assert 0.2 <= time.monotonic() - started < 0.6


def test_a_loss_before_the_first_token_is_marked_for_the_routing_node() -> None:
    error = lost_unanswered("runner failed: killed")
    assert (error.status, error.code) == (503, "runner_unavailable")
    assert is_unanswered(error)
    assert not is_unanswered(APIError(503, "busy", "server_error", "queue_timeout"))


async def test_a_routed_answer_begins_with_its_first_token() -> None:
    closed: list[bool] = []

    async def reply() -> AsyncGenerator[ReplyEvent]:
        try:
            yield KeepAlive()
            yield KeepAlive()
            yield TextPiece(text="Hello")
            yield TextPiece(text=" world")
        finally:
            closed.append(True)

    events = await held_until(reply())
    assert [e async for e in events] == [TextPiece(text="Hello"), TextPiece(text=" world")]
    assert closed == [True]


async def test_a_loss_before_the_first_token_is_raised_before_the_answer_begins() -> None:
    async def reply() -> AsyncGenerator[ReplyEvent]:
        yield KeepAlive()
        raise lost_unanswered("runner failed")

    with pytest.raises(APIError) as lost:
        await held_until(reply())
    assert is_unanswered(lost.value)


async def test_an_answer_left_after_its_first_token_closes_the_reply() -> None:
    closed: list[bool] = []

    async def reply() -> AsyncGenerator[ReplyEvent]:
        try:
            yield TextPiece(text="a")
            yield TextPiece(text="b")
        finally:
            closed.append(True)

    events = await held_until(reply())
    assert await anext(events) == TextPiece(text="a")
    await events.aclose()  # its client went away
    assert closed == [True]
