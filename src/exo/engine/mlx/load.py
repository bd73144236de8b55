"""Load an MLX model folder for inference on this machine's backend."""

from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_config, load_model, load_tokenizer

from exo.engine.mlx.backend import backend_name

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def prepare_for_backend(model: ModuleT, config: dict[str, Any]) -> ModuleT:
    """On the CPU backend dequantize to float32; then evaluate the weights.

    MLX's CPU quantized matmul is far slower than float32 BLAS matmul, so on
    the CPU the memory cost of float32 weights buys ~100x speed.
    """
    if backend_name() == "cpu":
        if "quantization" in config:
            logger.info("CPU backend: dequantizing weights to float32")
            model = dequantize_model(model)
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def parameter_bytes(model: nn.Module) -> int:
    arrays = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(array.nbytes for _, array in arrays)


def load_model_tokenizer(model_dir: Path) -> TokenizerWrapper:
    config = load_config(model_dir)
    return load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))


def load_for_inference(model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load weights and tokenizer, prepared for this backend."""
    model, config = load_model(model_dir)
    return prepare_for_backend(model, config), load_model_tokenizer(model_dir)
