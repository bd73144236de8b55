"""End to end, what a client (with the key, or a stranger who reaches the port)
can do against one real node: a client that stops reading is cut and its slot
serves the next request; a trickled request is cut; a 4 MB prompt against a
full queue is refused at once; bad input of every kind is a 4xx; and model
folders no model could have are skipped (in the models dir and a read-only
one) while the good model serves."""

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node
from tests.e2e.test_serving_limits import COUNTING, SHORT_CHAT, metric, streaming
from tests.integration.cluster_process import wait_until

pytestmark = pytest.mark.slow

STALL_SECONDS = 2.0
# A stalled client is cut `STALL_SECONDS` after the buffers between it and the
# node are full (under 100 KB: seconds of a stream with 20 log-probabilities a
# token, more on a busy test machine).
STALL_BOUND_SECONDS = 60.0
FOUR_MB = 4 * 1024 * 1024
LONE = "\\ud800"  # as JSON text


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> tuple[Path, Path]:
    """A models dir and a read-only one, each with a folder whose config.json
    no model could have (0 layers; 2**62 of them)."""
    root = tmp_path_factory.mktemp("folders")
    config = json.loads((smollm_dir / "config.json").read_text())
    writable, shared = root / "models", root / "shared"
    for parent, name, layers in ((writable, "org--none", 0), (shared, "org--endless", 2**62)):
        (parent / name).mkdir(parents=True)
        (parent / name / "config.json").write_text(
            json.dumps(config | {"num_hidden_layers": layers})
        )
    return writable, shared


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, folders: tuple[Path, Path]
) -> Iterator[NodeProcess]:
    """One slot and no queue; the good model in a read-only dir beside the bad one."""
    writable, shared = folders
    with running_node(
        tmp_path_factory.mktemp("node"),
        writable,
        "--models-read-only-dirs", f"{models_dir}{os.pathsep}{shared}",
        "--max-concurrent", "1",
        "--max-queued", "0",
        "--client-stall-seconds", str(STALL_SECONDS),
        "--sse-keepalive-seconds", "1",
    ) as started:  # fmt: skip
        yield started


def test_broken_model_folders_are_skipped_and_shown_in_the_state(
    node: NodeProcess, folders: tuple[Path, Path]
) -> None:
    writable, shared = folders
    reply = httpx.post(f"{node.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=60)
    assert reply.status_code == 200
    node_id = node.get("/node_id")
    unreadable = wait_until(
        lambda: node.get("/state")["unreadable_models"].get(node_id),
        10,
        "the unreadable folders in the state",
    )
    reasons = {folder["path"]: folder["reason"] for folder in unreadable}
    assert reasons.keys() == {str(writable / "org--none"), str(shared / "org--endless")}
    assert "0 layers" in reasons[str(writable / "org--none")]
    assert f"{2**62} layers" in reasons[str(shared / "org--endless")]
    assert f"ignoring model folder {writable / 'org--none'}" in node.log()


def raw_post(path: str, body: bytes, host: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_a_client_that_stops_reading_is_cut_and_its_slot_serves_the_next(
    node: NodeProcess,
) -> None:
    # Each token comes with its 20 likeliest alternatives: a kilobyte or two.
    count = [{"role": "user", "content": "Count to 2000: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"}]
    body = json.dumps(
        {**SHORT_CHAT, "messages": count, "max_tokens": 4000, "stream": True}
        | {"logprobs": True, "top_logprobs": 20}
    ).encode()
    host = node.base_url.removeprefix("http://")
    address, port = host.split(":")
    cancelled = metric(
        node, "exo_generations_total", model=DEFAULT_MODEL_ID, finish_reason="cancelled"
    )
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the least; never read
        client.connect((address, int(port)))
        client.sendall(raw_post("/v1/chat/completions", body, host))
        wait_until(
            lambda: metric(node, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 1,
            30,
            "the stalled client's generation running",
        )
        held = time.monotonic()
        wait_until(
            lambda: metric(node, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 0,
            STALL_BOUND_SECONDS,
            "the stalled client's slot freed",
        )
        assert time.monotonic() - held >= STALL_SECONDS
    assert "took no bytes of the answer" in node.log()
    assert (
        metric(node, "exo_generations_total", model=DEFAULT_MODEL_ID, finish_reason="cancelled")
        == cancelled + 1
    )
    reply = httpx.post(f"{node.base_url}/v1/chat/completions", json=SHORT_CHAT, timeout=60)
    assert reply.status_code == 200  # the only slot serves again


def test_a_request_trickled_a_byte_at_a_time_is_cut(node: NodeProcess) -> None:
    host = node.base_url.removeprefix("http://")
    address, port = host.split(":")
    request = raw_post("/v1/chat/completions", json.dumps(SHORT_CHAT).encode(), host)
    with socket.create_connection((address, int(port))) as client:
        started = time.monotonic()
        client.settimeout(0.5)
        for byte in request:
            try:
                client.send(bytes([byte]))
                if client.recv(1) == b"":
                    break
            except TimeoutError:
                continue  # still open
            except (BrokenPipeError, ConnectionResetError):
                break
        assert time.monotonic() - started < STALL_SECONDS + 3
    assert "sent no complete request headers" in node.log()


def test_a_4_mb_prompt_against_a_full_queue_is_refused_at_once(node: NodeProcess) -> None:
    huge = {**SHORT_CHAT, "messages": [{"role": "user", "content": "word " * (FOUR_MB // 5)}]}
    chat = json.dumps(huge).encode()
    count = json.dumps({"model": DEFAULT_MODEL_ID, "messages": huge["messages"]}).encode()
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=30) as client:
        with streaming(node.base_url) as running:
            assert running.status_code == 200  # it holds the only slot; no queue
            for path, body in (
                ("/v1/chat/completions", chat),
                ("/v1/messages/count_tokens", count),
            ):
                started = time.monotonic()
                refused = client.post(f"{node.base_url}{path}", content=body, headers=headers)
                elapsed = time.monotonic() - started
                assert refused.status_code == 429, refused.text
                # Parsing the 4 MB body takes 0.03-0.09 s here; tokenizing it
                # (what a refusal must not wait for) takes seconds.
                assert elapsed < 0.5, f"{path}: {elapsed:.3f}s"
        # With the slot free it is admitted, and its size alone shows it is
        # longer than the context: refused before it is tokenized.
        wait_until(
            lambda: metric(node, "exo_requests_in_flight", model=DEFAULT_MODEL_ID) == 0,
            10,
            "the slot freed",
        )
        started = time.monotonic()
        refused = client.post(f"{node.base_url}/v1/chat/completions", content=chat, headers=headers)
        assert time.monotonic() - started < 1
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"


def deep(levels: int) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for _ in range(levels):
        nested = {"a": nested}
    return nested


def _with(body: dict[str, Any], **fields: Any) -> str:
    return json.dumps({**body, **fields})


MESSAGE = {
    "model": DEFAULT_MODEL_ID,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Hi"}],
}
HOSTILE = f"hi {LONE}"
# (path, body as JSON text, what the error says)
BAD_INPUTS: list[tuple[str, str, str]] = [
    ("/v1/chat/completions", json.dumps(SHORT_CHAT).replace("Say hi.", HOSTILE), "lone surrogate"),
    ("/v1/completions", _with(COUNTING, prompt="x").replace('"x"', f'"{HOSTILE}"'), "lone surrogate"),
    ("/v1/messages", json.dumps(MESSAGE).replace('"Hi"', f'"{HOSTILE}"'), "lone surrogate"),
    ("/v1/messages/count_tokens",
     json.dumps({"model": DEFAULT_MODEL_ID, "messages": MESSAGE["messages"]}).replace('"Hi"', f'"{HOSTILE}"'),
     "lone surrogate"),
    ("/v1/responses", json.dumps({"model": DEFAULT_MODEL_ID, "input": "x"}).replace('"x"', f'"{HOSTILE}"'),
     "lone surrogate"),
    ("/v1/chat/completions", _with(SHORT_CHAT, stop=["x"]).replace('["x"]', f'["{LONE}"]'),
     "lone surrogate"),
    ("/v1/chat/completions", _with(SHORT_CHAT, logit_bias={"²": 1}), "token ids"),
    ("/v1/chat/completions", _with(SHORT_CHAT, chat_template_kwargs=deep(900)), "nested deeper"),
    ("/v1/chat/completions",
     _with(SHORT_CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": deep(900)}}]),
     "nested deeper"),
    ("/v1/messages", _with(MESSAGE, tools=[{"name": "f", "input_schema": deep(900)}]), "nested deeper"),
    ("/v1/chat/completions",
     _with(SHORT_CHAT, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}),
     "no finite JSON value"),
    ("/v1/chat/completions", _with(SHORT_CHAT)[:-1] + ', "repetition_penalty": Infinity}', "finite"),
    ("/v1/completions", _with(COUNTING, stream=False)[:-1] + ', "frequency_penalty": NaN}', "finite"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "message"),
    BAD_INPUTS,
    ids=[f"{i}{p}" for i, (p, _, _) in enumerate(BAD_INPUTS)],
)
def test_bad_input_is_a_400_in_the_apis_format(
    node: NodeProcess, path: str, body: str, message: str
) -> None:
    response = httpx.post(
        f"{node.base_url}{path}",
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"]


def test_deleting_a_linked_model_folder_removes_the_link_only(
    node: NodeProcess, folders: tuple[Path, Path], tmp_path: Path
) -> None:
    writable, _ = folders
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "weights.safetensors").write_bytes(b"keep me")
    (writable / "org--linked").symlink_to(target, target_is_directory=True)
    response = httpx.delete(f"{node.base_url}/models/org/linked", timeout=30)
    assert response.status_code == 200, response.text
    assert not (writable / "org--linked").exists()
    assert (target / "weights.safetensors").read_bytes() == b"keep me"
    # An unreadable folder deleted leaves the state's list.
    assert httpx.delete(f"{node.base_url}/models/org/none", timeout=30).status_code == 200
    node_id = node.get("/node_id")
    wait_until(
        lambda: all(
            not f["path"].endswith("org--none")
            for f in node.get("/state")["unreadable_models"].get(node_id, [])
        ),
        10,
        "the deleted folder gone from the state",
    )
