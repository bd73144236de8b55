from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from exo.api.chat_prompt import render_chat_prompt
from exo.api.openai_types import ChatMessage, TextPart


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm_dir)


def msg(role: str, content: str) -> ChatMessage:
    return ChatMessage.model_validate({"role": role, "content": content})


def test_prompt_follows_the_chat_template(tokenizer: TokenizerWrapper) -> None:
    prompt = render_chat_prompt(tokenizer, [msg("user", "Hi")])
    text = tokenizer.decode(prompt.tokens)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.system_prompt_length == 0


def test_system_prompt_length_is_what_two_conversations_share(tokenizer: TokenizerWrapper) -> None:
    system = msg("system", "You are a careful coding agent. " * 20)
    a = render_chat_prompt(tokenizer, [system, msg("user", "Fix the bug in main.py")])
    b = render_chat_prompt(tokenizer, [system, msg("user", "Explain what utils.py does")])
    shared = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)
    assert a.system_prompt_length == b.system_prompt_length == shared
    system_only = tokenizer.encode(
        "<|im_start|>system\n" + "You are a careful coding agent. " * 20, add_special_tokens=False
    )
    assert a.system_prompt_length > len(system_only)


def test_text_parts_and_developer_role(tokenizer: TokenizerWrapper) -> None:
    parts = ChatMessage(
        role="user", content=[TextPart(type="text", text="Hel"), TextPart(type="text", text="lo")]
    )
    as_parts = render_chat_prompt(tokenizer, [msg("developer", "Be brief."), parts])
    as_text = render_chat_prompt(tokenizer, [msg("system", "Be brief."), msg("user", "Hello")])
    assert as_parts.tokens == as_text.tokens
    assert as_parts.system_prompt_length > 0
