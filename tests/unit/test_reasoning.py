"""The reasoning split: thinking markers from real templates, where the output
starts, and the streaming split of thinking from the answer."""

import pytest

from exo.engine.reasoning import (
    ContentPiece,
    ReasoningEvent,
    ReasoningPiece,
    ReasoningSplitter,
    ThinkingMarkers,
    detect_thinking_markers,
    prompt_opens_thinking,
)
from tests.chat_templates import chat_template, render

THINK = ThinkingMarkers(start="<think>", end="</think>")


@pytest.mark.parametrize(
    ("template", "markers"),
    [
        ("Qwen-Qwen3-0.6B", THINK),
        ("Qwen-QwQ-32B", THINK),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", THINK),
        ("Qwen-Qwen2.5-7B-Instruct", None),
        ("meta-llama-Llama-3.2-3B-Instruct", None),
        ("mistralai-Mistral-Nemo-Instruct-2407", None),
        ("HuggingFaceTB-SmolLM2-135M-Instruct", None),
    ],
)
def test_detects_thinking_markers(template: str, markers: ThinkingMarkers | None) -> None:
    assert detect_thinking_markers(chat_template(template)) == markers


@pytest.mark.parametrize(
    ("template", "kwargs", "opens"),
    [
        # QwQ and R1 open the thinking in the generation prompt
        ("Qwen-QwQ-32B", {}, True),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}, True),
        # Qwen3 lets the model open it; with thinking off it writes an empty block
        ("Qwen-Qwen3-0.6B", {}, False),
        ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, False),
    ],
)
def test_the_rendered_prompt_says_where_the_output_starts(
    template: str, kwargs: dict[str, bool], opens: bool
) -> None:
    prompt = render(
        template,
        [{"role": "user", "content": "2+2?"}],
        add_generation_prompt=True,
        template_kwargs=kwargs,
    )
    assert prompt_opens_thinking(prompt, THINK) is opens


def split(starts_inside: bool, deltas: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, starts_inside)
    events: list[ReasoningEvent] = []
    for delta in deltas:
        events.extend(splitter.feed(delta))
    events.extend(splitter.finish())
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningPiece)),
        "".join(e.text for e in events if isinstance(e, ContentPiece)),
    )


@pytest.mark.parametrize(
    ("starts_inside", "output", "reasoning", "content"),
    [
        # Qwen3: the model opens and closes the thinking itself
        (False, "<think>\nAdd them.\n</think>\n\nIt is 4.", "Add them.", "It is 4."),
        (False, "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
        # the prompt opened it: the output starts inside
        (
            True,
            "Add them.\nTwo and two.\n</think>\n\nIt is 4.",
            "Add them.\nTwo and two.",
            "It is 4.",
        ),
        # ...and a model that writes the opening marker again anyway
        (True, "<think>\nAdd them.\n</think>\nIt is 4.", "Add them.", "It is 4."),
        # no thinking at all: everything is the answer, exactly as written
        (False, "  It is 4.\n", "", "  It is 4.\n"),
        # cut off while thinking: all reasoning, no answer
        (True, "Add them and", "Add them and", ""),
        (False, "<think>Add them</th", "Add them", ""),
        # markers after the start are the answer's text
        (False, "Use <think> tags.</think>", "", "Use <think> tags.</think>"),
        (True, "Done.</think>Write </think> and <think>.", "Done.", "Write </think> and <think>."),
        # an answer that only looks like the start marker's beginning
        (False, "<thin ice>", "", "<thin ice>"),
        # the answer holds a tool call, passed on untouched
        (
            False,
            '<think>\nNeed weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
            "Need weather.",
            '<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
        ),
    ],
)
def test_splits_thinking_from_the_answer_however_it_is_chunked(
    starts_inside: bool, output: str, reasoning: str, content: str
) -> None:
    chunkings = [[output], list(output)] + [
        [output[i : i + n] for i in range(0, len(output), n)] for n in (2, 3, 7)
    ]
    for deltas in chunkings:
        assert split(starts_inside, deltas) == (reasoning, content), deltas


@pytest.mark.parametrize(
    ("starts_inside", "deltas", "per_feed"),
    [
        (  # pieces go out as they come; a partial end marker and the newline before it wait
            True,
            ["Add", " them", "\n</th", "ink>\n\n", "It", " is 4."],
            [
                [ReasoningPiece(text="Add")],
                [ReasoningPiece(text=" them")],
                [],
                [],
                [ContentPiece(text="It")],
                [ContentPiece(text=" is 4.")],
            ],
        ),
        (  # the start marker arriving in pieces is held, then swallowed
            False,
            ["<th", "ink>", "\nHm", "m</think>", "Yes"],
            [
                [],
                [],
                [ReasoningPiece(text="Hm")],
                [ReasoningPiece(text="m")],
                [ContentPiece(text="Yes")],
            ],
        ),
        (  # no thinking: the answer streams from the first character that cannot open it
            False,
            ["<", "b>bold"],
            [[], [ContentPiece(text="<b>bold")]],
        ),
    ],
)
def test_events_per_feed(
    starts_inside: bool, deltas: list[str], per_feed: list[list[ReasoningEvent]]
) -> None:
    splitter = ReasoningSplitter(THINK, starts_inside)
    assert [splitter.feed(delta) for delta in deltas] == per_feed
    assert splitter.finish() == []
