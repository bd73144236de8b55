"""Retry before the first token, with the official clients against a real node:
requests whose runner is SIGKILLed before they produced a token (the runner
frozen with SIGSTOP first, so that none can) are answered normally once the
node restarted it, streamed and not, and so are the requests queued behind
the batch, which keep their places in the node's queue."""

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.lan_cluster import runner_pids
from tests.e2e.node_process import NodeProcess
from tests.e2e.test_serving_limits import metric
from tests.integration.cluster_process import wait_until

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12
# The node's batch (--max-concurrent's default) and requests queued behind it.
BATCH = 8
QUEUED = 6
# The runner restarts after a 1 s back-off and loads the model again.
ANSWERED_WITHIN_SECONDS = 60.0
# Long enough that the runner is killed mid-generation.
LONG_REPLY_TOKENS = 200


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=120, max_retries=0)


def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", timeout=120, max_retries=0)


def openai_whole(base_url: str, model: str) -> str:
    reply = openai_client(base_url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.choices[0].message.content or ""


def openai_streamed(base_url: str, model: str) -> str:
    stream = openai_client(base_url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    return finished_text(stream)


def finished_text(stream: Iterable[ChatCompletionChunk]) -> str:
    """A streamed chat completion's text, once it finished normally."""
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length")
    return "".join(text)


def claude_whole(base_url: str, model: str) -> str:
    message = claude(base_url).messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    return "".join(b.text for b in message.content if b.type == "text")


def claude_streamed(base_url: str, model: str) -> str:
    with claude(base_url).messages.stream(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    ) as stream:
        text = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
    return text


# Each asks `model` at `base_url` and returns the text of a reply that finished.
CLIENTS: list[Callable[[str, str], str]] = [
    openai_whole,
    openai_streamed,
    claude_whole,
    claude_streamed,
]


def test_requests_lost_with_their_runner_before_a_token_are_answered_and_the_queue_stays(
    node: NodeProcess,
) -> None:
    [runner] = runner_pids(node)
    retried_before = metric(
        node, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="here"
    )
    os.kill(runner, signal.SIGSTOP)  # no request can get a token from here on
    answers: dict[int, str] = {}
    errors: dict[int, str] = {}

    def ask(i: int) -> None:
        try:
            answers[i] = CLIENTS[i % len(CLIENTS)](node.base_url, DEFAULT_MODEL_ID)
        except Exception as error:  # recorded for the assertion below
            errors[i] = f"{CLIENTS[i % len(CLIENTS)].__name__}: {error!r}"

    threads: list[threading.Thread] = []
    try:
        for i in range(BATCH + QUEUED):  # one by one: the queue keeps this order
            threads.append(threading.Thread(target=ask, args=(i,), daemon=True))
            threads[-1].start()
            wait_until(lambda n=i + 1: in_node(node) == n, 20, f"request {i} in the batch or queue")
        assert metric(node, "exo_queue_depth", model=DEFAULT_MODEL_ID) == QUEUED
        killed_at = time.monotonic()
        os.kill(runner, signal.SIGKILL)
    finally:
        with suppress(ProcessLookupError):
            os.kill(runner, signal.SIGCONT)  # if anything above failed first
    for thread in threads:
        thread.join(max(0.0, killed_at + ANSWERED_WITHIN_SECONDS - time.monotonic()))

    assert not errors, errors
    assert sorted(answers) == list(range(BATCH + QUEUED))
    assert all("Paris" in text for text in answers.values()), answers
    assert runner not in runner_pids(node)
    # The batch was run again on the restarted runner; the queue never left the node.
    retried = metric(node, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="here")
    assert retried - retried_before == BATCH
    node.wait_for_runner("ready", timeout=30)


def in_node(node: NodeProcess) -> float:
    running = metric(node, "exo_requests_in_flight", model=DEFAULT_MODEL_ID)
    return running + metric(node, "exo_queue_depth", model=DEFAULT_MODEL_ID)


def test_a_reply_sent_whole_runs_again_when_its_runner_dies_mid_generation(
    node: NodeProcess,
) -> None:
    """Nothing of a non-streamed reply reaches its client before it finished:
    a runner lost mid-generation runs it again from the start, once."""
    retried_before = metric(
        node, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="here"
    )
    replies: list[Any] = []
    asking = threading.Thread(
        target=lambda: replies.append(
            openai_client(node.base_url).chat.completions.create(
                model=DEFAULT_MODEL_ID,
                messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=LONG_REPLY_TOKENS,
                temperature=0,
                logit_bias={"2": -100},  # no end of text: it runs its course
            )
        ),
        daemon=True,
    )
    asking.start()
    wait_until(lambda: node.runner_status() == "running", 20, "the reply under way")
    time.sleep(0.5)  # tokens generated, none sent
    [runner] = runner_pids(node)
    os.kill(runner, signal.SIGKILL)
    asking.join(ANSWERED_WITHIN_SECONDS)

    [reply] = replies
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == LONG_REPLY_TOKENS  # one run's, not two
    assert reply.choices[0].message.content
    retried = metric(node, "exo_retried_requests_total", model=DEFAULT_MODEL_ID, where="here")
    assert retried - retried_before == 1
    node.wait_for_runner("ready", timeout=30)
