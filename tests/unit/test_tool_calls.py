"""Tool-call formats, the streaming parser and the fallback prompt, on real
chat templates and on the awkward things models write."""

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from exo.engine.reasoning import (
    ContentPiece,
    ReasoningPiece,
    ReasoningSplitter,
    detect_thinking_markers,
    prompt_opens_thinking,
)
from exo.engine.tool_calls.fallback import (
    fallback_chat_turns,
    render_fallback_assistant,
    render_fallback_system_prompt,
)
from exo.engine.tool_calls.formats import (
    FALLBACK_FORMAT,
    HERMES_FORMAT,
    LLAMA3_FORMAT,
    MISTRAL_ARGS_FORMAT,
    MISTRAL_FORMAT,
    ToolCallFamily,
    ToolCallFormat,
    detect_tool_format,
    render_tool_calls,
)
from exo.engine.tool_calls.parser import (
    TextPiece,
    ToolCallAbandoned,
    ToolCallArgumentsPiece,
    ToolCallEnd,
    ToolCallEvent,
    ToolCallParser,
    ToolCallStart,
    parse_tool_calls,
)
from exo.shared.types.chat import ChatTurn, NamedToolChoice, ToolCall, ToolFunction
from tests.chat_templates import chat_template, render

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def fixed_ids() -> Iterator[str]:
    n = 0
    while True:
        yield f"id{n}"
        n += 1


def run(fmt: ToolCallFormat, deltas: list[str]) -> list[ToolCallEvent]:
    ids = fixed_ids()
    parser = ToolCallParser(fmt, new_call_id=lambda: next(ids))
    events: list[ToolCallEvent] = []
    for delta in deltas:
        events.extend(parser.feed(delta))
    return events + parser.finish()


def content_and_calls(events: list[ToolCallEvent]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(e.text for e in events if isinstance(e, TextPiece))
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallEnd)]
    return content, calls


def chunkings(text: str) -> list[list[str]]:
    """The same output delivered whole, a character at a time, and in odd chunks."""
    return [[text], list(text)] + [
        [text[i : i + n] for i in range(0, len(text), n)] for n in (2, 5)
    ]


# --- format detection ---------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "family", "prefix"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", ToolCallFamily.HERMES, "<tool_call>\n"),
        ("Qwen-Qwen3-0.6B", ToolCallFamily.HERMES, "<tool_call>\n"),
        ("Qwen-QwQ-32B", ToolCallFamily.HERMES, "<tool_call>\n"),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", ToolCallFamily.HERMES, "<tool_call>\n"),
        ("meta-llama-Llama-3.1-8B-Instruct", ToolCallFamily.LLAMA3, ""),
        ("meta-llama-Llama-3.2-3B-Instruct", ToolCallFamily.LLAMA3, ""),
        ("mistralai-Mistral-Nemo-Instruct-2407", ToolCallFamily.MISTRAL, "[TOOL_CALLS]"),
        ("Mistral-Small-3.2-24B-Instruct-2506", ToolCallFamily.MISTRAL, "[TOOL_CALLS]"),
        # templates without tools: exo's own format, taught by the system prompt
        ("HuggingFaceTB-SmolLM2-135M-Instruct", ToolCallFamily.FALLBACK, "<tool_call>\n"),
        ("google-gemma-2-2b-it", ToolCallFamily.FALLBACK, "<tool_call>\n"),
        # renders history calls, but takes no `tools`: it cannot be told what to call
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", ToolCallFamily.FALLBACK, "<tool_call>\n"),
    ],
)
def test_detects_the_format_from_the_template(
    template: str, family: ToolCallFamily, prefix: str
) -> None:
    fmt = detect_tool_format(chat_template(template))
    assert (fmt.family, fmt.prefix) == (family, prefix)
    assert fmt.in_template == (family != ToolCallFamily.FALLBACK)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (None, FALLBACK_FORMAT),
        (
            chat_template("Mistral-Small-3.2-24B-Instruct-2506"),
            MISTRAL_ARGS_FORMAT.model_copy(update={"id_marker": "[CALL_ID]"}),
        ),
        # Devstral's template writes no ids
        ('{{ "[TOOL_CALLS]" + name + "[ARGS]" }}{{ tools }}', MISTRAL_ARGS_FORMAT),
        ("", FALLBACK_FORMAT),
        # Mistral 7B v0.3 writes a space after the marker
        (
            '{{ "[TOOL_CALLS] [" }}{{ tools }}',
            MISTRAL_FORMAT.model_copy(update={"prefix": "[TOOL_CALLS] "}),
        ),
        # Qwen3-Coder's XML calls inside <tool_call>: not the Hermes JSON
        (
            "{% for t in tools %}{{ t }}{% endfor %}<tool_call>\n<function=f>\n<parameter=p>",
            FALLBACK_FORMAT,
        ),
        # a tool syntax exo cannot name: the fallback, which it can parse
        ("{% for t in tools %}<|function|>{{ t }}{% endfor %}", FALLBACK_FORMAT),
    ],
)
def test_detects_edge_templates(template: str | None, fmt: ToolCallFormat) -> None:
    assert detect_tool_format(template) == fmt


# --- real templates: a rendered call turn parses back, and renders back the same


Call = tuple[str, dict[str, Any], str]  # name, arguments, id


def call_message(content: str, calls: list[Call]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            for name, args, call_id in calls
        ],
    }


def tool_messages(calls: list[Call]) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": f"result of {name}"}
        for name, _, call_id in calls
    ]


PARIS: Call = ("get_weather", {"city": "Paris", "unit": "C"}, "abc123def")
BRACES: Call = ("read_file", {"path": 'src/{a}/"b".py'}, "xyz987uvw")


@pytest.mark.parametrize(
    ("template", "end_of_turn", "content", "reasoning", "calls"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", "<|im_end|>", "", None, [PARIS]),
        ("Qwen-Qwen2.5-7B-Instruct", "<|im_end|>", "Let me check.", None, [PARIS, BRACES]),
        ("Qwen-Qwen3-0.6B", "<|im_end|>", "", None, [PARIS]),
        (
            "Qwen-Qwen3-0.6B",
            "<|im_end|>",
            "Let me check.",
            "The user wants weather.",
            [PARIS, BRACES],
        ),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "<|im_end|>", "", None, [PARIS, BRACES]),
        ("meta-llama-Llama-3.1-8B-Instruct", "<|eot_id|>", "", None, [PARIS]),
        ("meta-llama-Llama-3.2-3B-Instruct", "<|eot_id|>", "", None, [BRACES]),
        ("mistralai-Mistral-Nemo-Instruct-2407", "</s>", "", None, [PARIS, BRACES]),
        ("Mistral-Small-3.2-24B-Instruct-2506", "</s>", "", None, [PARIS, BRACES]),
    ],
)
def test_a_rendered_call_turn_parses_back_and_renders_identically(
    template: str,
    end_of_turn: str,
    content: str,
    reasoning: str | None,
    calls: list[Call],
) -> None:
    """What the template renders for a call turn is what the model was trained
    to generate. Parsed as if generated and rendered again from the parsed
    result, the whole prompt (with the tool results and the next generation
    prompt) must be the same text: the cached prefix stays usable."""
    tools = [WEATHER, READ_FILE]
    question = [{"role": "user", "content": "Weather in Paris? And read the file."}]
    prompt = render(template, question, tools, add_generation_prompt=True)
    assistant = call_message(content, calls)
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    history = [*question, assistant, *tool_messages(calls)]
    full = render(template, history, tools, add_generation_prompt=True)
    assert full.startswith(prompt)
    generated = full[len(prompt) :].split(end_of_turn)[0]

    markers = detect_thinking_markers(chat_template(template))
    answer, thought = generated, ""
    if markers is not None:
        splitter = ReasoningSplitter(markers, prompt_opens_thinking(prompt, markers))
        pieces = [*splitter.feed(generated), *splitter.finish()]
        thought = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
        answer = "".join(p.text for p in pieces if isinstance(p, ContentPiece))
    fmt = detect_tool_format(chat_template(template))
    for deltas in chunkings(answer):
        events = run(fmt, deltas)
        assert content_and_calls(events)[0] == content
        streamed = [e.call for e in events if isinstance(e, ToolCallEnd)]
        assert [(c.name, json.loads(c.arguments)) for c in streamed] == [
            (n, a) for n, a, _ in calls
        ]
    assert thought == (reasoning or "")
    parsed = parse_tool_calls(fmt, answer).tool_calls

    # the API layer hands the template the calls as the client sends them back
    # (Mistral's templates write the ids: the ones the model wrote are kept)
    again = call_message(content, [(c.name, json.loads(c.arguments), c.id) for c in parsed])
    if thought:
        again["reasoning_content"] = thought
    rerendered = render(template, [*question, again, *tool_messages(calls)], tools, True)
    assert rerendered == full


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", HERMES_FORMAT),
        ("meta-llama-Llama-3.1-8B-Instruct", LLAMA3_FORMAT),
        ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL_FORMAT),
        (
            "Mistral-Small-3.2-24B-Instruct-2506",
            MISTRAL_ARGS_FORMAT.model_copy(update={"id_marker": "[CALL_ID]"}),
        ),
    ],
)
def test_canonical_rendering_is_what_the_template_renders(
    template: str, fmt: ToolCallFormat
) -> None:
    """`render_tool_calls` (what a grammar forces) writes exactly the template's call syntax."""
    calls: list[Call] = [PARIS] if fmt.family == ToolCallFamily.LLAMA3 else [PARIS, BRACES]
    question = [{"role": "user", "content": "Weather?"}]
    prompt = render(template, question, [WEATHER, READ_FILE], add_generation_prompt=True)
    full = render(template, [*question, call_message("", calls)], [WEATHER, READ_FILE])
    ours = [ToolCall(id=i, name=n, arguments=json.dumps(a)) for n, a, i in calls]
    assert full[len(prompt) :].startswith(render_tool_calls(fmt, ours))


# --- tricky outputs, every family ---------------------------------------------

HERMES_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (output, content, calls)
    ("Just text, no calls.", "Just text, no calls.", []),
    ("a <tool> tag and a < sign\n", "a <tool> tag and a < sign\n", []),
    (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (  # braces, brackets, quotes and escapes inside strings
        '<tool_call>{"name": "write", "arguments": {"code": "if (a) { b[\\"}\\"] = \'{\'; }\\\\", '
        '"n": [1, {"k": null}]}}</tool_call>',
        "",
        [("write", '{"code": "if (a) { b[\\"}\\"] = \'{\'; }\\\\", "n": [1, {"k": null}]}')],
    ),
    (  # arguments as a JSON string: normalised to the object's text
        '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": \\"y\\"}"}\n</tool_call>',
        "",
        [("a", '{"x": "y"}')],
    ),
    (  # no arguments at all: an empty object
        '<tool_call>\n{"name": "now"}\n</tool_call>',
        "",
        [("now", "{}")],
    ),
    (  # text after a call
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone.',
        "Done.",
        [("a", "{}")],
    ),
    (  # a missing closing tag at the end is forgiven: the JSON is whole
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n',
        "",
        [("a", '{"x": 1}')],
    ),
    # malformed calls come back as the text the model wrote
    (
        'Hi <tool_call>\n{"name": "a", "arguments": {"x": ',
        'Hi <tool_call>\n{"name": "a", "arguments": {"x": ',
        [],
    ),
    (
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    (
        '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
        [],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',
        [],
    ),
    (  # one bad call does not spoil the good one after it
        '<tool_call>{"name": 1}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 1}</tool_call>',
        [("b", "{}")],
    ),
]

LLAMA3_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("The answer is 4.", "The answer is 4.", []),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '\n<|python_tag|>{"name": "a", "parameters": {"q": "} {"}}',
        "",
        [("a", '{"q": "} {"}')],
    ),
    (  # text before a call: only the python tag opens one mid-reply
        'Sure.<|python_tag|>{"name": "a", "parameters": {}}',
        "Sure.",
        [("a", "{}")],
    ),
    (
        'Here is JSON: {"name": "a", "parameters": {}}',
        'Here is JSON: {"name": "a", "parameters": {}}',
        [],
    ),
    (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "\\"q\\""}}',
        "",
        [("a", '{"x": 1}'), ("b", '{"y": "\\"q\\""}')],
    ),
    (
        '{"name": "a", "parameters": "{\\"x\\": 1}"}',
        "",
        [("a", '{"x": 1}')],
    ),
    # a JSON reply that is not a call stays text
    ('{"answer": 42}', '{"answer": 42}', []),
    (
        '{"name": "a", "parameters": {"x": "trunc',
        '{"name": "a", "parameters": {"x": "trunc',
        [],
    ),
]

MISTRAL_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Bonjour.", "Bonjour.", []),
    (
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": "[1]"}, "id": "abc123def"}, '
        '{"name": "b", "arguments": "{\\"y\\": 2}", "id": "zzz999zzz"}]',
        "",
        [("a", '{"x": "[1]"}'), ("b", '{"y": 2}')],
    ),
    (
        'I will check. [TOOL_CALLS] [{"name": "a", "arguments": {"s": "{\\"}"}}]',
        "I will check.",
        [("a", '{"s": "{\\"}"}')],
    ),
    (
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abc123def"}, {"name": "b", "argu',
        ' {"name": "b", "argu',
        [("a", '{"x": 1}')],
    ),
    ('[TOOL_CALLS]{"name": "a"}', '[TOOL_CALLS]{"name": "a"}', []),
]


MISTRAL_ARGS_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Bonjour.", "Bonjour.", []),
    (
        '[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]read_file[ARGS]{"path": "{\\"}.py"}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("read_file", '{"path": "{\\"}.py"}')],
    ),
    (
        'Checking.\n[TOOL_CALLS]a[ARGS]{"q": "]"}',
        "Checking.",
        [("a", '{"q": "]"}')],
    ),
    ('[TOOL_CALLS]a[ARGS]{"q": "tru', '[TOOL_CALLS]a[ARGS]{"q": "tru', []),
    ("[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]not a name[ARGS]{}", []),
    ('[TOOL_CALLS]a[ARGS]"x"', '[TOOL_CALLS]a[ARGS]"x"', []),
]


def family_cases() -> Iterator[Any]:
    for fmt, cases in (
        (HERMES_FORMAT, HERMES_CASES),
        (FALLBACK_FORMAT, HERMES_CASES),
        (LLAMA3_FORMAT, LLAMA3_CASES),
        (MISTRAL_FORMAT, MISTRAL_CASES),
        (MISTRAL_ARGS_FORMAT.model_copy(update={"id_marker": "[CALL_ID]"}), MISTRAL_ARGS_CASES),
    ):
        for output, content, calls in cases:
            yield pytest.param(fmt, output, content, calls, id=f"{fmt.family}-{output[:30]}")


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), list(family_cases()))
def test_parses_model_output_however_it_is_chunked(
    fmt: ToolCallFormat, output: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for deltas in chunkings(output):
        events = run(fmt, deltas)
        assert content_and_calls(events) == (content, calls), deltas
        check_event_order(events)
    parsed = parse_tool_calls(fmt, output)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]) == (content, calls)


def check_event_order(events: list[ToolCallEvent]) -> None:
    """Every call: start, then its argument pieces, then its end (or abandoned);
    the pieces add up to the final arguments; indices count up from 0."""
    open_calls: dict[int, str] = {}
    ended: list[int] = []
    for event in events:
        match event:
            case ToolCallStart(index=index):
                assert index == len(ended) + len(open_calls) and index not in open_calls
                open_calls[index] = ""
            case ToolCallArgumentsPiece(index=index, text=text):
                open_calls[index] += text
            case ToolCallEnd(index=index, call=call):
                assert open_calls.pop(index) == call.arguments
                ended.append(index)
            case ToolCallAbandoned(index=index):
                open_calls.pop(index)
                ended.append(index)
            case TextPiece():
                pass
    assert not open_calls


def test_call_ids_fit_the_family() -> None:
    hermes = parse_tool_calls(
        HERMES_FORMAT, '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    )
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", hermes.tool_calls[0].id)
    mistral = parse_tool_calls(MISTRAL_FORMAT, '[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.tool_calls[0].id)
    # the id the model wrote is kept: the template writes it back
    kept = parse_tool_calls(
        MISTRAL_FORMAT, '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "Ab3De6Gh9"}]'
    )
    assert kept.tool_calls[0].id == "Ab3De6Gh9"


@pytest.mark.parametrize(
    ("fmt", "deltas", "per_feed"),
    [
        (  # text goes out at once; a possible marker start and trailing space are held
            HERMES_FORMAT,
            ["Hello", " wor", "ld <to", "ol>!", "\n"],
            [["Hello"], [" wor"], ["ld"], [" <tool>!"], []],
        ),
        (  # the name goes out when its string closes, arguments as they arrive
            HERMES_FORMAT,
            [
                "Hi",
                "\n<tool",
                '_call>\n{"na',
                'me": "f"',
                ', "arguments": {"a"',
                ": [1, ",
                "2]}}\n</tool_call>",
            ],
            [
                ["Hi"],
                [],
                [],
                [ToolCallStart(index=0, id="id0", name="f")],
                [ToolCallArgumentsPiece(index=0, text='{"a"')],
                [ToolCallArgumentsPiece(index=0, text=": [1, ")],
                [
                    ToolCallArgumentsPiece(index=0, text="2]}"),
                    ToolCallEnd(
                        index=0, call=ToolCall(id="id0", name="f", arguments='{"a": [1, 2]}')
                    ),
                ],
            ],
        ),
        (  # arguments before the name: held until the name is known
            HERMES_FORMAT,
            ['<tool_call>{"arguments": {"a": 1}', ', "name": "f"', "}</tool_call>"],
            [
                [],
                [
                    ToolCallStart(index=0, id="id0", name="f"),
                    ToolCallArgumentsPiece(index=0, text='{"a": 1}'),
                ],
                [ToolCallEnd(index=0, call=ToolCall(id="id0", name="f", arguments='{"a": 1}'))],
            ],
        ),
        (  # a started call cut off: abandoned, then its raw text
            HERMES_FORMAT,
            ['<tool_call>{"name": "f", "arguments": {"a"'],
            [
                [
                    ToolCallStart(index=0, id="id0", name="f"),
                    ToolCallArgumentsPiece(index=0, text='{"a"'),
                ],
                [
                    ToolCallAbandoned(index=0),
                    TextPiece(text='<tool_call>{"name": "f", "arguments": {"a"'),
                ],
            ],
        ),
        (  # Mistral writes the id after the arguments: the start waits for it
            MISTRAL_FORMAT,
            ['[TOOL_CALLS][{"name": "f", "arguments": {}', ', "id": "abc123def"', "}]"],
            [
                [],
                [
                    ToolCallStart(index=0, id="abc123def", name="f"),
                    ToolCallArgumentsPiece(index=0, text="{}"),
                ],
                [ToolCallEnd(index=0, call=ToolCall(id="abc123def", name="f", arguments="{}"))],
            ],
        ),
        (  # a bare header: the call starts at the args marker, arguments stream after it
            MISTRAL_ARGS_FORMAT.model_copy(update={"id_marker": "[CALL_ID]"}),
            ["[TOOL_CALLS]f[CALL_", "ID]Ab3De6Gh9[AR", 'GS]{"a": ', "1}"],
            [
                [],
                [],
                [
                    ToolCallStart(index=0, id="Ab3De6Gh9", name="f"),
                    ToolCallArgumentsPiece(index=0, text='{"a": '),
                ],
                [
                    ToolCallArgumentsPiece(index=0, text="1}"),
                    ToolCallEnd(
                        index=0, call=ToolCall(id="Ab3De6Gh9", name="f", arguments='{"a": 1}')
                    ),
                ],
            ],
        ),
    ],
)
def test_events_per_feed(
    fmt: ToolCallFormat, deltas: list[str], per_feed: list[list[ToolCallEvent | str]]
) -> None:
    """`per_feed[i]`: the events of feed i; a last extra entry: those of finish()."""
    ids = fixed_ids()
    parser = ToolCallParser(fmt, new_call_id=lambda: next(ids))
    got: list[list[ToolCallEvent | str]] = []
    for delta in deltas:
        got.append([e.text if isinstance(e, TextPiece) else e for e in parser.feed(delta)])
    finished = parser.finish()
    if len(per_feed) > len(deltas):
        got.append(list(finished))
    else:
        assert all(isinstance(e, TextPiece) for e in finished)
    assert got == per_feed


def test_malformed_calls_are_logged() -> None:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        parse_tool_calls(HERMES_FORMAT, '<tool_call>{"name": "f", "arguments": {')
    finally:
        logger.remove(sink)
    assert len(messages) == 1 and "malformed hermes tool call" in messages[0]


# --- the fallback prompt ------------------------------------------------------

TOOLS = [
    ToolFunction(
        name="read_file",
        description="Read a file",
        parameters={
            "type": "object",
            "required": ["path"],
            "properties": {"path": {"type": "string"}},
        },
    ),
    ToolFunction(name="now", description="The time"),
]


def test_fallback_prompt_lists_tools_in_a_stable_order() -> None:
    reordered = [
        TOOLS[0].model_copy(
            update={
                "parameters": {
                    "properties": {"path": {"type": "string"}},
                    "type": "object",
                    "required": ["path"],
                }
            }
        ),
        TOOLS[1],
    ]
    prompt = render_fallback_system_prompt(TOOLS)
    assert prompt == render_fallback_system_prompt(reordered)
    assert (
        '{"name": "read_file", "description": "Read a file", "parameters": '
        '{"properties": {"path": {"type": "string"}}, "required": ["path"], "type": "object"}}\n'
        '{"name": "now", "description": "The time", "parameters": {"type": "object"}}'
    ) in prompt
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
        in prompt
    )


@pytest.mark.parametrize("choice", ["required", NamedToolChoice(name="now")])
def test_the_fallback_prompt_does_not_change_with_the_tool_choice(choice: Any) -> None:
    # A forced call is the grammar's job; the prompt (and its cache) stays the same.
    turns = [ChatTurn(role="user", content="Read a.py")]
    assert fallback_chat_turns(turns, TOOLS, choice) == fallback_chat_turns(turns, TOOLS, "auto")


def test_fallback_turns_render_calls_and_results_as_text() -> None:
    calls = (
        ToolCall(id="call_1", name="read_file", arguments='{"path": "a.py"}'),
        ToolCall(id="call_2", name="now", arguments="{}"),
    )
    turns = [
        ChatTurn(role="system", content="Be brief."),
        ChatTurn(role="user", content="Read a.py"),
        ChatTurn(role="assistant", content="Reading.", tool_calls=calls),
        ChatTurn(role="tool", tool_call_id="call_1", content="print(1)"),
        ChatTurn(role="tool", tool_call_id="call_2", content="noon"),
    ]
    out = fallback_chat_turns(turns, TOOLS, "auto")
    assert [t.role for t in out] == ["system", "user", "assistant", "user"]
    assert out[0].content == "Be brief.\n\n" + render_fallback_system_prompt(TOOLS)
    assert out[2] == ChatTurn(
        role="assistant",
        content='Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    )
    assert out[3].content == (
        '<tool_response name="read_file" id="call_1">\nprint(1)\n</tool_response>\n'
        '<tool_response name="now" id="call_2">\nnoon\n</tool_response>'
    )
    # tool_choice "none": no tools offered, the history still renders
    none = fallback_chat_turns(turns, TOOLS, "none")
    assert none[0] == turns[0] and none[2] == out[2]


@pytest.mark.parametrize(
    "generated",
    [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
        'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "{x}.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        # arguments written without spaces come back as written
        '<tool_call>\n{"name": "read_file", "arguments": {"path":"a.py"}}\n</tool_call>',
    ],
)
def test_fallback_history_extends_the_cached_prompt(generated: str) -> None:
    """On the built-in model's template (no tool support): a call the model
    wrote in the taught form, parsed and sent back by the client with its
    results, renders to a prompt that starts with the first prompt plus exactly
    what the model generated."""
    template = "HuggingFaceTB-SmolLM2-135M-Instruct"
    fmt = detect_tool_format(chat_template(template))
    turns = [ChatTurn(role="user", content="Read a.py")]

    def prompt(history: list[ChatTurn]) -> str:
        messages = [
            t.model_dump(include={"role", "content"})
            for t in fallback_chat_turns(history, TOOLS, "auto")
        ]
        return render(template, messages, add_generation_prompt=True)

    first = prompt(turns)
    parsed = parse_tool_calls(fmt, generated)
    assert render_fallback_assistant(parsed.content, parsed.tool_calls) == generated
    results = [ChatTurn(role="tool", tool_call_id=c.id, content="ok") for c in parsed.tool_calls]
    reply = ChatTurn(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
    assert prompt([*turns, reply, *results]).startswith(first + generated + "<|im_end|>")
