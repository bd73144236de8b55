"""The tokenizer a node renders chat templates with, loaded without MLX.

The node process never imports MLX, so a broken MLX install shows as a failed
runner rather than a dead node; it reads the model folder's Hugging Face
tokenizer directly (the runners wrap the same tokenizer in mlx_lm's)."""

import os
from pathlib import Path
from typing import Any, Protocol

# Only the tokenizers are used: transformers' advice to install PyTorch is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import AutoTokenizer


class ChatTokenizer(Protocol):
    """What rendering a chat prompt needs of a tokenizer."""

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        **kwargs: Any,
    ) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def __len__(self) -> int: ...


def load_chat_tokenizer(model_dir: Path) -> ChatTokenizer:
    return AutoTokenizer.from_pretrained(model_dir)


def longest_token_bytes(tokenizer: ChatTokenizer) -> int:
    """An upper bound of the bytes of text one token stands for: its vocabulary
    entry's UTF-8 length (a byte-level entry spells each byte with one or two
    bytes, a byte-fallback one as `<0x0A>`: never fewer than it stands for)."""
    return max((len(entry.encode()) for entry in tokenizer.get_vocab()), default=1)
