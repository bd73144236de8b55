"""A request's prompt, rendered by the API (`api.generation.render`): routing
among replicas renders a request to compare its prompt with their caches, and
answering it then reuses that prompt instead of rendering it again."""

from pathlib import Path
from typing import Any

import pytest

from exo.api import generation
from exo.api.chat_prompt import ChatPrompt
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.shared.types.chat import ChatRequest
from tests.unit.test_speculation_api import chat, served


async def test_a_request_routed_then_answered_is_rendered_once(
    tmp_path: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = served(load_chat_tokenizer(smollm_dir), tmp_path)
    rendered: list[ChatRequest] = []
    real = generation.render_prompt

    def counting(*args: Any) -> ChatPrompt:
        rendered.append(args[1])
        return real(*args)

    monkeypatch.setattr(generation, "render_prompt", counting)
    first = await generation.render(model, chat(), fetch_images=True)
    again = await generation.render(model, chat(), fetch_images=True)  # an equal request
    assert again is first and len(rendered) == 1
    other = chat(messages=[{"role": "user", "content": "Something else"}])
    assert (await generation.render(model, other, fetch_images=True)).tokens != first.tokens
    assert len(rendered) == 2
