"""End to end with the official `anthropic` client (Messages API) and the
`openai` client's Responses API against a real node on the built-in model."""

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess

pytestmark = pytest.mark.slow

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
ANTHROPIC_TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}
]
RESPONSES_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER_SCHEMA,
        "strict": False,
    }
]


def claude(node: NodeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.base_url, api_key="unused", timeout=180)


def responses_client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=180)


def test_messages_answer_whole_and_streamed_alike(node: NodeProcess) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
    message = claude(node).messages.create(
        model="claude-opus-4-5", max_tokens=20, messages=ask, extra_body={"temperature": 0}
    )
    assert message.model == DEFAULT_MODEL_ID  # the model that answered
    assert message.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert "Paris" in text
    assert message.usage.output_tokens > 0
    with claude(node).messages.stream(
        model="claude-opus-4-5", max_tokens=20, messages=ask, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.id != message.id  # every reply has its own id
    # The same prompt again: read from the prefix cache.
    assert final.usage.cache_read_input_tokens


def test_a_tool_use_and_its_result_round_trip(node: NodeProcess) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude(node).messages.create(
        model="claude-opus-4-5",
        max_tokens=60,
        messages=ask,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    history: list[Any] = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C."}
            ],
        },
    ]
    with claude(node).messages.stream(
        model="claude-opus-4-5", max_tokens=20, messages=history, tools=ANTHROPIC_TOOLS
    ) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    first_prompt = (
        first.usage.input_tokens
        + (first.usage.cache_read_input_tokens or 0)
        + (first.usage.cache_creation_input_tokens or 0)
    )
    # The whole first prompt is reused by the turn that extends it.
    assert (second.usage.cache_read_input_tokens or 0) >= first_prompt


def test_count_tokens_matches_the_prompt_a_reply_reports(node: NodeProcess) -> None:
    ask: list[Any] = [{"role": "user", "content": "Count me."}]
    counted = claude(node).messages.count_tokens(
        model="claude-opus-4-5", messages=ask, system="Be brief."
    )
    reply = claude(node).messages.create(
        model="claude-opus-4-5", max_tokens=1, messages=ask, system="Be brief."
    )
    usage = reply.usage
    total = (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )
    assert counted.input_tokens == total > 5


def test_messages_errors_use_anthropics_format(node: NodeProcess) -> None:
    response = httpx.post(
        f"{node.base_url}/v1/messages",
        json={
            "model": "claude-x",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "x"},
                        }
                    ],
                }
            ],
        },
        headers={"anthropic-version": "2023-06-01", "x-api-key": "unused"},
        timeout=30,
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]


def _claude_code_request(cch: str) -> dict[str, Any]:
    instructions = " ".join(
        f"Rule {i}: keep edits small, explain what changed and run the tests." for i in range(80)
    )
    return {
        "model": "claude-opus-4-5",
        "max_tokens": 128000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={cch};",
            },
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": instructions, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": "Say hi."}],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": json.dumps({"session_id": "s1"})},
    }


def _final_usage(node: NodeProcess, body: dict[str, Any]) -> dict[str, int]:
    usage: dict[str, int] = {}
    with httpx.stream(
        "POST",
        f"{node.base_url}/v1/messages?beta=true",
        json=body,
        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"},
        timeout=300,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] in ("message_start", "message_delta"):
                    usage |= event.get("usage") or event["message"]["usage"]
    return usage


def test_claude_code_requests_differing_only_in_the_billing_hash_hit_the_cache(
    node: NodeProcess,
) -> None:
    _final_usage(node, _claude_code_request("1a2b3"))
    usage = _final_usage(node, _claude_code_request("9f8e7"))
    prompt = (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )
    assert prompt >= 1000
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt


def test_responses_answer_whole_and_streamed(node: NodeProcess) -> None:
    client = responses_client(node)
    response = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input="What is the capital of France?",
        max_output_tokens=20,
        temperature=0,
    )
    assert response.status in ("completed", "incomplete")
    assert "Paris" in response.output_text
    events = list(
        client.responses.create(
            model=DEFAULT_MODEL_ID,
            input="What is the capital of France?",
            max_output_tokens=20,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0


def test_responses_function_call_round_trip(node: NodeProcess) -> None:
    client = responses_client(node)
    first = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input="What is the weather in Paris?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    stream = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."},
        ],
        tools=RESPONSES_TOOLS,
        max_output_tokens=20,
        stream=True,
    )
    events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=DEFAULT_MODEL_ID, input="Hi", previous_response_id="resp_123", max_output_tokens=5
        )
