"""Continuous batching, end to end against a real node with the official `openai`
client: concurrent streams reply exactly as each does alone, and a short request
sent while long generations run gets its first token before they end."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Why is the sky blue? Answer briefly.",
]


def client(node: NodeProcess) -> OpenAI:
    return OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=300)


def streamed_reply(node: NodeProcess, question: str, max_tokens: int = 48) -> str:
    stream = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_four_concurrent_greedy_streams_reply_as_each_alone(node: NodeProcess) -> None:
    alone = [streamed_reply(node, question) for question in QUESTIONS]
    start = threading.Barrier(len(QUESTIONS))

    def together(question: str) -> str:
        start.wait(timeout=30)
        return streamed_reply(node, question)

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        concurrent = list(pool.map(together, QUESTIONS))
    assert concurrent == alone
    assert all(alone) and len(set(alone)) == len(alone)


def test_a_short_request_gets_its_first_token_before_long_generations_end(
    node: NodeProcess,
) -> None:
    ended: dict[str, float] = {}
    first_tokens: list[float] = []

    def long_generation(name: str) -> None:
        stream = client(node).completions.create(
            model=DEFAULT_MODEL_ID,
            prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
            max_tokens=300,
            temperature=0,
            stream=True,
        )
        for _ in stream:
            first_tokens.append(time.monotonic())
        ended[name] = time.monotonic()

    threads = [threading.Thread(target=long_generation, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while len(first_tokens) < 4 and time.monotonic() < deadline:  # both are decoding
        time.sleep(0.05)
    sent = time.monotonic()
    stream = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=1,
        temperature=0,
        stream=True,
    )
    first = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    answered = time.monotonic()
    assert first.choices[0].delta.content
    for thread in threads:
        thread.join(timeout=300)
    assert set(ended) == {"a", "b"}
    assert answered < min(ended.values()), (
        f"first token {answered - sent:.2f}s after sending; the long ones ended "
        f"{min(ended.values()) - sent:.2f}s after"
    )
