"""Load an MLX model folder for inference on this machine's backend."""

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_model, load_tokenizer

from exo.engine.mlx.backend import backend_name
from exo.engine.mlx.cpu_attention import use_kernel_for_attention
from exo.engine.mlx.cpu_few_rows import eager_rows, use_kernel_for_few_rows

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def dequantized_f32(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """A quantized weight as float32: `scale * q + bias` per group, computed in
    float32 with elementwise ops, which on the CPU is 2-3x faster than
    `mx.dequantize` (and exact where that rounds to the scales' float16). Other
    modes and bit widths go through `mx.dequantize`."""
    if mode != "affine" or biases is None or 32 % bits:
        return mx.dequantize(weight, scales, biases, group_size, bits, mode).astype(mx.float32)
    # Element j of a packed uint32 holds bits [j * bits, (j + 1) * bits).
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    values = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.float32)
    values = values.reshape(*weight.shape[:-1], -1, group_size)
    values = values * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return values.reshape(*weight.shape[:-1], -1)


def dequantize_f32(model: ModuleT, only: Callable[[str], bool] = lambda name: True) -> ModuleT:
    """Replace the quantized layers of `model` (those whose weight's name passes
    `only`) by float32 ones, evaluated one at a time (peak memory: one layer's
    intermediates)."""
    replaced: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(
            module, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear
        ) or not only(f"{name}.weight"):
            continue
        weight = dequantized_f32(
            module.weight,
            module.scales,
            module.get("biases"),
            module.group_size,
            module.bits,
            module.mode,
        )
        mx.eval(weight)
        bias = "bias" in module
        plain: nn.Module
        if isinstance(module, nn.QuantizedEmbedding):
            plain = nn.Embedding(weight.shape[0], weight.shape[1])
        elif isinstance(module, QuantizedSwitchLinear):
            plain = SwitchLinear(weight.shape[-1], weight.shape[-2], weight.shape[0], bias=bias)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        plain.weight = weight
        if bias:
            plain["bias"] = module["bias"]
        replaced.append((name, plain))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def prepare_for_backend(
    model: ModuleT, config: dict[str, Any], evaluate: Callable[[str], bool] = lambda name: True
) -> ModuleT:
    """On the CPU backend dequantize to float32 and multiply decode steps' few
    rows by a kernel that reads each weight once (`cpu_few_rows`), their
    attention by another (`cpu_attention`); then evaluate
    the weights whose names pass `evaluate` (a pipeline rank's: the others stay
    lazy, never read).

    MLX's CPU quantized matmul is far slower than float32 BLAS matmul, so on
    the CPU the memory cost of float32 weights buys ~100x speed.
    """
    if backend_name() == "cpu":
        if "quantization" in config:
            logger.info("CPU backend: dequantizing weights to float32")
            model = dequantize_f32(model, evaluate)
        model.set_dtype(mx.float32)
        use_kernel_for_few_rows(model)
        if eager_rows(model):  # the kernel could be had
            use_kernel_for_attention(model)
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    mx.eval([array for name, array in parameters if evaluate(name)], _private_arrays(model))
    return model


def _private_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays a module computes for itself (`_freqs` of a RoPE): not parameters,
    so evaluated nowhere else, and left lazy they tie the graph to the stream of
    the thread that loaded the model, which another thread cannot evaluate."""
    return [
        value
        for _, module in model.named_modules()
        for key, value in module.items()
        if key.startswith("_") and isinstance(value, mx.array)
    ]


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
