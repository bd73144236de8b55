"""Load an MLX model folder for inference on this machine's backend."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

from exo.shared.types.state import MlxBackend


def backend_name() -> MlxBackend:
    """`metal`, `cuda` or `cpu`: where MLX runs by default here."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def load_for_inference(model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load weights and tokenizer; on the CPU backend dequantize to float32.

    MLX's CPU quantized matmul is far slower than float32 BLAS matmul, so on
    the CPU the memory cost of float32 weights buys ~100x speed.
    """
    model, config = load_model(model_dir)
    if backend_name() == "cpu":
        if "quantization" in config:
            logger.info("CPU backend: dequantizing weights to float32")
            model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
