"""Render a chat request to prompt token ids with the model's chat template.

Tools go through the template (`tools=`) when it renders them in a tool-call
syntax exo parses; otherwise exo's fallback teaches its own syntax in the
system prompt and writes calls and results in history as text. Either way a
history is rendered exactly as the model wrote it, so the next turn's prompt
extends the cached one token for token.

A request with `continue_final_message` ends with an assistant turn whose text
is the start of the reply: it is rendered open (no end-of-turn, no generation
prompt), so the model goes on writing it — a reply cut at `max_tokens`,
continued, reads as one answer.
"""

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from exo.engine.token_trie import common_prefix_length
from exo.engine.tool_calls.fallback import fallback_chat_turns
from exo.engine.tool_calls.formats import ToolCallFormat, detect_tool_format
from exo.models.chat_tokenizer import ChatTokenizer
from exo.models.vision import ImagePrompts, Picture
from exo.shared.prompt_images import PromptImage
from exo.shared.types.chat import (
    ChatRequest,
    ChatTurn,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolFunction,
)


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    # Tokens of the leading system message(s) (and tools) as rendered; the
    # prefix cache keeps such a shared prefix as its own entry.
    system_prompt_length: int
    # Images, their placeholders in `tokens` written as image keys.
    images: tuple[PromptImage, ...] = ()


def chat_template_text(tokenizer: ChatTokenizer) -> str | None:
    """The template's source; a tokenizer with named templates gets them all
    (the `tool_use` one is chosen by the tokenizer when tools are passed)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(template.values())
    return template


def tool_call_format(tokenizer: ChatTokenizer) -> ToolCallFormat:
    """How this model writes tool calls: what the prompt teaches and the parser reads."""
    return detect_tool_format(chat_template_text(tokenizer))


def _template_tool(tool: ToolFunction) -> dict[str, Any]:
    # Every key present: some templates read `description` unguarded.
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _template_call(call: ToolCall, arguments_as_text: bool) -> dict[str, Any]:
    # Templates that accept text get the arguments exactly as the model wrote
    # them; the others serialize an object (`arguments | tojson`).
    arguments: Any = call.arguments
    if not arguments_as_text:
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):
            arguments = call.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _template_messages(turns: Sequence[ChatTurn], template: str) -> list[dict[str, Any]]:
    arguments_as_text = "arguments is string" in template
    messages: list[dict[str, Any]] = []
    for turn in turns:
        message: dict[str, Any] = {"role": turn.role, "content": _content(turn)}
        if turn.tool_calls:
            message["tool_calls"] = [
                _template_call(call, arguments_as_text) for call in turn.tool_calls
            ]
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        if turn.role == "tool" and turn.name is not None:
            message["name"] = turn.name
        messages.append(message)
    return messages


def _content(turn: ChatTurn) -> str | list[dict[str, str]]:
    """A turn's text, or with images its parts in order (as vision templates take them)."""
    if not turn.images:
        return turn.content
    parts: list[dict[str, str]] = []
    start = 0
    for image in turn.images:
        if image.offset > start:
            parts.append({"type": "text", "text": turn.content[start : image.offset]})
            start = image.offset
        parts.append({"type": "image"})
    if start < len(turn.content) or not turn.content:
        parts.append({"type": "text", "text": turn.content[start:]})
    return parts


def _encode(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    generation: bool,
    template_kwargs: dict[str, Any],
    continue_final: bool = False,
) -> list[int]:
    text = _render(tokenizer, messages, generation, template_kwargs, continue_final)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _render(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    generation: bool,
    template_kwargs: dict[str, Any],
    continue_final: bool = False,
) -> str:
    if continue_final:
        try:
            text = tokenizer.apply_chat_template(
                messages, continue_final_message=True, tokenize=False, **template_kwargs
            )
        except ValueError as error:  # transformers: the template drops part of it
            raise TemplateError(
                "the final assistant message cannot be continued: the chat template "
                "does not render it as sent"
            ) from error
        assert isinstance(text, str)
        return text
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False, **template_kwargs
    )
    assert isinstance(text, str)
    return text


def _system_prompt_length(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    tokens: list[int],
    template_kwargs: dict[str, Any],
) -> int:
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if leading == len(messages) or (leading == 0 and "tools" not in template_kwargs):
        return 0
    # Every conversation with this system prompt (and tools) shares its tokens
    # plus the next message's header; render that message empty to find where it ends.
    header_only = [*messages[:leading], {"role": messages[leading]["role"], "content": ""}]
    return common_prefix_length(
        tuple(tokens), tuple(_encode(tokenizer, header_only, False, template_kwargs))
    )


def render_prompt(
    tokenizer: ChatTokenizer,
    request: ChatRequest,
    pictures: Sequence[Picture] = (),
    vision: ImagePrompts | None = None,
) -> ChatPrompt:
    """The prompt's token ids: the turns through the chat template (with the
    generation prompt), or a raw prompt as is (legacy completions). `pictures`:
    the request's images in order, decoded; a vision model's processor
    (`vision`) expands each into its placeholders."""
    match request.prompt:
        case None:
            pass
        case TextPrompt(text=text):
            return ChatPrompt(tokenizer.encode(text, add_special_tokens=True), 0)
        case TokenPrompt(tokens=tokens):
            return ChatPrompt(list(tokens), 0)
    template_kwargs: dict[str, Any] = {}
    if request.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = request.reasoning_effort
    template_kwargs |= request.template_kwargs
    template = chat_template_text(tokenizer) or ""
    # With tool_choice "none" the model is not shown the tools at all.
    tools = request.tools if request.tool_choice != "none" else ()
    if detect_tool_format(template).in_template:
        turns = request.turns
        if tools:
            template_kwargs["tools"] = [_template_tool(tool) for tool in tools]
    else:
        turns = fallback_chat_turns(request.turns, tools, request.tool_choice)
    messages = _template_messages(turns, template)
    continue_final = request.continue_final_message and messages[-1]["role"] == "assistant"
    text = _render(tokenizer, messages, not continue_final, template_kwargs, continue_final)
    images: list[PromptImage] = []
    if pictures:
        if vision is None:
            raise ValueError("the model reads text only")
        tokens, images = vision.tokens(text, pictures)
    else:
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
    return ChatPrompt(
        tokens,
        _system_prompt_length(tokenizer, messages, tokens, template_kwargs),
        tuple(images),
    )
