"""Render chat messages to prompt token ids with the model's chat template."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.api.openai_types import ChatMessage
from exo.engine.token_trie import common_prefix_length


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    # Tokens of the leading system message(s) as rendered; the prefix cache
    # keeps such a shared prefix as its own entry rather than overwriting it.
    system_prompt_length: int


def _template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    rendered = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        rendered.append({"role": role, "content": message.text()})
    return rendered


def _encode(
    tokenizer: TokenizerWrapper, messages: list[dict[str, Any]], generation: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    assert isinstance(text, str)
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_prompt(tokenizer: TokenizerWrapper, messages: Sequence[ChatMessage]) -> ChatPrompt:
    templated = _template_messages(messages)
    tokens = _encode(tokenizer, templated, generation=True)
    leading = 0
    while leading < len(templated) and templated[leading]["role"] == "system":
        leading += 1
    system_length = 0
    if 0 < leading < len(templated):
        # Every conversation with this system prompt shares its tokens plus the
        # next message's header; render that message empty to find where it ends.
        header_only = [*templated[:leading], {**templated[leading], "content": ""}]
        system_length = common_prefix_length(
            tuple(tokens), tuple(_encode(tokenizer, header_only, False))
        )
    return ChatPrompt(tokens=tokens, system_prompt_length=system_length)
