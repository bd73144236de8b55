"""The OpenAI request surface: every field is honoured, rejected with a 400
naming it, or accepted and ignored from a documented list; a valid request
translates into the internal ChatRequest with the values the client meant."""

import base64
import json
from pathlib import Path
from typing import Any

import openai.types
import openai.types.chat
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from exo.api.errors import install_error_handlers
from exo.api.openai_chat import chat_completion
from exo.api.openai_translate import completion_to_chat_request, to_chat_request
from exo.api.openai_types import (
    HONOURED_CHAT_FIELDS,
    IGNORED_CHAT_FIELDS,
    IGNORED_COMPLETION_FIELDS,
    REJECTED_CHAT_FIELDS,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatToolCall,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    CompletionUsage,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCallDelta,
)
from exo.api.reply_stream import ReplyFinished, TokenLogprob, TopLogprob
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    Sampling,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolFunction,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.tasks import Usage
from tests.unit.api_adapters import assert_fields_classified, scripted

USER = {"role": "user", "content": "Hi"}
BASE: dict[str, Any] = {"model": "m", "messages": [USER]}
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
READ = ToolFunction(
    name="read",
    description="Read a file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
)
DEFAULT = ChatRequest(model=ModelId("m"), turns=(ChatTurn(role="user", content="Hi"),))


@pytest.fixture(scope="module")
def client() -> TestClient:
    """The request types and the API's error handlers, as the routes use them."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        return to_chat_request(body).model_dump(mode="json")

    @app.post("/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        return completion_to_chat_request(body).model_dump(mode="json")

    return TestClient(app)


def test_every_field_of_openais_requests_is_classified() -> None:
    assert_fields_classified(
        ChatCompletionRequest, HONOURED_CHAT_FIELDS, IGNORED_CHAT_FIELDS, set(REJECTED_CHAT_FIELDS)
    )
    # everything the official client can send is declared (so never dropped unseen)
    official_chat = set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert official_chat <= set(ChatCompletionRequest.model_fields)
    official_legacy = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    assert official_legacy | {"stream"} <= set(CompletionRequest.model_fields)
    assert set(CompletionRequest.model_fields) >= set(IGNORED_COMPLETION_FIELDS)


PNG_BYTES = b"\x89PNG\r\n\x1a\n a picture"  # the adapter decodes; it does not read pixels
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()


def image_message(url: str, **image_url: Any) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url, **image_url}}],
    }


def tool_turn(**extra: Any) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call], **extra}]


REJECTED_CHAT: list[tuple[dict[str, Any], str, str]] = [
    ({"n": 2}, "n", "n must be 1"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"prediction": {"type": "audio", "content": "x"}}, "prediction", "type 'audio'"),
    ({"prediction": "x"}, "prediction", "valid dictionary"),
    (
        {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {}}]}},
        "prediction.content",
        "'image_url' content parts are accepted in user messages only",
    ),
    ({"web_search_options": {}}, "web_search_options", "not supported"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"function_call": "auto"}, "function_call", "send tool_choice"),
    ({"frobnicate": 1}, "frobnicate", "unknown parameter"),
    ({"messages": []}, "messages", "at least one"),
    (
        {"messages": [image_message("x")]},
        "messages.0.user.content",
        "part 0 (image_url.url): an image URL must be a base64 data URL or an http(s) URL",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": PNG_URL}]}]},
        "messages.0.user.content",
        "part 0: image_url is an object",
    ),
    (
        {"messages": [image_message("ftp://example.com/cat.png")]},
        "messages.0.user.content",
        "not 'ftp://example.com/cat.png'",
    ),
    (
        {"messages": [image_message("data:image/png;base64,not base64!")]},
        "messages.0.user.content",
        "part 0 (image_url.url): the image is not valid base64",
    ),
    (
        {"messages": [image_message("data:image/png,%89PNG")]},
        "messages.0.user.content",
        "an image data URL must be base64",
    ),
    (
        {"messages": [image_message("data:image/png;base64,")]},
        "messages.0.user.content",
        "the image is empty",
    ),
    (
        {"messages": [{**image_message(PNG_URL), "role": "system"}]},
        "messages.0.system.content",
        "'image_url' content parts are accepted in user messages only",
    ),
    (
        {"messages": [USER, {**image_message(PNG_URL), "role": "assistant"}]},
        "messages.1.assistant.content",
        "'image_url' content parts are accepted in user messages only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages.0.user.content",
        "'input_audio'",
    ),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0", "'function'"),
    ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages.0.user.foo", "unknown"),
    ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages.1.tool.tool_call_id", ""),
    (
        {"messages": tool_turn(function_call={"name": "f", "arguments": "{}"})},
        "messages.1.assistant.function_call",
        "send tool_calls",
    ),
    ({"messages": tool_turn(audio={"id": "a"})}, "messages.1.assistant.audio", "not supported"),
    (
        {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
        "tools",
        "only function tools are supported, not 'custom'",
    ),
    ({"tools": [READ_TOOL, READ_TOOL]}, "tools", "repeated: read"),
    (
        {"tools": [READ_TOOL], "tool_choice": {"type": "function", "function": {"name": "bash"}}},
        "tool_choice",
        "'bash', which is not among tools (read)",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": [READ_TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
        "tool_choice",
        "'allowed_tools' is not supported",
    ),
    ({"response_format": {"type": "grammar"}}, "response_format", "grammar"),
    ({"logit_bias": {"hello": 5}}, "logit_bias", "'hello' is not one"),
    ({"logit_bias": {"42": 101}}, "logit_bias", "token 42 has 101"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-2"),
    ({"temperature": 5}, "temperature", "2"),
    ({"top_p": 0}, "top_p", "0"),
    ({"min_p": 1.5}, "min_p", "1"),
    ({"top_k": -2}, "top_k", "-1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "0"),
    ({"max_tokens": 0}, "max_tokens", "1"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "exo sets tools itself"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", ""),
]


@pytest.mark.parametrize(("fields", "param", "message"), REJECTED_CHAT)
def test_rejected_chat_fields_are_a_400_naming_them(
    client: TestClient, fields: dict[str, Any], param: str, message: str
) -> None:
    response = client.post("/chat", json={**BASE, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert message in error["message"]


IGNORED_CHAT: list[dict[str, Any]] = [
    {"user": "u-1"},
    {"metadata": {"session": "s"}},
    {"store": True},
    {"service_tier": "auto"},
    {"prompt_cache_key": "k"},
    {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    {"prompt_cache_retention": "24h"},
    {"safety_identifier": "hash"},
    {"verbosity": "low"},
    {"stream_options": {"include_obfuscation": True}},
    {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hi", "prompt_cache_breakpoint": {"mode": "explicit"}}
                ],
            }
        ]
    },
    # honoured at their only supported values
    {"n": 1},
    {"modalities": ["text"]},
]


@pytest.mark.parametrize("fields", IGNORED_CHAT)
def test_ignored_fields_are_accepted_and_change_nothing(
    client: TestClient, fields: dict[str, Any]
) -> None:
    response = client.post("/chat", json={**BASE, **fields})
    assert response.status_code == 200, response.text
    assert ChatRequest.model_validate(response.json()) == DEFAULT


def chat(**fields: Any) -> ChatRequest:
    return to_chat_request(ChatCompletionRequest.model_validate({**BASE, **fields}))


def expected(**fields: Any) -> ChatRequest:
    return DEFAULT.model_copy(update=fields)


TRANSLATIONS: list[tuple[dict[str, Any], ChatRequest]] = [
    ({}, DEFAULT),
    ({"max_tokens": 100}, expected(max_tokens=100)),
    ({"max_tokens": 100, "max_completion_tokens": 50}, expected(max_tokens=50)),
    ({"stop": "END"}, expected(stop=("END",))),
    ({"stop": ["a", "", "b"]}, expected(stop=("a", "b"))),
    (
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"42": -100, "7": 2.5},
            "seed": 3,
        },
        expected(
            sampling=Sampling(
                temperature=0.5,
                top_p=0.9,
                top_k=40,
                min_p=0.05,
                repetition_penalty=1.1,
                presence_penalty=0.5,
                frequency_penalty=-0.5,
                logit_bias={42: -100.0, 7: 2.5},
                seed=3,
            )
        ),
    ),
    ({"top_k": -1}, expected(sampling=Sampling(top_k=0))),
    ({"logprobs": True, "top_logprobs": 3}, expected(logprobs=True, top_logprobs=3)),
    ({"logprobs": True}, expected(logprobs=True)),
    ({"tools": [READ_TOOL]}, expected(tools=(READ,))),
    (
        {"tools": [{"type": "function", "function": {"name": "ls", "strict": True}}]},
        expected(tools=(ToolFunction(name="ls", strict=True),)),
    ),
    (
        {"tools": [READ_TOOL], "tool_choice": "required"},
        expected(tools=(READ,), tool_choice="required"),
    ),
    ({"tools": [READ_TOOL], "tool_choice": "none"}, expected(tools=(READ,), tool_choice="none")),
    (
        {"tools": [READ_TOOL], "tool_choice": {"type": "function", "function": {"name": "read"}}},
        expected(tools=(READ,), tool_choice=NamedToolChoice(name="read")),
    ),
    ({"parallel_tool_calls": False}, expected(parallel_tool_calls=False)),
    ({"response_format": {"type": "text"}}, DEFAULT),
    ({"response_format": {"type": "json_object"}}, expected(response_format=JsonObjectFormat())),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "description": "ignored: the schema is not shown to the model",
                    "schema": {"type": "integer"},
                    "strict": True,
                },
            }
        },
        expected(
            response_format=JsonSchemaFormat(
                name="answer", json_schema={"type": "integer"}, strict=True
            )
        ),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
        expected(response_format=JsonSchemaFormat(name="any", json_schema={}, strict=False)),
    ),
    (
        {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
        expected(template_kwargs={"enable_thinking": False}, reasoning_effort="low"),
    ),
    (
        {"stream": True, "stream_options": {"include_usage": True}},
        expected(stream=True, include_usage=True),
    ),
    ({"stream_options": {"include_usage": True}}, DEFAULT),  # usage chunks need a stream
    ({"speculation": False}, expected(speculation=False)),
    ({"speculation": True}, DEFAULT),
    ({"prediction": {"type": "content", "content": "x = 1"}}, expected(prediction="x = 1")),
    (
        {
            "prediction": {
                "type": "content",
                "content": [{"type": "text", "text": "x = "}, {"type": "text", "text": "1"}],
            }
        },
        expected(prediction="x = 1"),
    ),
]


@pytest.mark.parametrize(("fields", "request_"), TRANSLATIONS)
def test_translation_keeps_what_the_client_meant(
    fields: dict[str, Any], request_: ChatRequest
) -> None:
    assert chat(**fields) == request_


def test_messages_become_turns() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "read", "arguments": '{"path": "a"}'},
    }
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": "Read a"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "reasoning_content": "Need a.",
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "text of a"}]},
        {"role": "tool", "tool_call_id": "c9", "content": "an unknown call"},
        {"role": "tool", "tool_call_id": "c8", "content": "named", "name": "ls"},
        {"role": "assistant", "content": None, "refusal": "I can't."},
        {"role": "assistant", "content": "Yes.", "reasoning": "Sure."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Done"}, {"type": "refusal", "refusal": "."}],
        },
    ]
    assert chat(messages=messages).turns == (
        ChatTurn(role="system", content="Be brief."),
        ChatTurn(role="user", content="Read a"),
        ChatTurn(
            role="assistant",
            tool_calls=(ToolCall(id="c1", name="read", arguments='{"path": "a"}'),),
            reasoning="Need a.",
        ),
        ChatTurn(role="tool", content="text of a", tool_call_id="c1", name="read"),
        ChatTurn(role="tool", content="an unknown call", tool_call_id="c9"),
        ChatTurn(role="tool", content="named", tool_call_id="c8", name="ls"),
        ChatTurn(role="assistant", content="I can't."),
        ChatTurn(role="assistant", content="Yes.", reasoning="Sure."),
        ChatTurn(role="assistant", content="Done."),
    )


def test_user_images_keep_their_place_among_the_text() -> None:
    content = [
        {"type": "image_url", "image_url": {"url": PNG_URL}},
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "high"}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": PNG_URL.replace("data:", "DATA:", 1)}},
    ]
    assert chat(messages=[{"role": "user", "content": content}]).turns == (
        ChatTurn(
            role="user",
            content="Compare with",
            images=(
                ChatImage(offset=0, data=PNG_BYTES),
                ChatImage(offset=8, url="https://example.com/a.png"),
                ChatImage(offset=12, data=PNG_BYTES),
            ),
        ),
    )


@pytest.mark.parametrize("detail", ["auto", "low", "high"])
def test_an_images_detail_is_accepted_and_changes_nothing(detail: str) -> None:
    with_detail = chat(messages=[image_message(PNG_URL, detail=detail)])
    assert with_detail == chat(messages=[image_message(PNG_URL)])
    assert with_detail.turns[0].images == (ChatImage(data=PNG_BYTES),)


def test_a_recorded_opencode_turn_is_accepted() -> None:
    recorded = Path(__file__).parent.parent / "fixtures" / "clients" / "opencode_agent_turn.json"
    body = json.loads(recorded.read_text())["body"]
    request = to_chat_request(ChatCompletionRequest.model_validate(body))
    assert len(request.tools) == 10 and request.tool_choice == "auto"
    assert (request.stream, request.include_usage, request.max_tokens) == (True, True, 64)
    assert [turn.role for turn in request.turns] == ["system", "user"]


# ---- legacy completions ----


@pytest.mark.parametrize(
    ("prompt", "expected_prompt"),
    [
        ("def add(a, b):", TextPrompt(text="def add(a, b):")),
        (["def add(a, b):"], TextPrompt(text="def add(a, b):")),
        ([1, 2, 3], TokenPrompt(tokens=(1, 2, 3))),
        ([[1, 2, 3]], TokenPrompt(tokens=(1, 2, 3))),
    ],
)
def test_a_legacy_prompt_is_text_or_token_ids(prompt: Any, expected_prompt: Any) -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert completion_to_chat_request(body) == ChatRequest(
        model=ModelId("m"), prompt=expected_prompt
    )


def test_legacy_sampling_and_logprobs() -> None:
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "max_tokens": 16,
            "temperature": 0,
            "top_k": 1,
            "stop": ["\n\n"],
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
            "n": 1,
            "best_of": 1,
            "echo": False,
        }
    )
    assert completion_to_chat_request(body) == ChatRequest(
        model=ModelId("m"),
        prompt=TextPrompt(text="x"),
        max_tokens=16,
        stop=("\n\n",),
        sampling=Sampling(temperature=0, top_k=1),
        logprobs=True,
        top_logprobs=2,
        stream=True,
        include_usage=True,
    )


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"prompt": [[1], [2]]}, "prompt", "one prompt per request"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, -2]}, "prompt", ">= 0"),
        ({"echo": True}, "echo", "not supported"),
        ({"suffix": "}"}, "suffix", "not supported"),
        ({"best_of": 2}, "best_of", "best_of must be 1"),
        ({"n": 3}, "n", "n must be 1"),
        ({"logprobs": 21}, "logprobs", "20"),
        ({"frobnicate": True}, "frobnicate", "unknown parameter"),
    ],
)
def test_rejected_completion_fields_are_a_400_naming_them(
    client: TestClient, fields: dict[str, Any], param: str, message: str
) -> None:
    response = client.post("/completions", json={"model": "m", "prompt": "x", **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert message in error["message"]


# ---- responses, as the official client reads them ----

USAGE = CompletionUsage(
    prompt_tokens=10,
    completion_tokens=5,
    total_tokens=15,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=8),
    completion_tokens_details=CompletionTokensDetails(reasoning_tokens=2),
)


def test_a_tool_call_reply_has_openais_shape() -> None:
    reply = ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[
            Choice(
                message=AssistantMessage(
                    content=None,
                    tool_calls=[
                        ChatToolCall(
                            id="call_1",
                            function=FunctionCall(name="read", arguments='{"path": "a"}'),
                        )
                    ],
                ),
                finish_reason="tool_calls",
                logprobs=ChoiceLogprobs(
                    content=[
                        TokenLogprob(
                            token="<",
                            logprob=-0.1,
                            bytes=(60,),
                            top_logprobs=(TopLogprob(token="<", logprob=-0.1, bytes=(60,)),),
                        )
                    ]
                ),
            )
        ],
        usage=USAGE,
    )
    data = reply.model_dump()
    message = data["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message
    parsed = openai.types.chat.ChatCompletion.model_validate(data)
    call = parsed.choices[0].message.tool_calls[0]  # pyright: ignore[reportOptionalSubscript]
    assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1",
        "read",
        '{"path": "a"}',
    )
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [60]  # pyright: ignore[reportOptionalMemberAccess, reportOptionalSubscript]
    plain = AssistantMessage(content="Hi", reasoning_content="Greet.").model_dump()
    assert plain == {"role": "assistant", "content": "Hi", "reasoning_content": "Greet."}


def test_streamed_tool_calls_come_in_openais_pieces() -> None:
    def chunk(delta: Delta, finish: Any = None) -> dict[str, Any]:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        return ChatCompletionChunk(id="c", created=1, model="m", choices=[choice]).model_dump()

    first = chunk(
        Delta(
            tool_calls=[
                ToolCallDelta(
                    index=0,
                    id="call_1",
                    type="function",
                    function=FunctionCallDelta(name="read", arguments=""),
                )
            ]
        )
    )
    piece = chunk(
        Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"pa'))])
    )
    thinking = chunk(Delta(reasoning_content="Hmm"))
    last = chunk(Delta(), "tool_calls")
    assert first["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "read", "arguments": ""},
            }
        ]
    }
    assert piece["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]
    }
    assert thinking["choices"][0]["delta"] == {"reasoning_content": "Hmm"}
    for data in (first, piece, thinking, last):
        openai.types.chat.ChatCompletionChunk.model_validate(data)
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_a_legacy_completion_has_openais_shape() -> None:
    reply = Completion(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[
            CompletionChoice(
                text=" return a + b",
                finish_reason="stop",
                logprobs=CompletionLogprobs(
                    tokens=[" return"],
                    token_logprobs=[-0.2],
                    top_logprobs=[{" return": -0.2}],
                    text_offset=[14],
                ),
            )
        ],
        usage=USAGE,
    )
    parsed = openai.types.Completion.model_validate(reply.model_dump())
    assert parsed.choices[0].text == " return a + b"
    assert parsed.choices[0].logprobs.token_logprobs == [-0.2]  # pyright: ignore[reportOptionalMemberAccess]


# ---- the internal request's own rules ----

HI = (ChatTurn(role="user", content="Hi"),)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "either turns or a raw prompt"),
        ({"turns": HI, "prompt": TextPrompt(text="x")}, "either turns or a raw prompt"),
        ({"prompt": TextPrompt(text="x"), "tools": (READ,)}, "tools need a chat template"),
        (
            {"turns": HI, "template_kwargs": {"add_generation_prompt": False}},
            "add_generation_prompt",
        ),
        ({"prompt": {"kind": "tokens", "tokens": []}}, "at least 1"),
    ],
)
def test_a_chat_request_has_one_consistent_input(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChatRequest.model_validate({"model": "m", **fields})


async def test_usage_counts_the_reasoning_tokens() -> None:
    done = ReplyFinished(
        finish_reason="stop",
        usage=Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=8),
        reasoning_tokens=3,
    )
    events = [ReasoningPiece(text="Think."), TextPiece(text="Hi"), done]
    reply = await chat_completion(scripted(events))
    parsed = openai.types.chat.ChatCompletion.model_validate(reply.model_dump())
    assert parsed.usage is not None and parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 3
    assert parsed.choices[0].message.model_dump()["reasoning_content"] == "Think."
