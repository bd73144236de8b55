"""ReplyParser: the reasoning split and the tool-call parser in one stream,
set up from real templates and their rendered prompts."""

import pytest

from exo.engine.reasoning import ReasoningPiece
from exo.engine.reply import ReplyEvent, ReplyParser
from exo.engine.tool_calls.formats import detect_tool_format
from exo.engine.tool_calls.parser import TextPiece, ToolCallEnd, ToolCallStart
from tests.chat_templates import chat_template, render

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def read(template: str, tools: bool, output: str) -> tuple[str, str, list[tuple[str, str]]]:
    prompt = render(template, [{"role": "user", "content": "Weather?"}], add_generation_prompt=True)
    fmt = detect_tool_format(chat_template(template)) if tools else None
    parser = ReplyParser.for_prompt(chat_template(template), prompt, fmt)
    events: list[ReplyEvent] = []
    for char in output:
        events.extend(parser.feed(char))
    events.extend(parser.finish())
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.index for s in starts] == [e.index for e in ends]
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningPiece)),
        "".join(e.text for e in events if isinstance(e, TextPiece)),
        [(e.call.name, e.call.arguments) for e in ends],
    )


@pytest.mark.parametrize(
    ("template", "tools", "output", "expected"),
    [
        (  # Qwen3 opens the thinking itself, then answers with text and a call
            "Qwen-Qwen3-0.6B",
            True,
            f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n{CALL}",
            ("The user wants weather.", "Let me check.", [("get_weather", '{"city": "Paris"}')]),
        ),
        (  # QwQ's prompt opened the thinking: the output starts inside it
            "Qwen-QwQ-32B",
            True,
            f"Weather, so call.\n</think>\n\n{CALL}",
            ("Weather, so call.", "", [("get_weather", '{"city": "Paris"}')]),
        ),
        (  # no tools offered: a call-looking answer is the answer's text
            "Qwen-Qwen3-0.6B",
            False,
            f"<think>\nHm.\n</think>\n\n{CALL}",
            ("Hm.", CALL, []),
        ),
        (  # a model that does not think: everything is the answer
            "Qwen-Qwen2.5-7B-Instruct",
            True,
            f"<think>not a marker here</think> {CALL}",
            ("", "<think>not a marker here</think>", [("get_weather", '{"city": "Paris"}')]),
        ),
    ],
)
def test_reads_reasoning_text_and_calls(
    template: str, tools: bool, output: str, expected: tuple[str, str, list[tuple[str, str]]]
) -> None:
    assert read(template, tools, output) == expected
