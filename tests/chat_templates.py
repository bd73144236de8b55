"""Real chat templates (tests/fixtures/chat_templates) rendered the way
transformers renders them for mlx-lm's tokenizer."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def chat_template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def render(
    name: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    rendered, _ = render_jinja_template(
        [messages],
        tools=list(tools) if tools is not None else None,
        chat_template=chat_template(name),
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
        date_string="01 Jan 2026",
        **(template_kwargs or {}),
    )
    return rendered[0]
