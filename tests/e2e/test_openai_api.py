"""End to end: a real `exo` process driven by the official `openai` client and raw HTTP."""

import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = pytest.mark.slow

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=120)


def test_models_lists_the_builtin_model(node: NodeProcess) -> None:
    models = client(node).models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL_ID]


def ask_capital(node: NodeProcess) -> ChatCompletion:
    """The question every test can check the answer of (greedy: mentions Paris)."""
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=30
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    return reply


def test_chat_completion_answers(node: NodeProcess) -> None:
    reply = ask_capital(node)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 10
    assert reply.usage.completion_tokens > 0


def test_streaming_chat_completion_answers_with_usage(node: NodeProcess) -> None:
    stream = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert "Paris" in text
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_stop_sequence_ends_the_answer_before_it(node: NodeProcess) -> None:
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        stop=["Paris"],
    )
    content = reply.choices[0].message.content or ""
    assert "Paris" not in content
    assert content.startswith("The capital of France is")
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_limits_the_answer(node: NodeProcess) -> None:
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        temperature=0,
        max_completion_tokens=5,
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.choices[0].finish_reason == "length"


def test_a_predicted_output_is_drafted_from_and_counted(node: NodeProcess) -> None:
    """OpenAI's Predicted Outputs: the prediction drafts the reply, which stays
    the greedy one; usage counts the prediction's tokens taken and the rest."""
    plain = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=40
    )
    text = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        prediction={"type": "content", "content": text + " And that is all."},
    )
    assert predicted.choices[0].message.content == text
    usage = predicted.usage
    assert usage is not None and usage.completion_tokens_details is not None
    details = usage.completion_tokens_details
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert accepted is not None and rejected is not None
    assert accepted >= usage.completion_tokens // 2  # most of the reply came from drafts
    assert rejected >= 4  # at least " And that is all." was not taken
    extra = details.model_extra or {}
    assert extra["accepted_draft_tokens"] >= accepted
    # Turned off for one request: nothing drafted, the same reply.
    off = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        prediction={"type": "content", "content": text},
        extra_body={"speculation": False},
    )
    assert off.choices[0].message.content == text
    assert off.usage is not None and off.usage.completion_tokens_details is not None
    assert (off.usage.completion_tokens_details.model_extra or {})["drafted_tokens"] == 0


def test_keepalive_comments_are_sent_while_prefill_runs(node: NodeProcess) -> None:
    long_prompt = "Summarize: " + " ".join(f"item {i} is blue." for i in range(150))
    lines: list[str] = []
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 2,
        "stream": True,
    }
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert ": keep-alive" in lines
    assert lines[-1] == "data: [DONE]"


def test_second_request_reuses_the_prefix_and_matches_a_cold_run(
    node: NodeProcess, tmp_path: Path, models_dir: Path
) -> None:
    first: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a concise geography tutor. Answer in one sentence."},
        {"role": "user", "content": "What is the capital of Italy?"},
    ]
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=first,
        temperature=0,
        max_tokens=20,
    )
    answer = reply.choices[0].message.content or ""
    second: list[ChatCompletionMessageParam] = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the capital of Spain?"},
    ]
    warm = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=second,
        temperature=0,
        max_tokens=20,
    )
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    cached = warm.usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0
    assert reply.usage is not None and cached >= reply.usage.prompt_tokens - 1

    with running_node(tmp_path, models_dir, "--prefix-cache-bytes", "0") as cold_node:
        cold = client(cold_node).chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=second,
            temperature=0,
            max_tokens=20,
        )
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content

    stats = httpx.get(f"{node.base_url}/v1/cache/stats", timeout=5).json()["data"][0]
    assert stats["hits_partial"] + stats["hits_exact"] >= 1
    assert stats["entries"] >= 1 and stats["bytes"] > 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model_not_found"),
        ({"model": DEFAULT_MODEL_ID, "messages": []}, 400, "invalid_request"),
        ({"model": DEFAULT_MODEL_ID}, 400, "invalid_request"),
        (
            {"model": DEFAULT_MODEL_ID, "messages": QUESTION, "temperature": 5},
            400,
            "invalid_request",
        ),
        (
            {"model": DEFAULT_MODEL_ID, "messages": QUESTION, "max_tokens": 0},
            400,
            "invalid_request",
        ),
        ({"model": DEFAULT_MODEL_ID, "messages": QUESTION, "top_p": 0}, 400, "invalid_request"),
        (
            {"model": DEFAULT_MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]},
            400,
            "invalid_request",
        ),
        (
            {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_openai_style_errors(
    node: NodeProcess, body: dict, status: int, code: str
) -> None:
    r = httpx.post(f"{node.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code
    assert error["message"]
    assert error["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(node: NodeProcess) -> None:
    r = httpx.post(
        f"{node.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def long_story(stream: bool, temperature: float | None = None) -> dict[str, object]:
    """A request whose answer takes minutes: only a cancel or a crash ends it early."""
    body: dict[str, object] = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 4000,
        "stream": stream,
    }
    if temperature is not None:
        body["temperature"] = temperature
    return body


def _runner_process(node: NodeProcess) -> psutil.Process:
    children = psutil.Process(node.process.pid).children(recursive=True)
    runners = [c for c in children if "exo.worker.runner.runner_main" in " ".join(c.cmdline())]
    assert len(runners) == 1
    return runners[0]


def test_client_disconnect_cancels_generation(node: NodeProcess) -> None:
    body = long_story(stream=True, temperature=0.8)
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        content_lines = 0
        for line in r.iter_lines():
            content_lines += line.startswith("data:")
            if content_lines >= 4:
                break
    # 4000 tokens would take minutes; a cancelled task frees the runner at once.
    node.wait_for_runner("ready", timeout=10)


def test_disconnect_cancels_a_non_streaming_request(node: NodeProcess) -> None:
    body = long_story(stream=False, temperature=0.8)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{node.base_url}/v1/chat/completions", json=body, timeout=3)
    node.wait_for_runner("ready", timeout=10)


def test_runner_crash_fails_the_request_and_the_node_recovers(node: NodeProcess) -> None:
    body = long_story(stream=True)
    lines: list[str] = []
    started = time.monotonic()
    killed = False
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if not killed and sum(x.startswith("data:") for x in lines) >= 3:
                _runner_process(node).kill()
                killed = True
    assert time.monotonic() - started < 30
    # The client is told the runner is gone (a 503-class error it may retry).
    failed = [line for line in lines if '"runner_unavailable"' in line]
    assert failed and "the model runner is unavailable: runner failed" in failed[0]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    node.wait_for_runner("ready", timeout=120)
    ask_capital(node)
    assert node.health()["runners"][DEFAULT_MODEL_ID]["restarts"] >= 1
