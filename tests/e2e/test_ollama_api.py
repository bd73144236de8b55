"""End to end, with the official `ollama` client against a real node serving
the built-in model, on its API port and on its `--ollama-port`: chat (whole
and streamed), generate, tags, show, ps, pull, a tool call, structured output,
an unknown model and refused fields."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, free_port, running_node

pytestmark = pytest.mark.slow

ASK: list[dict[str, Any]] = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 12}
ASK_WEATHER = "What is the weather in Paris?"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}


@pytest.fixture(scope="module")
def ollama_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, ollama_port: int
) -> Iterator[NodeProcess]:
    with running_node(
        tmp_path_factory.mktemp("node"),
        models_dir,
        "--sse-keepalive-seconds",
        "0.3",
        "--ollama-port",
        str(ollama_port),
    ) as started:
        yield started


def client(node: NodeProcess) -> ollama.Client:
    """On the node's API port, where the Ollama routes live under /api."""
    return ollama.Client(host=node.base_url, timeout=180)


def test_the_ollama_port_answers_as_ollama_and_chats(node: NodeProcess, ollama_port: int) -> None:
    base = f"http://127.0.0.1:{ollama_port}"
    assert httpx.get(base, timeout=10).text == "Ollama is running"
    on_port = ollama.Client(host=base, timeout=180)
    assert DEFAULT_MODEL_ID in [m.model for m in on_port.list().models]
    loaded = on_port.chat(model=DEFAULT_MODEL_ID)  # no messages: Ollama's "load"
    assert loaded.done and loaded.done_reason == "load"
    reply = on_port.chat(model=DEFAULT_MODEL_ID, messages=ASK, options=GREEDY)
    assert "Paris" in (reply.message.content or "")
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count and reply.eval_count
    assert reply.total_duration and reply.eval_duration and reply.prompt_eval_duration
    assert reply.total_duration >= reply.eval_duration + reply.prompt_eval_duration
    assert on_port.pull(DEFAULT_MODEL_ID).status == "success"  # served already


def test_a_streamed_chat_matches_the_whole_one(node: NodeProcess) -> None:
    whole = client(node).chat(model=DEFAULT_MODEL_ID, messages=ASK, options=GREEDY)
    chunks = list(
        client(node).chat(
            model=f"{DEFAULT_MODEL_ID}:latest", messages=ASK, options=GREEDY, stream=True
        )
    )
    assert len(chunks) > 2
    assert all(not chunk.done for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.done_reason == whole.done_reason
    assert last.eval_count == whole.eval_count and last.prompt_eval_count
    assert "".join(chunk.message.content or "" for chunk in chunks) == whole.message.content


def test_generate_answers_whole_and_streamed(node: NodeProcess) -> None:
    raw = client(node).generate(
        model=DEFAULT_MODEL_ID, prompt="The capital of France is", raw=True, options=GREEDY
    )
    assert raw.response and raw.done and raw.eval_count
    parts = list(
        client(node).generate(
            model=DEFAULT_MODEL_ID,
            prompt="What is the capital of France?",
            system="You answer in one sentence.",
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(part.response or "" for part in parts).strip()
    assert parts[-1].done and parts[-1].prompt_eval_count and parts[-1].total_duration


def test_tags_show_and_ps_describe_the_served_model(node: NodeProcess) -> None:
    (tagged,) = [m for m in client(node).list().models if m.model == DEFAULT_MODEL_ID]
    assert tagged.size and tagged.digest and tagged.details is not None
    assert tagged.details.family == "llama" and tagged.details.parameter_size
    shown = client(node).show(DEFAULT_MODEL_ID)
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo is not None
    context = shown.modelinfo["llama.context_length"]
    assert context > 0 and f"num_ctx {context}" in (shown.parameters or "")
    assert shown.template
    (running,) = [m for m in client(node).ps().models if m.model == DEFAULT_MODEL_ID]
    assert running.context_length == context and running.size == tagged.size
    assert httpx.get(f"{node.base_url}/api/version", timeout=10).json()["version"]


def _asked(city: str) -> list[dict[str, Any]]:
    """A question about `city` and the call the assistant made for it."""
    call = {"function": {"name": "get_weather", "arguments": {"city": city}}}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def test_a_tool_call_comes_back_as_ollama_writes_it(node: NodeProcess) -> None:
    # Ollama has no tool_choice to force a call, and the 135M built-in model
    # calls tools only when earlier turns show it how (greedy, so always).
    messages = [*_asked("London"), *_asked("Berlin"), {"role": "user", "content": ASK_WEATHER}]
    reply = client(node).chat(
        model=DEFAULT_MODEL_ID,
        messages=messages,
        tools=[WEATHER_TOOL],
        options={"temperature": 0, "num_predict": 30},
    )
    calls = reply.message.tool_calls or []
    assert calls, reply.message
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER_SCHEMA)


def test_format_with_a_json_schema_validates(node: NodeProcess) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client(node).chat(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Invent a person."}],
        format=schema,
        options={"num_predict": 60},
    )
    jsonschema.validate(json.loads(reply.message.content or ""), schema)


def test_an_unknown_model_is_a_404_in_ollamas_shape(node: NodeProcess) -> None:
    for call in (
        lambda: client(node).chat(model="no-such-model", messages=ASK),
        lambda: client(node).show("no-such-model"),
    ):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404
        assert "no-such-model" in caught.value.error
    body = httpx.post(
        f"{node.base_url}/api/chat", json={"model": "no-such-model", "messages": ASK}, timeout=10
    ).json()
    assert list(body) == ["error"] and isinstance(body["error"], str)


def test_unsupported_fields_are_refused_by_name(node: NodeProcess) -> None:
    image = {"role": "user", "content": "What is this?", "images": [b"\x89PNG"]}
    refusals: list[tuple[str, Any]] = [
        ("images", lambda: client(node).chat(model=DEFAULT_MODEL_ID, messages=[image])),
        ("suffix", lambda: client(node).generate(model=DEFAULT_MODEL_ID, prompt="a", suffix="b")),
        (
            "mirostat",
            lambda: client(node).chat(
                model=DEFAULT_MODEL_ID, messages=ASK, options={"mirostat": 2}
            ),
        ),
    ]
    for name, call in refusals:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400, name
        assert name in caught.value.error, name
