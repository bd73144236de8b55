from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from exo.models.chat_tokenizer import load_chat_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Ünïcödé ✓"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
def test_the_node_renders_what_the_runner_would(
    smollm_dir: Path, conversation: list[dict[str, str]], generation: bool
) -> None:
    """The node's tokenizer (no MLX) gives the tokens mlx_lm's tokenizer gives."""
    node, runner = load_chat_tokenizer(smollm_dir), load_tokenizer(smollm_dir)
    assert node.chat_template == runner.chat_template
    text = node.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False)
    assert isinstance(text, str)
    assert text == runner.apply_chat_template(
        conversation, add_generation_prompt=generation, tokenize=False
    )
    assert node.encode(text, add_special_tokens=False) == runner.encode(
        text, add_special_tokens=False
    )
