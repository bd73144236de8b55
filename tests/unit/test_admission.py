"""Admission control: the decision, Retry-After, the per-model gate and the body limit."""

import json
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from fastapi import FastAPI, Request

from exo.api.admission import (
    RETRY_AFTER_MAX_SECONDS,
    Admission,
    AdmissionDecision,
    AdmissionLimits,
    AdmissionMiddleware,
    BodyLimitMiddleware,
    ModelGate,
    admission_decision,
    admit,
    retry_after_seconds,
)
from exo.api.errors import APIError, install_error_handlers
from exo.shared.types.ids import ModelId

MODEL = ModelId("m")


def limits(concurrent: int = 2, queued: int = 1, timeout: float = 5.0) -> AdmissionLimits:
    return AdmissionLimits(
        max_concurrent=concurrent, max_queued=queued, queue_timeout_seconds=timeout
    )


@pytest.mark.parametrize(
    ("running", "queued", "max_concurrent", "max_queued", "expected"),
    [
        (0, 0, 1, 0, "run"),
        (1, 0, 2, 0, "run"),
        (1, 0, 1, 1, "queue"),
        (2, 0, 2, 0, "reject"),  # no queue: busy means refused
        (1, 1, 2, 2, "queue"),  # a free slot with waiters: nobody overtakes them
        (2, 1, 2, 2, "queue"),
        (2, 2, 2, 2, "reject"),
        (8, 32, 8, 32, "reject"),
    ],
)
def test_admission_decision(
    running: int, queued: int, max_concurrent: int, max_queued: int, expected: AdmissionDecision
) -> None:
    assert admission_decision(running, queued, limits(max_concurrent, max_queued)) == expected


@pytest.mark.parametrize(
    ("mean_hold", "max_concurrent", "expected"),
    [
        (None, 4, 1),  # nothing finished yet
        (0.2, 1, 1),  # at least a second
        (10.0, 1, 10),
        (10.0, 4, 3),  # a slot frees every 2.5 s: rounded up
        (3600.0, 2, RETRY_AFTER_MAX_SECONDS),
    ],
)
def test_retry_after(mean_hold: float | None, max_concurrent: int, expected: int) -> None:
    assert retry_after_seconds(mean_hold, max_concurrent) == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"max_concurrent": 0},
        {"max_queued": -1},
        {"queue_timeout_seconds": 0},
        {"max_body_bytes": 0},
    ],
)
def test_limits_reject_values_that_admit_nothing(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdmissionLimits.model_validate(bad)


async def test_a_full_gate_refuses_with_429_and_retry_after() -> None:
    gate = ModelGate(MODEL, limits(concurrent=1, queued=0))
    held = await gate.acquire()
    with pytest.raises(APIError) as refused:
        await gate.acquire()
    assert refused.value.status == 429
    assert refused.value.headers == {"Retry-After": "1"}
    held.release()
    held.release()  # idempotent: the slot is not given back twice
    assert gate.running == 0
    (await gate.acquire()).release()


async def test_a_gate_measures_what_a_wait_for_a_slot_costs() -> None:
    told: list[tuple[int, int | None]] = []
    gate = ModelGate(
        MODEL,
        limits(concurrent=2, queued=1),
        on_load=lambda model_id, load, wait: told.append((load, wait)),
    )
    slot = await gate.acquire()
    assert told == [(1, None)]  # nothing measured yet
    await anyio.sleep(0.1)
    slot.first_token()  # its prompt prefilled in >= 0.1 s
    await anyio.sleep(0.1)
    slot.first_token()  # (only the first counts)
    slot.prefilled(100)
    slot.release()
    rate, hold = gate.prefill_tokens_per_second, gate.mean_hold_seconds
    assert rate is not None and 300 < rate <= 1000, rate
    assert hold is not None and hold >= 0.2
    # A slot frees every hold / 2 seconds, while `rate` tokens a second prefill.
    assert gate.wait_tokens == round(hold / 2 * rate)
    assert told[-1] == (0, gate.wait_tokens)
    # A reply without a token, or wholly cached, says nothing of the rate.
    for first_token, prefilled in ((False, 50), (True, 0)):
        slot = await gate.acquire()
        if first_token:
            slot.first_token()
        slot.prefilled(prefilled)
        slot.release()
        assert gate.prefill_tokens_per_second == rate


async def test_waiters_get_slots_first_come_first_served() -> None:
    gate = ModelGate(MODEL, limits(concurrent=1, queued=3))
    first = await gate.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        slot = await gate.acquire()
        order.append(i)
        slot.release()

    async with anyio.create_task_group() as group:
        for i in range(3):
            group.start_soon(wait, i)
            await anyio.wait_all_tasks_blocked()
        assert (gate.running, gate.queued) == (1, 3)
        first.release()
    assert order == [0, 1, 2]
    assert (gate.running, gate.queued) == (0, 0)


async def test_a_wait_past_the_queue_timeout_is_a_503() -> None:
    gate = ModelGate(MODEL, limits(concurrent=1, queued=1, timeout=0.05))
    held = await gate.acquire()
    with pytest.raises(APIError) as timed_out:
        await gate.acquire()
    assert timed_out.value.status == 503
    assert "Retry-After" in timed_out.value.headers
    assert (gate.running, gate.queued) == (1, 0)
    held.release()
    assert gate.running == 0


async def test_a_waiter_that_gives_up_leaves_the_queue() -> None:
    gate = ModelGate(MODEL, limits(concurrent=1, queued=1))
    held = await gate.acquire()
    with anyio.move_on_after(0.05):  # e.g. its client went away
        await gate.acquire()
    assert gate.queued == 0
    held.release()
    assert gate.running == 0


def app_with_body_limit(limit: int) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limit)

    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    async def echo(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    return app


async def chunked(data: bytes, size: int = 100) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize(
    ("path", "body_size", "streamed", "status", "error_type"),
    [
        ("/v1/chat/completions", 1000, False, 200, None),
        ("/v1/chat/completions", 1001, False, 413, "invalid_request_error"),
        ("/v1/chat/completions", 1001, True, 413, "invalid_request_error"),  # no Content-Length
        ("/v1/chat/completions", 1000, True, 200, None),
        ("/v1/messages", 5000, False, 413, "request_too_large"),
        ("/v1/messages", 5000, True, 413, "request_too_large"),
    ],
)
async def test_bodies_over_the_limit_are_refused_in_the_apis_format(
    path: str, body_size: int, streamed: bool, status: int, error_type: str | None
) -> None:
    transport = httpx.ASGITransport(app=app_with_body_limit(1000))
    data = b"x" * body_size
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(path, content=chunked(data) if streamed else data)
    assert response.status_code == status
    body = response.json()
    if status == 200:
        assert body == {"received": body_size}
    elif path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == error_type
    else:
        assert body["error"]["type"] == error_type
        assert body["error"]["code"] == "request_too_large"
        assert "1000 bytes" in json.dumps(body)


def app_with_admission(admission: Admission, release: anyio.Event) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(AdmissionMiddleware, admission=admission)

    @app.post("/v1/messages")
    async def hold() -> dict[str, bool]:
        await admit(MODEL)  # never released here: the request's end releases it
        await release.wait()
        return {"ok": True}

    return app


async def test_the_end_of_a_request_releases_its_slot_and_a_full_model_gets_429() -> None:
    admission = Admission(limits(concurrent=1, queued=0))
    release = anyio.Event()
    transport = httpx.ASGITransport(app=app_with_admission(admission, release))
    statuses: list[int] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def post() -> None:
            statuses.append((await client.post("/v1/messages")).status_code)

        async with anyio.create_task_group() as group:
            group.start_soon(post)
            await anyio.wait_all_tasks_blocked()
            refused = await client.post("/v1/messages")
            release.set()
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"  # Anthropic's format
        assert statuses == [200]
        assert admission.gate(MODEL).running == 0
        assert (await client.post("/v1/messages")).status_code == 200
