"""Canonicalization before tokenizing: each volatile pattern is removed from
system turns (a case per pattern), nothing else of a request changes, and two
requests that differ only in a volatile part render the same prompt."""

import json
from pathlib import Path
from typing import Any

import pytest

from exo.api.anthropic import to_chat_request
from exo.api.anthropic_types import MessagesRequest
from exo.api.canonical import VOLATILE_PATTERNS, canonical_request, canonical_system_text
from exo.api.chat_prompt import render_prompt
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.shared.types.chat import ChatRequest, ChatTurn, ToolFunction
from exo.shared.types.ids import ModelId

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HEADER = "x-anthropic-billing-header: cc_version=2.1.328.9cb; cc_entrypoint=sdk-cli; cch=4f1c2;"

# (pattern name, system text, canonical text)
CASES: list[tuple[str, str, str]] = [
    ("anthropic-billing-header", f"{HEADER}\nYou are an agent.", "You are an agent."),
    ("anthropic-billing-header", HEADER, ""),
    ("anthropic-billing-header", f"Intro.\n{HEADER}\nRules.", "Intro.\nRules."),
    ("anthropic-billing-header", f"{HEADER}\r\nNext.", "Next."),
    # only a line that starts with the header is one
    (
        "anthropic-billing-header",
        "Clients send x-anthropic-billing-header: lines.",
        "Clients send x-anthropic-billing-header: lines.",
    ),
]


def test_every_pattern_has_a_case() -> None:
    assert {name for name, _, _ in CASES} == {pattern.name for pattern in VOLATILE_PATTERNS}


@pytest.mark.parametrize(("name", "text", "canonical"), CASES)
def test_pattern(name: str, text: str, canonical: str) -> None:
    assert canonical_system_text(text) == canonical


SCHEMA = {
    "required": ["path"],
    "type": "object",
    "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
}


def request(*turns: ChatTurn, **fields: Any) -> ChatRequest:
    return ChatRequest(model=ModelId("m"), turns=turns, **fields)


def test_only_system_turns_change() -> None:
    tools = (ToolFunction(name="read", parameters=SCHEMA),)
    original = request(
        ChatTurn(role="system", content=f"{HEADER}\nBe brief."),
        ChatTurn(role="user", content=f"{HEADER}\nquoted by the user"),
        tools=tools,
    )
    canonical = canonical_request(original)
    assert canonical == original.model_copy(
        update={"turns": (ChatTurn(role="system", content="Be brief."), original.turns[1])}
    )
    # the tool schema keeps its keys in the order sent
    assert list(canonical.tools[0].parameters) == ["required", "type", "properties"]


def test_a_request_without_volatile_parts_is_returned_as_is() -> None:
    original = request(
        ChatTurn(role="system", content="Be brief."), ChatTurn(role="user", content="Hi")
    )
    assert canonical_request(original) is original


def claude_code_request(cch: str) -> ChatRequest:
    body = json.loads((FIXTURES / "clients" / "claude_code_turn.json").read_text())["body"]
    body["system"][0]["text"] = body["system"][0]["text"] + f" cch={cch};"
    return to_chat_request(MessagesRequest.model_validate(body))


def test_requests_that_differ_only_in_the_billing_hash_render_the_same_prompt(
    smollm_dir: Path,
) -> None:
    # Qwen3's template renders tools (as `tojson`, which keeps their key order).
    tokenizer: Any = load_chat_tokenizer(smollm_dir)
    tokenizer.chat_template = (FIXTURES / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    first, second = claude_code_request("a1b2c"), claude_code_request("d3e4f")
    assert first != second
    first_prompt = render_prompt(tokenizer, canonical_request(first))
    assert first_prompt.tokens == render_prompt(tokenizer, canonical_request(second)).tokens
    text: str = tokenizer.decode(first_prompt.tokens)
    assert "x-anthropic-billing-header" not in text
    # each schema appears with its keys in the order the client sent them
    for tool in first.tools:
        assert json.dumps(tool.parameters, ensure_ascii=False) in text
