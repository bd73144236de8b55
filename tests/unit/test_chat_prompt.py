"""Rendering chat requests through real chat templates: tools, calls and results
in history, template variables, and prompts that extend the cached ones token
for token (the prefix cache depends on it)."""

import json
from pathlib import Path
from typing import Any

import pytest

from exo.api.chat_prompt import ChatPrompt, render_prompt, tool_call_format
from exo.api.openai_translate import to_chat_request
from exo.api.openai_types import ChatCompletionRequest
from exo.engine.tool_calls.fallback import render_fallback_assistant
from exo.engine.tool_calls.formats import ToolCallFamily, render_tool_calls
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from exo.shared.types.chat import (
    ChatRequest,
    ChatTurn,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolFunction,
)
from exo.shared.types.ids import ModelId

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
QWEN25 = "Qwen-Qwen2.5-7B-Instruct.jinja"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
HERMES3 = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct.jinja"

READ = ToolFunction(
    name="read",
    description="Read a file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
)
BASH = ToolFunction(name="bash", parameters={"type": "object", "properties": {}})
CALL = ToolCall(id="call_1", name="read", arguments='{"path": "README.md"}')
SYSTEM = ChatTurn(role="system", content="You are a careful coding agent.")
USER = ChatTurn(role="user", content="Summarize the README")
CHATML_END = "<|im_end|>"
RESULT = ChatTurn(role="tool", content="# exo\nRun models.", tool_call_id="call_1", name="read")


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(smollm_dir)


def with_template(smollm_dir: Path, name: str) -> ChatTokenizer:
    """SmolLM2's tokenizer speaking another model's chat template (the text is
    what matters here, not which tokens it becomes)."""
    tokenizer: Any = load_chat_tokenizer(smollm_dir)
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    return tokenizer


def request(*turns: ChatTurn, **fields: Any) -> ChatRequest:
    return ChatRequest(model=ModelId("m"), turns=turns, **fields)


def text_of(tokenizer: ChatTokenizer, prompt: ChatPrompt) -> str:
    return tokenizer.decode(prompt.tokens)  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType, reportUnknownVariableType]


def test_prompt_follows_the_chat_template(smollm: ChatTokenizer) -> None:
    prompt = render_prompt(smollm, request(ChatTurn(role="user", content="Hi")))
    text = text_of(smollm, prompt)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.system_prompt_length == 0


def test_system_prompt_length_is_what_two_conversations_share(smollm: ChatTokenizer) -> None:
    system = ChatTurn(role="system", content="You are a careful coding agent. " * 20)
    a = render_prompt(smollm, request(system, ChatTurn(role="user", content="Fix main.py")))
    b = render_prompt(smollm, request(system, ChatTurn(role="user", content="Explain utils.py")))
    shared = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)
    assert a.system_prompt_length == b.system_prompt_length == shared
    system_only = smollm.encode(
        "<|im_start|>system\n" + "You are a careful coding agent. " * 20, add_special_tokens=False
    )
    assert a.system_prompt_length > len(system_only)


def test_openai_messages_render_as_turns(smollm: ChatTokenizer) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
                },
            ],
        }
    )
    as_parts = render_prompt(smollm, to_chat_request(body))
    as_text = render_prompt(
        smollm,
        request(
            ChatTurn(role="system", content="Be brief."), ChatTurn(role="user", content="Hello")
        ),
    )
    assert as_parts == as_text
    assert as_parts.system_prompt_length > 0


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [(TextPrompt(text="def add(a, b):"), None), (TokenPrompt(tokens=(5, 6, 7)), [5, 6, 7])],
)
def test_a_raw_prompt_skips_the_template(
    smollm: ChatTokenizer, prompt: TextPrompt | TokenPrompt, expected: list[int] | None
) -> None:
    rendered = render_prompt(smollm, ChatRequest(model=ModelId("m"), prompt=prompt))
    if expected is None:
        assert text_of(smollm, rendered) == "def add(a, b):"
    else:
        assert rendered.tokens == expected
    assert rendered.system_prompt_length == 0


def test_fallback_puts_tools_in_the_system_prompt(smollm: ChatTokenizer) -> None:
    assert tool_call_format(smollm).family == ToolCallFamily.FALLBACK
    text = text_of(smollm, render_prompt(smollm, request(SYSTEM, USER, tools=(READ, BASH))))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a careful coding agent.\n\n# Tools")
    assert '"name": "read"' in system and '"name": "bash"' in system
    # tool_choice "none": the model is not shown the tools
    plain = render_prompt(smollm, request(SYSTEM, USER))
    assert render_prompt(smollm, request(SYSTEM, USER, tools=(READ,), tool_choice="none")) == plain


def test_tools_alone_are_a_shared_prefix(smollm: ChatTokenizer, smollm_dir: Path) -> None:
    for tokenizer in (smollm, with_template(smollm_dir, QWEN25)):
        a = render_prompt(tokenizer, request(USER, tools=(READ, BASH)))
        b = render_prompt(
            tokenizer, request(ChatTurn(role="user", content="Now fix it"), tools=(READ, BASH))
        )
        shared = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)
        assert a.system_prompt_length == b.system_prompt_length == shared
        assert '"name": "bash"' in tokenizer.decode(a.tokens[: a.system_prompt_length])  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]


@pytest.mark.parametrize("name", [QWEN25, QWEN3, HERMES3])
def test_tools_and_history_go_through_a_tool_template(smollm_dir: Path, name: str) -> None:
    tokenizer = with_template(smollm_dir, name)
    assert tool_call_format(tokenizer).family == ToolCallFamily.HERMES
    assistant = ChatTurn(role="assistant", tool_calls=(CALL,))
    text = text_of(
        tokenizer, render_prompt(tokenizer, request(SYSTEM, USER, assistant, RESULT, tools=(READ,)))
    )
    assert "Read a file" in text
    assert '<tool_call>\n{"name": "read", "arguments": {"path": "README.md"}}\n</tool_call>' in text
    assert "<tool_response>\n# exo\nRun models.\n</tool_response>" in text


@pytest.mark.parametrize(
    ("name", "rendered"),
    [
        # `arguments | tojson`: the object, serialized again
        (QWEN25, '"arguments": {"path": "a.py"}}'),
        # `arguments is string`: the text exactly as the model wrote it
        (QWEN3, '"arguments": {"path":"a.py"}}'),
    ],
)
def test_call_arguments_as_the_template_wants_them(
    smollm_dir: Path, name: str, rendered: str
) -> None:
    tokenizer = with_template(smollm_dir, name)
    call = ToolCall(id="c", name="read", arguments='{"path":"a.py"}')
    turns = (USER, ChatTurn(role="assistant", tool_calls=(call,)), RESULT)
    assert rendered in text_of(tokenizer, render_prompt(tokenizer, request(*turns, tools=(READ,))))


def test_template_variables_and_reasoning_pass_through(smollm_dir: Path) -> None:
    tokenizer = with_template(smollm_dir, QWEN3)
    thinking_off = render_prompt(
        tokenizer, request(USER, template_kwargs={"enable_thinking": False})
    )
    assert text_of(tokenizer, thinking_off).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Qwen3 keeps the reasoning of turns after the last user message
    turns = (USER, ChatTurn(role="assistant", content="It runs models.", reasoning="Read it."))
    assert "<think>\nRead it.\n</think>\n\nIt runs models." in text_of(
        tokenizer, render_prompt(tokenizer, request(*turns))
    )
    effort: Any = load_chat_tokenizer(smollm_dir)
    effort.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}|{{ reasoning_effort }}"
    )
    assert text_of(effort, render_prompt(effort, request(USER, reasoning_effort="low"))).endswith(
        "|low"
    )


def extends(
    tokenizer: Any, earlier: ChatPrompt, generated: str, later: ChatPrompt, end_of_turn: str
) -> bool:
    """The later prompt starts with the earlier prompt, the generated tokens and
    the end-of-turn token: a prefix-cache hit covers the whole earlier turn."""
    cached = earlier.tokens + tokenizer.encode(generated + end_of_turn, add_special_tokens=False)
    return later.tokens[: len(cached)] == cached


@pytest.mark.parametrize("content", ["", "Let me read it."])
def test_fallback_history_extends_the_cached_prompt(smollm: ChatTokenizer, content: str) -> None:
    first = render_prompt(smollm, request(SYSTEM, USER, tools=(READ, BASH)))
    generated = render_fallback_assistant(content, (CALL,))  # as the model is taught to write it
    assistant = ChatTurn(role="assistant", content=content, tool_calls=(CALL,))
    second = render_prompt(smollm, request(SYSTEM, USER, assistant, RESULT, tools=(READ, BASH)))
    assert extends(smollm, first, generated, second, CHATML_END)
    assert '<tool_response name="read" id="call_1">\n# exo\nRun models.\n</tool_response>' in (
        text_of(smollm, second)
    )
    # and the turn after that extends this one
    answer = ChatTurn(role="assistant", content="It runs models.")
    third = render_prompt(
        smollm,
        request(
            SYSTEM,
            USER,
            assistant,
            RESULT,
            answer,
            ChatTurn(role="user", content="Thanks"),
            tools=(READ, BASH),
        ),
    )
    assert extends(smollm, second, "It runs models.", third, CHATML_END)


@pytest.mark.parametrize(
    ("name", "end_of_turn", "calls"),
    [(QWEN25, CHATML_END, 2), (HERMES3, CHATML_END, 2)],
)
def test_template_history_extends_the_cached_prompt(
    smollm_dir: Path, name: str, end_of_turn: str, calls: int
) -> None:
    tokenizer = with_template(smollm_dir, name)
    made = (CALL, ToolCall(id="call_2", name="bash", arguments='{"command": "ls"}'))[:calls]
    results = (RESULT, ChatTurn(role="tool", content="README.md", tool_call_id="call_2"))[:calls]
    first = render_prompt(tokenizer, request(SYSTEM, USER, tools=(READ, BASH)))
    generated = render_tool_calls(tool_call_format(tokenizer), made)  # as the family writes it
    assistant = ChatTurn(role="assistant", tool_calls=made)
    second = render_prompt(
        tokenizer, request(SYSTEM, USER, assistant, *results, tools=(READ, BASH))
    )
    assert extends(tokenizer, first, generated, second, end_of_turn)


def test_llama3_history_extends_the_cached_text(smollm_dir: Path) -> None:
    """Text only: SmolLM2's tokenizer splits Llama's "\n\n{" differently from
    Llama 3's own, whose pre-tokenizer keeps the newlines whole."""
    tokenizer = with_template(smollm_dir, LLAMA31)
    assert tool_call_format(tokenizer).family == ToolCallFamily.LLAMA3
    first = text_of(tokenizer, render_prompt(tokenizer, request(SYSTEM, USER, tools=(READ,))))
    generated = render_tool_calls(tool_call_format(tokenizer), (CALL,))
    assistant = ChatTurn(role="assistant", tool_calls=(CALL,))
    second = text_of(
        tokenizer, render_prompt(tokenizer, request(SYSTEM, USER, assistant, RESULT, tools=(READ,)))
    )
    assert second.startswith(first + generated + "<|eot_id|>")


def test_opencode_turn_renders(smollm: ChatTokenizer) -> None:
    """The request a real OpenCode sends: ten tools, rendered with the fallback."""
    recorded = json.loads(
        (
            Path(__file__).parent.parent / "fixtures" / "clients" / "opencode_agent_turn.json"
        ).read_text()
    )
    chat = to_chat_request(ChatCompletionRequest.model_validate(recorded["body"]))
    prompt = render_prompt(smollm, chat)
    head = text_of(smollm, ChatPrompt(prompt.tokens[: prompt.system_prompt_length], 0))
    assert all(f'"name": "{tool.name}"' in head for tool in chat.tools)


def test_a_final_assistant_message_is_continued(smollm: ChatTokenizer) -> None:
    """`continue_final_message` (vLLM's field): the reply extends the last
    assistant message, rendered open, so a reply cut at max_tokens goes on."""
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Count to ten"},
                {"role": "assistant", "content": "one, two, three"},
            ],
            "continue_final_message": True,
        }
    )
    chat = to_chat_request(body)
    assert chat.continue_final_message
    text = text_of(smollm, render_prompt(smollm, chat))
    assert text.endswith(
        "<|im_start|>user\nCount to ten<|im_end|>\n<|im_start|>assistant\none, two, three"
    )
    # Without it, the assistant message is history and a new one is asked for.
    answered = text_of(
        smollm, render_prompt(smollm, chat.model_copy(update={"continue_final_message": False}))
    )
    assert answered.endswith("one, two, three<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ],
    ],
)  # fmt: skip
def test_only_an_assistant_message_can_be_continued(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="continue_final_message needs an assistant message"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "continue_final_message": True}
        )
