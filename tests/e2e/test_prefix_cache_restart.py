"""End to end: the prefix cache's disk tier carries a conversation across a node restart."""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = pytest.mark.slow

FIRST: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a concise geography tutor. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of Italy?"},
]


def ask(node: NodeProcess, messages: list[ChatCompletionMessageParam]) -> ChatCompletion:
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=120)
    return client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, temperature=0, max_tokens=20
    )


def second_turn(reply: ChatCompletion) -> list[ChatCompletionMessageParam]:
    return [
        *FIRST,
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "And the capital of Spain?"},
    ]


def cache_stats(node: NodeProcess) -> dict[str, Any]:
    return httpx.get(f"{node.base_url}/v1/cache/stats", timeout=5).json()["data"][0]


def wait_for_stats(
    node: NodeProcess, ready: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> dict[str, Any]:
    """The cache stats once `ready` holds (the runner reports them after a task)."""
    deadline = time.monotonic() + timeout
    while not ready(stats := cache_stats(node)):
        assert time.monotonic() < deadline, f"cache stats never got there: {stats}"
        time.sleep(0.3)
    return stats


def cached_tokens(completion: ChatCompletion) -> int:
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0


def test_a_restarted_node_serves_the_conversation_from_disk(
    tmp_path: Path, models_dir: Path
) -> None:
    data = tmp_path / "data"
    with running_node(tmp_path, models_dir, data_dir=data) as node:
        first = ask(node, FIRST)
        # The runner writes its entries to disk while idle (and all of them at shutdown).
        wait_for_stats(node, lambda s: s.get("disk_entries", 0) >= 1)

    with running_node(tmp_path, models_dir, data_dir=data) as restarted:
        assert cache_stats(restarted)["entries"] == 0
        warm = ask(restarted, second_turn(first))
        stats = wait_for_stats(restarted, lambda s: s.get("lookups", 0) >= 1)
    assert first.usage is not None
    # The whole first turn is reused: its prompt and the reply the template echoes.
    assert cached_tokens(warm) >= first.usage.prompt_tokens
    assert stats["disk_hits"] == 1

    with running_node(tmp_path, models_dir, "--prefix-cache-bytes", "0") as cold_node:
        cold_first = ask(cold_node, FIRST)
        cold = ask(cold_node, second_turn(cold_first))
    assert cached_tokens(cold) == 0
    assert cold_first.choices[0].message.content == first.choices[0].message.content
    assert warm.choices[0].message.content == cold.choices[0].message.content
