"""End to end, with the official `openai` client against a real node on the
built-in model: tool calls, structured output, the sampling surface, logprobs
and the legacy completions endpoint."""

import json
import math
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess

pytestmark = pytest.mark.slow

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 30}},
                "required": ["path"],
            },
        },
    },
]
ASK_WEATHER: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a helpful assistant with tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=180)


def test_a_named_tool_choice_returns_a_call_that_validates(node: NodeProcess) -> None:
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice=NAMED, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_a_named_tool_call_streams_name_first_then_arguments(node: NodeProcess) -> None:
    stream = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=60,
        stream=True,
    )
    names, pieces, ids, finish = [], [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id:
                    ids.append(delta.id)
                if delta.function and delta.function.name:
                    assert not pieces, "the name comes before any argument"
                    names.append(delta.function.name)
                if delta.function and delta.function.arguments:
                    pieces.append(delta.function.arguments)
    assert finish == "tool_calls"
    assert names == ["get_weather"] and len(ids) == 1
    assert len(pieces) > 1, "arguments stream in pieces"
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_SCHEMA)


def test_a_tool_result_round_trips_and_the_next_turn_hits_the_whole_history(
    node: NodeProcess,
) -> None:
    first = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice=NAMED, max_tokens=60
    )
    message = first.choices[0].message
    calls = [c for c in message.tool_calls or [] if c.type == "function"]
    assert first.usage is not None and calls
    history: list[ChatCompletionMessageParam] = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 degrees."},
    ]
    second = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=history, tools=TOOLS, max_tokens=20, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # The earlier prompt and the generated call are reused, not prefilled again.
    # Only the call's last few tokens may differ: the grammar can make the model
    # write `}}` as two tokens where the re-rendered text tokenizes it as one.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 12
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_schema_output_validates(node: NodeProcess) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        max_tokens=60,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_a_strict_tool_under_auto_gets_text_or_a_call_that_validates(node: NodeProcess) -> None:
    strict_weather: ChatCompletionToolParam = {
        "type": "function",
        "function": {**TOOLS[0]["function"], "strict": True},
    }
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=ASK_WEATHER,
        tools=[strict_weather, TOOLS[1]],
        tool_choice="auto",
        max_tokens=60,
    )
    message = reply.choices[0].message
    assert "<tool_call>" not in (message.content or ""), "a call came back as text"
    for call in message.tool_calls or []:
        assert call.type == "function"
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        else:
            assert isinstance(json.loads(call.function.arguments), dict)


def test_an_uncompilable_schema_is_a_400_naming_the_problem(node: NodeProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(node).chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nope"}},
            },
            max_tokens=5,
        )
    assert "nope" in str(caught.value) or "ref" in str(caught.value).lower()


def test_logprobs_are_returned_and_sum_sensibly(node: NodeProcess) -> None:
    reply = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert reply.usage is not None
    assert len(entries) in (reply.usage.completion_tokens, reply.usage.completion_tokens - 1)
    text = "".join(e.token for e in entries)
    assert text.strip() == (choice.message.content or "").strip()
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-4)
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-4
    assert 0 < math.exp(sum(e.logprob for e in entries)) <= 1


def test_top_k_1_equals_greedy(node: NodeProcess) -> None:
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colors."}]
    greedy = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=ask, temperature=0, max_tokens=16
    )
    top_k = client(node).chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=ask,
        temperature=1.0,
        max_tokens=16,
        seed=7,
        extra_body={"top_k": 1},
    )
    assert top_k.choices[0].message.content == greedy.choices[0].message.content


def test_unknown_and_unsupported_fields_are_rejected_by_name(node: NodeProcess) -> None:
    for field, value in (("n", 2), ("made_up_field", 1), ("audio", {"voice": "x"})):
        response = httpx.post(
            f"{node.base_url}/v1/chat/completions",
            json={
                "model": DEFAULT_MODEL_ID,
                "messages": [{"role": "user", "content": "Hi"}],
                field: value,
            },
            timeout=30,
        )
        assert response.status_code == 400, field
        assert field in response.json()["error"]["message"], field


def test_legacy_completions_stream_and_answer(node: NodeProcess) -> None:
    whole = client(node).completions.create(
        model=DEFAULT_MODEL_ID, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert whole.choices[0].text.strip()
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    pieces = [
        c.choices[0].text
        for c in client(node).completions.create(
            model=DEFAULT_MODEL_ID,
            prompt="The capital of France is",
            max_tokens=5,
            temperature=0,
            stream=True,
        )
        if c.choices
    ]
    assert "".join(pieces) == whole.choices[0].text
