"""The Ollama API adapter: every request field (and option) is honoured,
rejected with a 400 naming it, or accepted and ignored from a documented list;
chat and generate requests translate into the internal ChatRequest; reply
events come out as the NDJSON chunks and the object the official `ollama`
client reads, with Ollama's stats."""

import base64
import json
from typing import Any

import ollama
import pytest
from ollama import _types as official  # pyright: ignore[reportPrivateUsage]
from pydantic import BaseModel

from exo.api.errors import APIError
from exo.api.ollama import (
    WHOLE_CONTEXT,
    ReplyAssembler,
    chat_request,
    generate_request,
    model_name,
    reply_lines,
    reply_object,
)
from exo.api.ollama_types import (
    HONOURED_CHAT_FIELDS,
    HONOURED_GENERATE_FIELDS,
    HONOURED_OPTIONS,
    IGNORED_CHAT_FIELDS,
    IGNORED_GENERATE_FIELDS,
    IGNORED_OPTIONS,
    IGNORED_PULL_FIELDS,
    IGNORED_SHOW_FIELDS,
    REJECTED_GENERATE_FIELDS,
    REJECTED_OPTIONS,
    ChatMessage,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    PullRequest,
    ShowRequest,
)
from exo.api.reply_stream import (
    KeepAlive,
    ReplyEvent,
    ReplyFinished,
    TokenLogprob,
    TokenLogprobs,
    TopLogprob,
)
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import TextPiece, ToolCallEnd, ToolCallStart
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
    JsonSchemaFormat,
    Sampling,
    TextPrompt,
    ToolCall,
    ToolFunction,
)
from exo.shared.types.tasks import Usage
from tests.unit.api_adapters import assert_fields_classified, assert_rejected, scripted

HI = {"role": "user", "content": "Hi"}
CHAT: dict[str, Any] = {"model": "m", "messages": [HI]}
GENERATE: dict[str, Any] = {"model": "m", "prompt": "Hi"}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
}


def expected(**fields: Any) -> ChatRequest:
    return ChatRequest(
        **({"model": "m", "turns": (ChatTurn(role="user", content="Hi"),), "stream": True} | fields)
    )


def test_every_field_and_option_is_classified_and_the_official_clients_are_declared() -> None:
    assert_fields_classified(OllamaChatRequest, HONOURED_CHAT_FIELDS, IGNORED_CHAT_FIELDS, set())
    assert_fields_classified(
        OllamaGenerateRequest,
        HONOURED_GENERATE_FIELDS,
        IGNORED_GENERATE_FIELDS,
        set(REJECTED_GENERATE_FIELDS),
    )
    assert_fields_classified(
        OllamaOptions, HONOURED_OPTIONS, IGNORED_OPTIONS, set(REJECTED_OPTIONS)
    )
    assert_fields_classified(ShowRequest, frozenset({"model", "name"}), IGNORED_SHOW_FIELDS, set())
    assert_fields_classified(
        PullRequest, frozenset({"model", "name", "stream"}), IGNORED_PULL_FIELDS, set()
    )
    ours: dict[type[BaseModel], type[BaseModel]] = {
        official.ChatRequest: OllamaChatRequest,
        official.Message: ChatMessage,
        official.GenerateRequest: OllamaGenerateRequest,
        official.Options: OllamaOptions,
        official.ShowRequest: ShowRequest,
        official.PullRequest: PullRequest,
    }
    for theirs, declared in ours.items():
        assert set(theirs.model_fields) <= set(declared.model_fields), theirs


TRANSLATIONS: list[tuple[str, dict[str, Any], ChatRequest]] = [
    ("a user message; streams unless told not to", {}, expected()),
    ("stream false", {"stream": False}, expected(stream=False)),
    (
        "options: sampling, limits and stops",
        {
            "options": {
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 40,
                "min_p": 0.05,
                "seed": 7,
                "num_predict": 12,
                "stop": ["\n", ""],
                "repeat_penalty": 1.1,
                "repeat_last_n": 64,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "num_ctx": 4096,
                "num_thread": 8,
            }
        },
        expected(
            max_tokens=12,
            stop=("\n",),
            sampling=Sampling(
                temperature=0.5,
                top_p=0.9,
                top_k=40,
                min_p=0.05,
                seed=7,
                repetition_penalty=1.1,
                repetition_context_size=64,
                presence_penalty=0.5,
                frequency_penalty=-0.5,
            ),
        ),
    ),
    (
        "num_predict -1 and a negative seed: no limit, a random seed",
        {"options": {"num_predict": -1, "seed": -1}},
        expected(),
    ),
    (
        "repeat_last_n 0 turns the repetition penalty off",
        {"options": {"repeat_last_n": 0, "repeat_penalty": 1.3}},
        expected(sampling=Sampling(repetition_penalty=1.0)),
    ),
    (
        "repeat_last_n -1 looks back over everything",
        {"options": {"repeat_last_n": -1}},
        expected(sampling=Sampling(repetition_context_size=WHOLE_CONTEXT)),
    ),
    ('format "json"', {"format": "json"}, expected(response_format=JsonObjectFormat())),
    (
        "format as a JSON schema",
        {"format": WEATHER},
        expected(response_format=JsonSchemaFormat(json_schema=WEATHER)),
    ),
    ('format ""', {"format": ""}, expected()),
    ("think true", {"think": True}, expected(template_kwargs={"enable_thinking": True})),
    ("think false", {"think": False}, expected(template_kwargs={"enable_thinking": False})),
    (
        "a think level",
        {"think": "high"},
        expected(template_kwargs={"enable_thinking": True}, reasoning_effort="high"),
    ),
    (
        "logprobs",
        {"logprobs": True, "top_logprobs": 3},
        expected(logprobs=True, top_logprobs=3),
    ),
    ("ignored fields", {"keep_alive": "5m", "truncate": True, "shift": False}, expected()),
    (
        "tools, and a conversation with calls and their results",
        {
            "tools": [WEATHER_TOOL],
            "messages": [
                {"role": "system", "content": "Be brief."},
                HI,
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "Look it up.",
                    "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {
                            "id": "call_b",
                            "function": {"index": 1, "name": "other", "arguments": {}},
                        },
                    ],
                },
                {"role": "tool", "tool_name": "get_weather", "content": "Sunny"},
                {"role": "Tool", "tool_call_id": "call_b", "content": "Done"},
            ],
        },
        expected(
            tools=(ToolFunction(name="get_weather", description="Weather", parameters=WEATHER),),
            turns=(
                ChatTurn(role="system", content="Be brief."),
                ChatTurn(role="user", content="Hi"),
                ChatTurn(
                    role="assistant",
                    reasoning="Look it up.",
                    tool_calls=(
                        ToolCall(id="", name="get_weather", arguments='{"city": "Paris"}'),
                        ToolCall(id="call_b", name="other", arguments="{}"),
                    ),
                ),
                ChatTurn(role="tool", content="Sunny", name="get_weather"),
                ChatTurn(role="tool", content="Done", tool_call_id="call_b", name="other"),
            ),
        ),
    ),
]


@pytest.mark.parametrize(
    ("fields", "translated"), [t[1:] for t in TRANSLATIONS], ids=[t[0] for t in TRANSLATIONS]
)
def test_chat_translates(fields: dict[str, Any], translated: ChatRequest) -> None:
    assert chat_request(OllamaChatRequest.model_validate(CHAT | fields)) == translated


def test_generate_renders_system_and_prompt_or_takes_a_raw_prompt() -> None:
    templated = generate_request(
        OllamaGenerateRequest.model_validate(GENERATE | {"system": "Be brief.", "stream": False})
    )
    assert templated == expected(
        turns=(ChatTurn(role="system", content="Be brief."), ChatTurn(role="user", content="Hi")),
        stream=False,
    )
    raw = generate_request(
        OllamaGenerateRequest.model_validate(GENERATE | {"raw": True, "system": "", "suffix": ""})
    )
    assert raw == ChatRequest(model="m", prompt=TextPrompt(text="Hi"), stream=True)


PNG_BYTES = b"\x89PNG\r\n\x1a\n a picture"  # the adapter decodes; it does not read pixels
PNG_B64 = base64.b64encode(PNG_BYTES).decode()


def test_images_come_ahead_of_their_messages_text() -> None:
    messages = [
        HI | {"images": [PNG_B64, PNG_B64[:4] + "\n" + PNG_B64[4:]]},
        {"role": "assistant", "content": "A cat.", "images": []},
        {"role": "tool", "content": "shot", "tool_name": "screenshot", "images": [PNG_B64]},
    ]
    picture = ChatImage(offset=0, data=PNG_BYTES)
    assert chat_request(OllamaChatRequest.model_validate(CHAT | {"messages": messages})).turns == (
        ChatTurn(role="user", content="Hi", images=(picture, picture)),
        ChatTurn(role="assistant", content="A cat."),
        ChatTurn(role="tool", content="shot", images=(picture,), name="screenshot"),
    )
    generated = generate_request(
        OllamaGenerateRequest.model_validate(GENERATE | {"images": [PNG_B64]})
    )
    assert generated == expected(turns=(ChatTurn(role="user", content="Hi", images=(picture,)),))


def test_a_latest_tag_names_the_untagged_model() -> None:
    assert model_name("org/model:latest") == "org/model"
    assert model_name("model:7b") == "model:7b"


REJECTED: list[tuple[type[Any], dict[str, Any], str, str]] = [
    (
        OllamaChatRequest,
        {"messages": [HI | {"images": [PNG_B64, "not base64!"]}]},
        "messages.0.images.1",
        "the image is not valid base64",
    ),
    (
        OllamaChatRequest,
        {"messages": [HI | {"images": ["data:image/png;base64," + PNG_B64]}]},
        "messages.0.images.0",
        "the image is not valid base64",
    ),
    (
        OllamaChatRequest,
        {"messages": [{"role": "assistant", "content": "x", "images": [PNG_B64]}]},
        "messages.0",
        "assistant messages have no images (user and tool messages do)",
    ),
    (OllamaChatRequest, {"made_up": 1}, "made_up", "Extra inputs are not permitted"),
    (OllamaChatRequest, {"options": {"made_up": 1}}, "options.made_up", "Extra inputs"),
    (OllamaChatRequest, {"options": {"typical_p": 0.9}}, "options.typical_p", "typical sampling"),
    (OllamaChatRequest, {"options": {"mirostat": 2}}, "options.mirostat", "mirostat"),
    (OllamaChatRequest, {"options": {"temperature": 3}}, "options.temperature", "less than"),
    (OllamaChatRequest, {"format": "yaml"}, "format", 'format is "json" or a JSON schema'),
    (OllamaChatRequest, {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (
        OllamaChatRequest,
        {"format": "json", "tools": [WEATHER_TOOL]},
        "",
        "format and tools cannot be combined",
    ),
    (OllamaChatRequest, {"format": {}, "tools": [WEATHER_TOOL]}, "", "format and tools"),
    (
        OllamaChatRequest,
        {"tools": [{"type": "web_search"}]},
        "tools",
        "only function tools are supported",
    ),
    (
        OllamaChatRequest,
        {"messages": [HI | {"thinking": "hmm"}]},
        "messages.0",
        "a user message has no thinking",
    ),
    (OllamaGenerateRequest, {"suffix": "end"}, "suffix", "fill-in-the-middle"),
    (OllamaGenerateRequest, {"template": "{{ .Prompt }}"}, "template", "chat template"),
    (OllamaGenerateRequest, {"context": [1, 2]}, "context", "/api/chat"),
    (OllamaGenerateRequest, {"images": [""]}, "images.0", "the image is empty"),
    (
        OllamaGenerateRequest,
        {"raw": True, "images": [PNG_B64]},
        "",
        "images need the chat template: a raw prompt is used as is",
    ),
    (OllamaGenerateRequest, {"width": 512}, "width", "image generation"),
    (OllamaGenerateRequest, {"raw": True, "system": "S"}, "", "a raw prompt is used as is"),
]


@pytest.mark.parametrize(("request_type", "fields", "location", "message"), REJECTED)
def test_unsupported_fields_are_rejected_by_name(
    request_type: type[Any], fields: dict[str, Any], location: str, message: str
) -> None:
    base = CHAT if request_type is OllamaChatRequest else GENERATE
    assert_rejected(request_type, base | fields, location, message)


def test_show_and_pull_take_the_model_or_its_older_name() -> None:
    assert ShowRequest.model_validate({"name": "m"}).model_name() == "m"
    assert PullRequest.model_validate({"model": "m", "insecure": True}).model_name() == "m"
    assert_rejected(ShowRequest, {}, "", "model is required")


# ---- replies ----

USAGE = Usage(prompt_tokens=30, completion_tokens=5, cached_tokens=10)
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
LOGPROBS = TokenLogprobs(
    tokens=(
        TokenLogprob(
            token="Hi",
            logprob=-0.1,
            bytes=(72, 105),
            top_logprobs=(TopLogprob(token="Hi", logprob=-0.1, bytes=(72, 105)),),
        ),
    )
)
EVENTS: list[ReplyEvent] = [
    KeepAlive(),
    ReasoningPiece(text="Think."),
    TextPiece(text="Hi"),
    LOGPROBS,
    TextPiece(text=" there"),
    ToolCallStart(index=0, id="call_1", name="get_weather"),
    ToolCallEnd(index=0, call=CALL),
    ReplyFinished(finish_reason="tool_calls", usage=USAGE, tool_calls=(CALL,)),
]
STATS = (
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
)


async def test_a_chat_streams_pieces_then_a_done_chunk_with_stats() -> None:
    assembler = ReplyAssembler(scripted(EVENTS), "chat", started_ns=0)
    lines = [json.loads(line) async for line in reply_lines(assembler)]
    chunks = [ollama.ChatResponse(**line) for line in lines]
    assert [c.message.content for c in chunks] == ["", "", "Hi", "", " there", "", ""]
    assert chunks[0].done is False  # the keep-alive: an empty chunk
    assert chunks[1].message.thinking == "Think."
    assert chunks[3].logprobs is not None and chunks[3].logprobs[0].token == "Hi"
    calls = chunks[5].message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert lines[5]["message"]["tool_calls"][0] == {
        "id": "call_1",
        "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
    }
    last = chunks[-1]
    assert last.done is True and last.done_reason == "stop"
    assert (last.prompt_eval_count, last.eval_count) == (30, 5)
    assert all(lines[-1][stat] >= 0 for stat in STATS)
    assert last.total_duration == (
        (last.load_duration or 0) + (last.prompt_eval_duration or 0) + (last.eval_duration or 0)
    )
    assert all(not line["done"] for line in lines[:-1])


async def test_a_whole_chat_holds_every_piece() -> None:
    whole = await reply_object(ReplyAssembler(scripted(EVENTS), "chat", started_ns=0))
    reply = ollama.ChatResponse(**whole)
    assert reply.message.content == "Hi there" and reply.message.thinking == "Think."
    assert reply.message.tool_calls is not None and len(reply.message.tool_calls) == 1
    assert reply.logprobs is not None and len(reply.logprobs) == 1
    assert reply.done and reply.done_reason == "stop" and reply.eval_count == 5


async def test_a_generate_reply_is_response_text_and_length_is_its_own_reason() -> None:
    events: list[ReplyEvent] = [
        ReasoningPiece(text="Hm."),
        TextPiece(text="Paris"),
        ReplyFinished(finish_reason="length", usage=USAGE),
    ]
    whole = await reply_object(ReplyAssembler(scripted(events), "generate", started_ns=0))
    reply = ollama.GenerateResponse(**whole)
    assert (reply.response, reply.thinking, reply.done_reason) == ("Paris", "Hm.", "length")
    assert "message" not in whole


async def test_an_error_during_the_stream_ends_it_with_an_error_line() -> None:
    failure = APIError(503, "the model runner is unavailable", "server_error")
    assembler = ReplyAssembler(scripted([TextPiece(text="Hi")], failure), "chat", started_ns=0)
    lines = [json.loads(line) async for line in reply_lines(assembler)]
    assert lines[-1] == {"error": "the model runner is unavailable"}
    with pytest.raises(APIError):
        await reply_object(ReplyAssembler(scripted([], failure), "chat", started_ns=0))
