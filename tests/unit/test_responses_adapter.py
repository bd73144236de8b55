"""The Responses API adapter: every request field is honoured, rejected with a
400 naming it, or accepted and ignored from a documented list; requests
translate into the internal ChatRequest; reply events come out as the numbered
event stream and the response object the official `openai` client reads."""

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai.types.responses as wire
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState  # pyright: ignore[reportPrivateUsage]
from openai.types.responses import response_create_params
from pydantic import TypeAdapter

from exo.api.errors import APIError
from exo.api.generation import reasoning_tokens
from exo.api.reply_stream import ReplyEvent, ReplyFinished
from exo.api.responses import response_object, response_stream, to_chat_request
from exo.api.responses_types import (
    HONOURED_RESPONSES_FIELDS,
    IGNORED_RESPONSES_FIELDS,
    REJECTED_RESPONSES_FIELDS,
    ResponsesRequest,
)
from exo.engine.reasoning import ReasoningPiece, detect_thinking_markers
from exo.engine.tool_calls.parser import (
    TextPiece,
    ToolCallAbandoned,
    ToolCallArgumentsPiece,
    ToolCallEnd,
    ToolCallStart,
)
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.shared.types.chat import (
    ChatImage,
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    Sampling,
    ToolCall,
    ToolFunction,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.tasks import Usage
from tests.unit.api_adapters import assert_fields_classified, assert_rejected, scripted

BASE: dict[str, Any] = {"model": "m", "input": "Hi"}
HI = ChatTurn(role="user", content="Hi")
READ_TOOL = {
    "type": "function",
    "name": "read",
    "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    "strict": True,
}
READ = ToolFunction(
    name="read",
    description="Read a file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    strict=True,
)


def expected(**fields: Any) -> ChatRequest:
    return ChatRequest(**({"model": ModelId("m"), "turns": (HI,)} | fields))


PNG_BYTES = b"\x89PNG\r\n\x1a\n a picture"  # the adapter decodes; it does not read pixels
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()
HI_ITEM = {"role": "user", "content": "Hi"}
TEXT_A = {"type": "input_text", "text": "a"}


def image_part(url: str, detail: str = "auto") -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": detail}


def user_images(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def test_input_images_keep_their_place_among_the_text() -> None:
    content = [
        image_part(PNG_URL, "high"),
        {"type": "input_text", "text": "What differs between "},
        image_part("https://example.com/a.png", "low"),
        {"type": "input_text", "text": "and this?"},
        image_part(PNG_URL),
    ]
    request = to_chat_request(
        ResponsesRequest.model_validate(BASE | {"input": [user_images(*content)]})
    )
    assert request.turns == (
        ChatTurn(
            role="user",
            content="What differs between and this?",
            images=(
                ChatImage(offset=0, data=PNG_BYTES),
                ChatImage(offset=21, url="https://example.com/a.png"),
                ChatImage(offset=30, data=PNG_BYTES),
            ),
        ),
    )


def test_every_field_of_the_responses_request_is_classified() -> None:
    assert_fields_classified(
        ResponsesRequest,
        HONOURED_RESPONSES_FIELDS,
        IGNORED_RESPONSES_FIELDS,
        set(REJECTED_RESPONSES_FIELDS),
    )
    official = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert official <= set(ResponsesRequest.model_fields)


CALL = ToolCall(id="call_1", name="read", arguments='{"path":"a"}')
TRANSLATIONS: list[tuple[str, dict[str, Any], ChatRequest]] = [
    ("a string input", {}, expected()),
    (
        "instructions",
        {"instructions": "Be brief."},
        expected(turns=(ChatTurn(role="system", content="Be brief."), HI)),
    ),
    (
        "message items with text parts; developer is a system turn",
        {
            "input": [
                {"role": "developer", "content": "Rules."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Hi"},
                        {"type": "input_text", "text": "!"},
                    ],
                },
            ]
        },
        expected(
            turns=(ChatTurn(role="system", content="Rules."), ChatTurn(role="user", content="Hi!"))
        ),
    ),
    (
        "a reply's reasoning, text and call make one turn; the output is a tool turn",
        {
            "tools": [READ_TOOL],
            "input": [
                {"role": "user", "content": "Hi"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Read it."}],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Reading.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "read",
                    "arguments": '{"path":"a"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "text of a"},
                {"role": "user", "content": "Thanks"},
            ],
        },
        expected(
            tools=(READ,),
            turns=(
                HI,
                ChatTurn(
                    role="assistant", content="Reading.", tool_calls=(CALL,), reasoning="Read it."
                ),
                ChatTurn(role="tool", content="text of a", tool_call_id="call_1", name="read"),
                ChatTurn(role="user", content="Thanks"),
            ),
        ),
    ),
    (
        "tool_choice required, no parallel calls",
        {"tools": [READ_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
        expected(tools=(READ,), tool_choice="required", parallel_tool_calls=False),
    ),
    (
        "tool_choice a function",
        {"tools": [READ_TOOL], "tool_choice": {"type": "function", "name": "read"}},
        expected(tools=(READ,), tool_choice=NamedToolChoice(name="read")),
    ),
    (
        "text.format json_schema",
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "out",
                    "description": "ignored: the schema is not shown to the model",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            }
        },
        expected(response_format=JsonSchemaFormat(name="out", json_schema={"type": "object"})),
    ),
    (
        "text.format json_object",
        {"text": {"format": {"type": "json_object"}}},
        expected(response_format=JsonObjectFormat()),
    ),
    (
        "limits, sampling, reasoning effort",
        {
            "max_output_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.5,
            "reasoning": {"effort": "low", "summary": "auto"},
            "stream": True,
        },
        expected(
            max_tokens=50,
            sampling=Sampling(temperature=0.2, top_p=0.5),
            reasoning_effort="low",
            stream=True,
        ),
    ),
    (
        "store and include are accepted; nothing is stored",
        {
            "store": True,
            "include": ["reasoning.encrypted_content"],
            "metadata": {"a": "b"},
            "truncation": "disabled",
        },
        expected(),
    ),
]


@pytest.mark.parametrize(
    ("fields", "want"), [c[1:] for c in TRANSLATIONS], ids=[c[0] for c in TRANSLATIONS]
)
def test_translation(fields: dict[str, Any], want: ChatRequest) -> None:
    assert to_chat_request(ResponsesRequest.model_validate(BASE | fields)) == want


REJECTED: list[tuple[dict[str, Any], str, str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"background": True}, "background", "not supported"),
    ({"top_logprobs": 3}, "top_logprobs", "chat completions"),
    ({"truncation": "auto"}, "truncation", "'disabled'"),
    ({"input": []}, "input", "at least one"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' input items"),
    (
        {"input": [user_images({"type": "input_image", "image_url": "x"})]},
        "input",
        "item 0 part 0 (image_url): an image URL must be a base64 data URL or an http(s) URL",
    ),
    (
        {"input": [HI_ITEM, user_images(TEXT_A, image_part("data:image/png;base64,@@"))]},
        "input",
        "item 1 part 1 (image_url): the image is not valid base64",
    ),
    (
        {"input": [user_images({"type": "input_image", "file_id": "file-1", "detail": "auto"})]},
        "input",
        "item 0 part 0: file_id is not supported: exo stores no files",
    ),
    (
        {"input": [user_images({"type": "input_image", "image_url": {"url": PNG_URL}})]},
        "input",
        "item 0 part 0: image_url is a string",
    ),
    (
        {"input": [user_images({"type": "input_image", "detail": "auto"})]},
        "input",
        "item 0 part 0: an input_image needs image_url",
    ),
    (
        {"input": [{**user_images(image_part(PNG_URL)), "role": "developer"}]},
        "input",
        "'input_image' content is accepted in user messages only",
    ),
    (
        {
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [image_part(PNG_URL)],
                }
            ]
        },
        "input",
        "'input_image' content is accepted in user messages only",
    ),
    (
        {"input": [user_images({"type": "input_file", "file_id": "file-1"})]},
        "input",
        "'input_file' content is not supported: exo reads text and images",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "not supported"),
    (
        {"tools": [READ_TOOL], "tool_choice": {"type": "function", "name": "write"}},
        "tool_choice",
        "'write'",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"frobnicate": 1}, "frobnicate", "Extra inputs"),
]


@pytest.mark.parametrize(("fields", "location", "message"), REJECTED)
def test_rejections_name_the_field(fields: dict[str, Any], location: str, message: str) -> None:
    assert_rejected(ResponsesRequest, BASE | fields, location, message)


# ---- replies ----

USAGE = Usage(prompt_tokens=1000, completion_tokens=7, cached_tokens=900)
WIRE_USAGE = {
    "input_tokens": 1000,
    "input_tokens_details": {"cached_tokens": 900, "cache_write_tokens": 100},
    "output_tokens": 7,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 1007,
}


def finished(reason: Any = "stop") -> ReplyFinished:
    return ReplyFinished(finish_reason=reason, usage=USAGE)


STREAM_EVENT = TypeAdapter[wire.ResponseStreamEvent](wire.ResponseStreamEvent)


async def streamed(
    events: Sequence[ReplyEvent], body: dict[str, Any] = BASE, error: APIError | None = None
) -> list[dict[str, Any]]:
    request = ResponsesRequest.model_validate(body)
    text = "".join([sse async for sse in response_stream(scripted(events, error), request)])
    payloads = []
    state = ResponseStreamState[Any](input_tools=omit, text_format=omit)
    for chunk in filter(None, text.split("\n\n")):
        name, data = chunk.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        state.handle_event(STREAM_EVENT.validate_python(payload))  # the official client reads it
        payloads.append(payload)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    return payloads


def shape(payloads: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Each event's type with its delta, text or item type: the sequence a client sees."""
    return [
        (
            p["type"],
            p.get("delta")
            or p.get("text")
            or p.get("arguments")
            or (p.get("item") or p.get("part") or {}).get("type"),
        )
        for p in payloads
    ]


STREAMS: list[tuple[str, list[ReplyEvent], list[tuple[str, Any]]]] = [
    (
        "text",
        [TextPiece(text="Hel"), TextPiece(text="lo"), finished()],
        [
            ("response.output_item.added", "message"),
            ("response.content_part.added", "output_text"),
            ("response.output_text.delta", "Hel"),
            ("response.output_text.delta", "lo"),
            ("response.output_text.done", "Hello"),
            ("response.content_part.done", "output_text"),
            ("response.output_item.done", "message"),
            ("response.completed", None),
        ],
    ),
    (
        "reasoning, then a function call that goes out whole when it ends",
        [
            ReasoningPiece(text="Read it."),
            ToolCallStart(index=0, id="call_1", name="read"),
            ToolCallArgumentsPiece(index=0, text='{"path":"a"}'),
            ToolCallEnd(index=0, call=CALL),
            finished("tool_calls"),
        ],
        [
            ("response.output_item.added", "reasoning"),
            ("response.content_part.added", "reasoning_text"),
            ("response.reasoning_text.delta", "Read it."),
            ("response.reasoning_text.done", "Read it."),
            ("response.content_part.done", "reasoning_text"),
            ("response.output_item.done", "reasoning"),
            ("response.output_item.added", "function_call"),
            ("response.function_call_arguments.delta", '{"path":"a"}'),
            ("response.function_call_arguments.done", '{"path":"a"}'),
            ("response.output_item.done", "function_call"),
            ("response.completed", None),
        ],
    ),
    (
        "cut by max_output_tokens after an abandoned call",
        [
            ToolCallStart(index=0, id="call_1", name="read"),
            ToolCallAbandoned(index=0),
            TextPiece(text="<tool"),
            finished("length"),
        ],
        [
            ("response.output_item.added", "message"),
            ("response.content_part.added", "output_text"),
            ("response.output_text.delta", "<tool"),
            ("response.output_text.done", "<tool"),
            ("response.content_part.done", "output_text"),
            ("response.output_item.done", "message"),
            ("response.incomplete", None),
        ],
    ),
]


@pytest.mark.parametrize(("events", "want"), [c[1:] for c in STREAMS], ids=[c[0] for c in STREAMS])
async def test_stream_events(events: list[ReplyEvent], want: list[tuple[str, Any]]) -> None:
    payloads = await streamed(events)
    assert shape(payloads) == [("response.created", None), ("response.in_progress", None), *want]
    created = payloads[0]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    final = wire.Response.model_validate(payloads[-1]["response"])
    assert final.usage is not None and final.usage.model_dump(exclude_none=True) == WIRE_USAGE
    # the streamed response is the non-streaming one (up to its ids)
    whole = await response_object(scripted(events), ResponsesRequest.model_validate(BASE))
    strip = {"id": True, "output": {"__all__": {"id"}}}
    assert wire.Response.model_validate(whole).model_dump(exclude=strip) == final.model_dump(
        exclude=strip
    )


async def test_whole_response() -> None:
    body = BASE | {"tools": [READ_TOOL], "instructions": "Be brief.", "max_output_tokens": 64}
    events = [
        ReasoningPiece(text="Hmm."),
        TextPiece(text="Reading."),
        ToolCallEnd(index=0, call=CALL),
        finished("tool_calls"),
    ]
    response = wire.Response.model_validate(
        await response_object(scripted(events), ResponsesRequest.model_validate(body))
    )
    assert response.id.startswith("resp_")
    assert (response.status, response.model, response.created_at) == (
        "completed",
        "served/model",
        1700000000,
    )
    assert (response.instructions, response.max_output_tokens, response.tool_choice) == (
        "Be brief.",
        64,
        "auto",
    )
    assert [tool.model_dump(exclude_none=True) for tool in response.tools] == [READ_TOOL]
    reasoning, message, call = response.output
    assert isinstance(reasoning, wire.ResponseReasoningItem) and reasoning.content
    assert reasoning.content[0].text == "Hmm."
    assert isinstance(message, wire.ResponseOutputMessage) and response.output_text == "Reading."
    assert isinstance(call, wire.ResponseFunctionToolCall)
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_1",
        "read",
        '{"path":"a"}',
        "completed",
    )


async def test_usage_counts_the_reasoning_tokens() -> None:
    done = ReplyFinished(finish_reason="stop", usage=USAGE, reasoning_tokens=4)
    events: list[ReplyEvent] = [ReasoningPiece(text="Think."), TextPiece(text="Hi"), done]
    whole = wire.Response.model_validate(
        await response_object(scripted(events), ResponsesRequest.model_validate(BASE))
    )
    final = wire.Response.model_validate((await streamed(events))[-1]["response"])
    for response in (whole, final):
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == 4
        assert response.usage.output_tokens == 7


@pytest.mark.parametrize(
    ("output", "thinking", "counted"),
    [
        (
            "<think>\nOne two three.\n</think>\n\nFour five six seven eight.",
            True,
            "<think>\nOne two three.\n</think>",
        ),
        # the prompt opened the thinking: the output starts inside it
        ("One two three.\n</think>\n\nFour five.", True, "One two three.\n</think>"),
        # cut off while thinking: all of it
        ("<think>\nOne two three", True, "<think>\nOne two three"),
        ("Four five.", False, ""),
    ],
)
def test_reasoning_tokens_are_the_output_up_to_the_thinkings_end(
    smollm_dir: Path, output: str, thinking: bool, counted: str
) -> None:
    tokenizer = load_chat_tokenizer(smollm_dir)
    markers = detect_thinking_markers("</think>") if thinking else None
    want = len(tokenizer.encode(counted, add_special_tokens=False))
    assert reasoning_tokens(tokenizer, markers, output, 100) == want
    assert reasoning_tokens(tokenizer, markers, output, 2) == min(want, 2)


async def test_an_incomplete_response_says_why() -> None:
    response = wire.Response.model_validate(
        await response_object(
            scripted([TextPiece(text="a"), finished("length")]),
            ResponsesRequest.model_validate(BASE),
        )
    )
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None
        and response.incomplete_details.reason == "max_output_tokens"
    )


async def test_an_error_during_the_run_ends_the_stream_with_response_failed() -> None:
    failure = APIError(500, "generation failed: boom", "server_error")
    payloads = await streamed([TextPiece(text="Hi")], error=failure)
    assert [p["type"] for p in payloads][-3:] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    failed = wire.Response.model_validate(payloads[-1]["response"])
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.message == "generation failed: boom"


async def test_a_reply_that_never_finishes_is_an_error() -> None:
    with pytest.raises(APIError):
        await response_object(
            scripted([TextPiece(text="Hi")]), ResponsesRequest.model_validate(BASE)
        )
