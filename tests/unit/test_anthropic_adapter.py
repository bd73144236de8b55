"""The Anthropic Messages adapter: every request field is honoured, rejected
with a 400 naming it, or accepted and ignored from a documented list; requests
(the recorded Claude Code one included) translate into the internal
ChatRequest; reply events come out as the exact event stream and message the
official client reads."""

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anthropic.types
import anthropic.types.beta.message_count_tokens_params as beta_count_params
import anthropic.types.beta.message_create_params as beta_create_params
import pytest
from anthropic.lib.streaming._messages import accumulate_event  # pyright: ignore[reportPrivateUsage]
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from exo.api.anthropic import (
    PING_EVENT,
    MessageAssembler,
    count_tokens_to_chat_request,
    message_response,
    message_stream,
    reasoning_signature,
    shows_thinking,
    to_chat_request,
)
from exo.api.anthropic_types import (
    HONOURED_MESSAGES_FIELDS,
    IGNORED_MESSAGES_FIELDS,
    REJECTED_MESSAGES_FIELDS,
    CountTokensRequest,
    MessagesRequest,
)
from exo.api.canonical import canonical_request
from exo.api.errors import APIError, anthropic_error_body, anthropic_error_type
from exo.api.reply_stream import ReplyEvent, ReplyFinished
from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import (
    TextPiece,
    ToolCallAbandoned,
    ToolCallArgumentsPiece,
    ToolCallEnd,
    ToolCallStart,
)
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonSchemaFormat,
    NamedToolChoice,
    Sampling,
    ToolCall,
    ToolFunction,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.tasks import Usage
from tests.unit.api_adapters import assert_fields_classified, assert_rejected, scripted

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"
USER = {"role": "user", "content": "Hi"}
BASE: dict[str, Any] = {"model": "claude-x", "max_tokens": 100, "messages": [USER]}
READ_TOOL = {
    "name": "read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
READ = ToolFunction(
    name="read",
    description="Read a file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
)
HI = ChatTurn(role="user", content="Hi")


def chat_request(**fields: Any) -> ChatRequest:
    return to_chat_request(MessagesRequest.model_validate(BASE | fields))


def expected(**fields: Any) -> ChatRequest:
    return ChatRequest(
        **({"model": ModelId("claude-x"), "max_tokens": 100, "turns": (HI,)} | fields)
    )


def test_every_field_of_anthropics_requests_is_classified() -> None:
    assert_fields_classified(
        MessagesRequest,
        HONOURED_MESSAGES_FIELDS,
        IGNORED_MESSAGES_FIELDS,
        set(REJECTED_MESSAGES_FIELDS),
    )
    # everything the official client can send in the body is declared (`betas`
    # is a header, `output_format` the client's own helper for output_config.format)
    client_only = {"betas", "output_format"}
    for params in (
        message_create_params.MessageCreateParamsBase,
        beta_create_params.MessageCreateParamsBase,
    ):
        assert set(params.__annotations__) - client_only <= set(MessagesRequest.model_fields)
    for params in (
        message_count_tokens_params.MessageCountTokensParams,
        beta_count_params.MessageCountTokensParams,
    ):
        assert set(params.__annotations__) - client_only <= set(CountTokensRequest.model_fields)


def test_the_recorded_claude_code_request_translates() -> None:
    recorded = json.loads((FIXTURES / "claude_code_turn.json").read_text())
    body = recorded["body"]
    request = to_chat_request(MessagesRequest.model_validate(body))

    system = [block["text"] for block in body["system"]]
    environment = body["messages"][1]["content"][0]["text"]
    assert request.turns == (
        # the environment message (before any assistant turn) joins the system prompt
        ChatTurn(role="system", content="\n".join(system) + "\n\n" + environment),
        ChatTurn(role="user", content="Read README"),
    )
    assert request.tools == tuple(
        ToolFunction(
            name=tool["name"], description=tool["description"], parameters=tool["input_schema"]
        )
        for tool in body["tools"]
    )
    assert (request.model, request.max_tokens, request.stream) == ("claude-opus-5-5", 128000, True)
    assert (request.tool_choice, request.parallel_tool_calls) == ("auto", True)
    # effort "medium" is the template's reasoning_effort; adaptive thinking keeps the default
    assert (request.reasoning_effort, request.template_kwargs) == ("medium", {})
    assert not shows_thinking(MessagesRequest.model_validate(body))  # display: omitted
    # canonicalized, the billing header line is gone and nothing else changed
    canonical = canonical_request(request).turns[0].content
    assert canonical == "\n".join(system[1:]) + "\n\n" + environment


TOOL_USE = {"type": "tool_use", "id": "toolu_01AbC", "name": "read", "input": {"path": "a é.txt"}}
READ_CALL = ToolCall(id="toolu_01AbC", name="read", arguments='{"path": "a é.txt"}')


def tool_result(content: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "toolu_01AbC", "content": content, **extra}


PNG_BYTES = b"\x89PNG\r\n\x1a\n a picture"  # the adapter decodes; it does not read pixels
PNG_B64 = base64.b64encode(PNG_BYTES).decode()
TEXT_A = {"type": "text", "text": "a"}


def image_block(data: str, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def url_image(url: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "url", "url": url}}


def user_blocks(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


TRANSLATIONS: list[tuple[str, dict[str, Any], ChatRequest]] = [
    ("minimal", {}, expected()),
    (
        "system as a string",
        {"system": "Be brief."},
        expected(turns=(ChatTurn(role="system", content="Be brief."), HI)),
    ),
    (
        "system blocks join as lines, cache_control ignored",
        {
            "system": [
                {"type": "text", "text": "A"},
                {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
            ]
        },
        expected(turns=(ChatTurn(role="system", content="A\nB"), HI)),
    ),
    (
        "tool_use and tool_result round trip with the client's ids",
        {
            "tools": [READ_TOOL],
            "messages": [
                USER,
                {"role": "assistant", "content": [{"type": "text", "text": "Reading."}, TOOL_USE]},
                {
                    "role": "user",
                    "content": [
                        tool_result(
                            [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]
                        ),
                        {"type": "text", "text": "Now summarize."},
                    ],
                },
            ],
        },
        expected(
            tools=(READ,),
            turns=(
                HI,
                ChatTurn(role="assistant", content="Reading.", tool_calls=(READ_CALL,)),
                ChatTurn(
                    role="tool", content="line 1\nline 2", tool_call_id="toolu_01AbC", name="read"
                ),
                ChatTurn(role="user", content="Now summarize."),
            ),
        ),
    ),
    (
        "an error result is read as its text",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [tool_result("no such file", is_error=True)]},
            ]
        },
        expected(
            turns=(
                HI,
                ChatTurn(role="assistant", tool_calls=(READ_CALL,)),
                ChatTurn(
                    role="tool", content="no such file", tool_call_id="toolu_01AbC", name="read"
                ),
            )
        ),
    ),
    (
        "thinking in history: exo's signature restores the reasoning, redacted is skipped",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "thinking",
                            "thinking": "",
                            "signature": reasoning_signature("Let me think."),
                        },
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Hello"},
                    ],
                },
                {"role": "user", "content": "And?"},
            ]
        },
        expected(
            turns=(
                HI,
                ChatTurn(role="assistant", content="Hello", reasoning="Let me think."),
                ChatTurn(role="user", content="And?"),
            )
        ),
    ),
    (
        "thinking from another server keeps its text",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Hmm.", "signature": "EqQBCkgIARAB"}
                    ],
                },
                USER,
            ]
        },
        expected(turns=(HI, ChatTurn(role="assistant", reasoning="Hmm."), HI)),
    ),
    (
        "a system message after an assistant turn stays where it stands",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "Hello"},
                {"role": "system", "content": "Reminder."},
                {"role": "user", "content": "Go on"},
            ]
        },
        expected(
            turns=(
                HI,
                ChatTurn(role="assistant", content="Hello"),
                ChatTurn(role="system", content="Reminder."),
                ChatTurn(role="user", content="Go on"),
            )
        ),
    ),
    (
        "a system message to clear at the next user message is gone once one came",
        {
            "messages": [
                USER,
                {"role": "system", "content": "Once.", "clear_at": "next_user_message"},
                {"role": "assistant", "content": "Hello"},
                {"role": "system", "content": "Still.", "clear_at": "next_user_message"},
                {"role": "user", "content": "Go on"},
                {"role": "system", "content": "Now.", "clear_at": "next_user_message"},
            ]
        },
        expected(
            turns=(
                HI,
                ChatTurn(role="assistant", content="Hello"),
                ChatTurn(role="user", content="Go on"),
                ChatTurn(role="system", content="Now."),
            )
        ),
    ),
    (
        "tool_choice any, without parallel calls",
        {"tools": [READ_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        expected(tools=(READ,), tool_choice="required", parallel_tool_calls=False),
    ),
    (
        "tool_choice tool",
        {"tools": [READ_TOOL], "tool_choice": {"type": "tool", "name": "read"}},
        expected(tools=(READ,), tool_choice=NamedToolChoice(name="read")),
    ),
    (
        "tool_choice none",
        {"tools": [READ_TOOL], "tool_choice": {"type": "none"}},
        expected(tools=(READ,), tool_choice="none"),
    ),
    (
        "tool_choice auto, without parallel calls",
        {"tools": [READ_TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
        expected(tools=(READ,), parallel_tool_calls=False),
    ),
    (
        "a strict tool",
        {"tools": [READ_TOOL | {"strict": True, "type": "custom"}]},
        expected(tools=(READ.model_copy(update={"strict": True}),)),
    ),
    (
        "thinking enabled",
        {"thinking": {"type": "enabled", "budget_tokens": 2048}},
        expected(template_kwargs={"enable_thinking": True}),
    ),
    (
        "thinking disabled",
        {"thinking": {"type": "disabled"}},
        expected(template_kwargs={"enable_thinking": False}),
    ),
    ("thinking adaptive", {"thinking": {"type": "adaptive"}}, expected()),
    (
        "effort and structured output",
        {
            "output_config": {
                "effort": "high",
                "format": {"type": "json_schema", "schema": {"type": "object"}},
            }
        },
        expected(
            reasoning_effort="high",
            response_format=JsonSchemaFormat(json_schema={"type": "object"}),
        ),
    ),
    (
        "sampling and stops",
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stop_sequences": ["END", ""],
            "stream": True,
        },
        expected(
            sampling=Sampling(temperature=0.5, top_p=0.9, top_k=40), stop=("END",), stream=True
        ),
    ),
    (
        "ignored fields change nothing",
        {
            "metadata": {"user_id": '{"device_id": "x"}'},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "service_tier": "auto",
            "speed": "standard",
            "cache_control": {"type": "ephemeral"},
        },
        expected(),
    ),
    (
        "a max_tokens above any context is carried as sent",
        {"max_tokens": 128000},
        expected(max_tokens=128000),
    ),
]


@pytest.mark.parametrize(
    ("fields", "want"), [case[1:] for case in TRANSLATIONS], ids=[case[0] for case in TRANSLATIONS]
)
def test_translation(fields: dict[str, Any], want: ChatRequest) -> None:
    assert chat_request(**fields) == want


def test_images_keep_their_place_among_the_text_and_tool_results() -> None:
    messages = [
        user_blocks(
            image_block(PNG_B64),
            {"type": "text", "text": "one"},
            url_image("https://example.com/a.png"),
            {"type": "text", "text": "two"},
            {**image_block(PNG_B64[:8] + "\n" + PNG_B64[8:]), "cache_control": {"type": "x"}},
        ),
        {"role": "assistant", "content": [TOOL_USE]},
        user_blocks(
            tool_result([{"type": "text", "text": "shot:"}, image_block(PNG_B64, "image/jpeg")]),
            image_block(PNG_B64),
        ),
    ]
    assert chat_request(messages=messages).turns == (
        ChatTurn(
            role="user",
            content="one\ntwo",
            images=(
                ChatImage(offset=0, data=PNG_BYTES),
                ChatImage(offset=3, url="https://example.com/a.png"),
                ChatImage(offset=7, data=PNG_BYTES),
            ),
        ),
        ChatTurn(role="assistant", tool_calls=(READ_CALL,)),
        ChatTurn(
            role="tool",
            content="shot:",
            images=(ChatImage(offset=5, data=PNG_BYTES),),
            tool_call_id="toolu_01AbC",
            name="read",
        ),
        ChatTurn(role="user", images=(ChatImage(data=PNG_BYTES),)),
    )


def test_count_tokens_translates_the_same_prompt() -> None:
    fields = {"system": "S", "tools": [READ_TOOL], "thinking": {"type": "disabled"}}
    counted = count_tokens_to_chat_request(
        CountTokensRequest.model_validate({"model": "claude-x", "messages": [USER]} | fields)
    )
    generated = chat_request(**fields)
    assert counted == generated.model_copy(update={"max_tokens": None})


REJECTED: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "at least one"),
    (
        {"messages": [USER, {"role": "assistant", "content": "The answer is"}]},
        "messages",
        "prefill",
    ),
    (
        {"messages": [user_blocks(image_block("not base64!"))]},
        "messages.0.user.content",
        "block 0 (source.data): the image is not valid base64",
    ),
    (
        {"messages": [user_blocks(TEXT_A, url_image("file:///etc/passwd"))]},
        "messages.0.user.content",
        "block 1 (source.url): an image URL must be a base64 data URL or an http(s) URL",
    ),
    (
        {"messages": [user_blocks({"type": "image"})]},
        "messages.0.user.content",
        "block 0: an image block needs a source object",
    ),
    (
        {"messages": [user_blocks({"type": "image", "source": {"type": "path"}})]},
        "messages.0.user.content",
        "block 0: an image source's type is base64 or url, not 'path'",
    ),
    (
        {"messages": [user_blocks({"type": "image", "source": {"type": "file", "file_id": "f"}})]},
        "messages.0.user.content",
        "block 0: image sources of type 'file' are not supported",
    ),
    (
        {"messages": [USER, {"role": "assistant", "content": [image_block(PNG_B64)]}, USER]},
        "messages.1.assistant.content",
        "image content blocks are accepted in user messages and tool results only",
    ),
    (
        {"system": [image_block(PNG_B64)]},
        "system",
        "image content blocks are accepted in user messages and tool results only",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "messages.0.user.content",
        "document",
    ),
    (
        {"messages": [user_blocks(tool_result([TEXT_A, image_block("")]))]},
        "messages.0.user.content",
        "block 0 (tool_result) block 1 (source.data): the image is empty",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
                USER,
            ]
        },
        "messages.0.assistant.content",
        "'tool_result'",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "server tools"),
    ({"tools": [READ_TOOL, READ_TOOL]}, "tools", "distinct"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    (
        {"tools": [READ_TOOL], "tool_choice": {"type": "tool", "name": "write"}},
        "tool_choice",
        "'write'",
    ),
    (
        {
            "messages": [
                USER,
                {"role": "system", "content": [{"type": "tool_addition", "tool": {}}]},
            ]
        },
        "messages.1.system.content",
        "mid-conversation tool changes",
    ),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", "MCP"),
    ({"container": "c1"}, "container", "containers"),
    ({"frobnicate": 1}, "frobnicate", "Extra inputs"),
]


@pytest.mark.parametrize(("fields", "location", "message"), REJECTED)
def test_rejections_name_the_field(fields: dict[str, Any], location: str, message: str) -> None:
    assert_rejected(MessagesRequest, BASE | fields, location, message)


# ---- replies ----

USAGE = Usage(prompt_tokens=1000, completion_tokens=7, cached_tokens=900)
WIRE_USAGE = {
    "input_tokens": 0,
    "output_tokens": 7,
    "cache_creation_input_tokens": 100,
    "cache_read_input_tokens": 900,
}
CALL = ToolCall(id="call_1", name="read", arguments='{"path": "a"}')


def finished(
    reason: Any = "stop", stop_sequence: str | None = None, calls: tuple[ToolCall, ...] = ()
) -> ReplyFinished:
    return ReplyFinished(
        finish_reason=reason, stop_sequence=stop_sequence, usage=USAGE, tool_calls=calls
    )


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for chunk in text.split("\n\n"):
        if not chunk:
            continue
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        events.append(payload)
    return events


async def streamed(
    events: Sequence[ReplyEvent], show_thinking: bool = True
) -> list[dict[str, Any]]:
    return parse_sse(
        "".join([sse async for sse in message_stream(scripted(events), show_thinking)])
    )


STREAM_EVENTS = TypeAdapter[anthropic.types.RawMessageStreamEvent](
    anthropic.types.RawMessageStreamEvent
)


def accumulated(events: list[dict[str, Any]]) -> anthropic.types.Message:
    """What the official client builds from the stream."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for payload in events:
        snapshot = accumulate_event(
            event=STREAM_EVENTS.validate_python(payload),
            current_snapshot=snapshot,
            json_bufs=buffers,
        )
    assert snapshot is not None
    return snapshot


def start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": fields}


def stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def end(reason: str, stop_sequence: str | None = None) -> list[dict[str, Any]]:
    return [
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
            "usage": WIRE_USAGE,
        },
        {"type": "message_stop"},
    ]


SIGNED = reasoning_signature("Think.")
STREAMS: list[tuple[str, list[ReplyEvent], list[dict[str, Any]]]] = [
    (
        "text only",
        [TextPiece(text="Hel"), TextPiece(text="lo"), finished()],
        [
            start(0, {"type": "text", "text": ""}),
            delta(0, type="text_delta", text="Hel"),
            delta(0, type="text_delta", text="lo"),
            stop(0),
            *end("end_turn"),
        ],
    ),
    (
        "tool_use: the call goes out whole when it ends",
        [
            TextPiece(text="Reading."),
            ToolCallStart(index=0, id="call_1", name="read"),
            ToolCallArgumentsPiece(index=0, text='{"path": '),
            ToolCallArgumentsPiece(index=0, text='"a"}'),
            ToolCallEnd(index=0, call=CALL),
            finished("tool_calls", calls=(CALL,)),
        ],
        [
            start(0, {"type": "text", "text": ""}),
            delta(0, type="text_delta", text="Reading."),
            stop(0),
            start(1, {"type": "tool_use", "id": "call_1", "name": "read", "input": {}}),
            delta(1, type="input_json_delta", partial_json='{"path": "a"}'),
            stop(1),
            *end("tool_use"),
        ],
    ),
    (
        "thinking then text",
        [ReasoningPiece(text="Thi"), ReasoningPiece(text="nk."), TextPiece(text="Hi"), finished()],
        [
            start(0, {"type": "thinking", "thinking": "", "signature": ""}),
            delta(0, type="thinking_delta", thinking="Thi"),
            delta(0, type="thinking_delta", thinking="nk."),
            delta(0, type="signature_delta", signature=SIGNED),
            stop(0),
            start(1, {"type": "text", "text": ""}),
            delta(1, type="text_delta", text="Hi"),
            stop(1),
            *end("end_turn"),
        ],
    ),
    (
        "max_tokens, after an abandoned call came back as text",
        [
            ToolCallStart(index=0, id="call_1", name="read"),
            ToolCallAbandoned(index=0),
            TextPiece(text='<tool_call>{"name": "read"'),
            finished("length"),
        ],
        [
            start(0, {"type": "text", "text": ""}),
            delta(0, type="text_delta", text='<tool_call>{"name": "read"'),
            stop(0),
            *end("max_tokens"),
        ],
    ),
    (
        "stop_sequence",
        [TextPiece(text="1 2 3"), finished("stop_sequence", stop_sequence="4")],
        [
            start(0, {"type": "text", "text": ""}),
            delta(0, type="text_delta", text="1 2 3"),
            stop(0),
            *end("stop_sequence", "4"),
        ],
    ),
]

MESSAGE_START = {
    "type": "message_start",
    "message": {
        "type": "message",
        "role": "assistant",
        "model": "served/model",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 1000,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    },
}


@pytest.mark.parametrize(
    ("events", "want"), [case[1:] for case in STREAMS], ids=[case[0] for case in STREAMS]
)
async def test_stream_events(events: list[ReplyEvent], want: list[dict[str, Any]]) -> None:
    got = await streamed(events)
    started = got[0]["message"]
    assert started["id"].startswith("msg_")
    without_id = {
        "type": "message_start",
        "message": {k: v for k, v in started.items() if k != "id"},
    }
    assert [without_id, *got[1:]] == [MESSAGE_START, *want]
    # the official client builds the same message from the stream as the non-streaming answer
    message = await message_response(scripted(events), show_thinking=True)
    assert accumulated(got).model_dump(exclude_none=True) | {
        "id": message["id"]
    } == anthropic.types.Message.model_validate(message).model_dump(exclude_none=True)


async def test_whole_message() -> None:
    events = [
        ReasoningPiece(text="Think."),
        TextPiece(text="Reading."),
        ToolCallEnd(index=0, call=CALL),
        finished("tool_calls", calls=(CALL,)),
    ]
    message = await message_response(scripted(events), show_thinking=True)
    assert anthropic.types.Message.model_validate(message).model_dump(exclude_none=True) == {
        "id": message["id"],
        "type": "message",
        "role": "assistant",
        "model": "served/model",
        "content": [
            {"type": "thinking", "thinking": "Think.", "signature": SIGNED},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "call_1", "name": "read", "input": {"path": "a"}},
        ],
        "stop_reason": "tool_use",
        "usage": WIRE_USAGE,
    }


async def test_omitted_thinking_rides_in_the_signature_and_round_trips() -> None:
    events = [ReasoningPiece(text="Secret plan."), TextPiece(text="Done."), finished()]
    got = await streamed(events, show_thinking=False)
    assert not [e for e in got if e.get("delta", {}).get("type") == "thinking_delta"]
    message = accumulated(got)
    thinking = message.content[0]
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == ""
    # the client sends the message back as it got it: the reasoning is rendered again
    history = [
        USER,
        {
            "role": "assistant",
            "content": [block.model_dump(exclude_none=True) for block in message.content],
        },
        USER,
    ]
    turns = chat_request(messages=history).turns
    assert turns[1] == ChatTurn(role="assistant", content="Done.", reasoning="Secret plan.")


async def test_an_error_during_the_run_ends_the_stream_with_an_error_event() -> None:
    failure = APIError(503, "the model runner is unavailable", "server_error")
    sse = "".join(
        [s async for s in message_stream(scripted([TextPiece(text="Hi")], failure), True)]
    )
    events = parse_sse(sse)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert ErrorResponse.model_validate(events[-1]).error.type == "overloaded_error"


async def test_a_reply_that_never_finishes_is_an_error() -> None:
    with pytest.raises(APIError):
        await message_response(scripted([TextPiece(text="Hi")]), True)


def test_assembler_ignores_logprobs_and_empty_pieces() -> None:
    assembler = MessageAssembler("msg_1", "m", 3, show_thinking=True)
    assert assembler.feed(TextPiece(text="")) == []
    assert assembler.feed(ReasoningPiece(text="")) == []


def test_ping() -> None:
    assert parse_sse(PING_EVENT) == [{"type": "ping"}]


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_bodies(status: int, kind: str) -> None:
    body = anthropic_error_body(status, "why")
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert anthropic_error_type(status) == kind
    if kind != "request_too_large":  # documented by Anthropic, not modelled by the client
        assert ErrorResponse.model_validate(body).error.message == "why"
