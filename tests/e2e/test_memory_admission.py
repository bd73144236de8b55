"""Memory admission end to end: a node whose runner may use little more memory
than the model's weights (`--memory-limit-bytes`) answers a request whose KV
could never fit with a 400 naming the largest max_tokens that fits, one that
fits only once running requests finish with a 503 and Retry-After after the
wait bound, spills its prefix cache to disk before refusing anything, and keeps
serving throughout."""

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.cards import card_from_folder
from exo.models.memory import rank_weights
from exo.worker.runner.memory_admission import RESERVE_FRACTION, request_kv
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = pytest.mark.slow

WAIT_SECONDS = 2  # --queue-timeout-seconds: how long a request waits for memory
ROOM_TOKENS = 1024  # the KV the limit leaves room for, in tokens


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


class Figures:
    """The runner's memory, as the test predicts it (the CPU backend's float32)."""

    def __init__(self, smollm_dir: Path) -> None:
        card = card_from_folder(DEFAULT_MODEL_ID, smollm_dir)
        self.weights = rank_weights(card, "cpu", 0, card.n_layers)
        self.kv_of = request_kv(card, "cpu")
        self.limit = math.ceil((self.weights + self.kv_of(ROOM_TOKENS)) / (1 - RESERVE_FRACTION))
        self.capacity = self.limit - self.weights - int(self.limit * RESERVE_FRACTION)


@pytest.fixture(scope="module")
def figures(smollm_dir: Path) -> Figures:
    return Figures(smollm_dir)


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, figures: Figures
) -> Iterator[NodeProcess]:
    with running_node(
        tmp_path_factory.mktemp("memory"),
        models_dir,
        "--memory-limit-bytes", str(figures.limit),
        "--queue-timeout-seconds", str(WAIT_SECONDS),
        "--prefix-cache-disk-bytes", str(1 << 30),
        "--speculation", "none",  # a count drafted ahead would end too soon for the test
    ) as started:  # fmt: skip
        yield started


def post(
    node: NodeProcess, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> httpx.Response:
    return httpx.post(f"{node.base_url}{path}", json=body, timeout=120)


def cache_stats(node: NodeProcess) -> dict[str, Any]:
    return httpx.get(f"{node.base_url}/v1/cache/stats", timeout=5).json()["data"][0]


def test_a_request_that_never_fits_gets_400_naming_the_largest_max_tokens(
    node: NodeProcess, figures: Figures
) -> None:
    response = post(node, chat(4000))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"{figures.capacity} bytes" in message and "limit" in message
    # A stream is refused alike, as a status: its answer begins once the runner took it.
    streamed = post(node, chat(4000, stream=True))
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"]["message"] == message
    largest = re.search(r"the largest max_tokens that fits is (\d+)", message)
    assert largest is not None
    # It does fit, and is served; one more token would not have fit.
    served = post(node, chat(int(largest.group(1)), stop=["!", "."]))
    assert served.status_code == 200, served.text
    prompt_tokens = served.json()["usage"]["prompt_tokens"]
    assert figures.kv_of(prompt_tokens + int(largest.group(1)) + 1) > figures.capacity


def test_a_request_that_fits_only_alone_gets_503_with_retry_after(
    node: NodeProcess, figures: Figures
) -> None:
    counting = {
        "model": DEFAULT_MODEL_ID,
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        "max_tokens": 900,  # holds the whole room while it runs
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{node.base_url}/v1/completions", json=counting) as stream,
    ):
        lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
        next(line for line in lines if '"text"' in line)  # it runs (keep-alives before)
        refused = post(node, chat(400))  # alone it fits; beside the stream it does not
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == str(WAIT_SECONDS)
        message = refused.json()["error"]["message"]
        assert "not enough memory" in message and "bytes" in message
        assert f"waited {WAIT_SECONDS}s" in message
    # The stream's client left: its memory is free again.
    assert post(node, chat(400, stop=["!", "."])).status_code == 200


def test_under_pressure_the_prefix_cache_spills_to_disk_before_refusing(
    node: NodeProcess, figures: Figures
) -> None:
    turn = post(node, chat(8, stop=["!", "."]))  # this conversation, now in the cache
    assert turn.status_code == 200, turn.text
    prompt_tokens = turn.json()["usage"]["prompt_tokens"]
    before = cache_stats(node)
    assert before["bytes"] > 0
    # The longest reply whose KV fits in the room, but not beside the cache's entries.
    max_tokens = max(
        n for n in range(1, 2 * ROOM_TOKENS) if figures.kv_of(prompt_tokens + n) <= figures.capacity
    )
    assert figures.kv_of(prompt_tokens + max_tokens) > figures.capacity - before["bytes"]
    served = post(node, chat(max_tokens, stop=["!", "."]))
    assert served.status_code == 200, served.text
    after = cache_stats(node)
    assert after["evictions"] > before["evictions"] and after["disk_entries"] >= 1
    # The conversation's entry went to disk (not away) to make room: its prefix
    # came back from there.
    assert after["disk_hits"] > before["disk_hits"]
    assert served.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
