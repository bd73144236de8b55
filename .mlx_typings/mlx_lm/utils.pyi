from pathlib import Path
from typing import Any, TypeVar

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

def load_model(
    model_path: Path,
    lazy: bool = ...,
    strict: bool = ...,
    model_config: dict[str, Any] | None = ...,
    trust_remote_code: bool = ...,
) -> tuple[nn.Module, dict[str, Any]]: ...
def load_tokenizer(
    model_path: Path,
    tokenizer_config_extra: dict[str, Any] | None = ...,
    eos_token_ids: int | list[int] | None = ...,
) -> TokenizerWrapper: ...
_M = TypeVar("_M", bound=nn.Module)

def load_config(model_path: Path) -> dict[str, Any]: ...
def dequantize_model(model: _M) -> _M: ...
