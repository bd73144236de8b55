"""What each tensor rank keeps of a layer (`engine/mlx/tensor.py`): the rows and
columns `shared/tensor_split.py` gives it, biases of partial sums on rank 0
only, quantized weights cut at whole groups. Slicing needs only the rank and
the rank count; the ring's `all_sum`s are tested with real ranks in
`tests/integration/test_tensor_ranks.py`."""

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model

from exo.engine.mlx.shard import UnsupportedShard
from exo.engine.mlx.tensor import shard_model
from tests.model_factory import make_tiny_model

# 6 query heads of 16 over 3 KV heads; an MLP of 131 columns (66/65 in two).
UNEVEN = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "intermediate_size": 131,
    "attention_bias": True,
}


class _Rank:
    """What slicing reads of an `mx.distributed.Group`."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _sliced(model_dir: Path, rank: int, size: int, group_size: int = 1) -> Any:
    model, _ = load_model(model_dir, lazy=True)
    shard_model(model, "llama", cast(mx.distributed.Group, _Rank(rank, size)), group_size)
    return cast(Any, model).layers[0]


@pytest.fixture(scope="module")
def uneven_llama(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("uneven") / "llama"
    return make_tiny_model("llama", target, smollm_dir, n_layers=1, overrides=UNEVEN)


def test_two_ranks_keep_whole_kv_heads_and_uneven_mlp_columns(uneven_llama: Path) -> None:
    whole = cast(Any, load_model(uneven_llama, lazy=True)[0]).layers[0]
    expected = {0: (4, 2, (0, 66)), 1: (2, 1, (66, 131))}
    for rank, (heads, kv_heads, (start, end)) in expected.items():
        layer = _sliced(uneven_llama, rank, 2)
        attention, mlp = layer.self_attn, layer.mlp
        assert (attention.n_heads, attention.n_kv_heads) == (heads, kv_heads)
        q0 = 0 if rank == 0 else 4 * 16
        k0 = 0 if rank == 0 else 2 * 16
        assert mx.array_equal(
            attention.q_proj.weight, whole.self_attn.q_proj.weight[q0 : q0 + heads * 16]
        )
        assert mx.array_equal(
            attention.k_proj.bias, whole.self_attn.k_proj.bias[k0 : k0 + kv_heads * 16]
        )
        assert mx.array_equal(
            attention.o_proj.block.weight,
            whole.self_attn.o_proj.weight[:, q0 : q0 + heads * 16],
        )
        assert mx.array_equal(mlp.gate_proj.weight, whole.mlp.gate_proj.weight[start:end])
        assert mx.array_equal(mlp.down_proj.block.weight, whole.mlp.down_proj.weight[:, start:end])
        # The output projection's bias is added once: by rank 0's part of the sum.
        assert ("bias" in attention.o_proj.block) == (rank == 0)


def test_three_ranks_take_one_kv_head_each(uneven_llama: Path) -> None:
    widths = [_sliced(uneven_llama, rank, 3).mlp.up_proj.weight.shape[0] for rank in range(3)]
    assert widths == [44, 44, 43]
    assert {_sliced(uneven_llama, rank, 3).self_attn.n_kv_heads for rank in range(3)} == {1}
    with pytest.raises(UnsupportedShard, match="4 ranks need 4 KV heads at least, it has 3"):
        _sliced(uneven_llama, 0, 4)


def test_quantized_columns_are_cut_at_whole_groups(smollm_dir: Path, tmp_path: Path) -> None:
    """A 4-bit layer keeps whole groups of 32 columns: its slice dequantizes to
    the same slice of the whole layer."""
    overrides = {**UNEVEN, "intermediate_size": 160}  # 5 groups: 3 and 2
    model_dir = make_tiny_model("llama", tmp_path / "llama", smollm_dir, 1, overrides=overrides)

    def quantized(rank: int | None) -> Any:
        model, _ = load_model(model_dir, lazy=True)
        nn.quantize(model, group_size=32, bits=4)
        if rank is not None:
            shard_model(model, "llama", cast(mx.distributed.Group, _Rank(rank, 2)), 32)
        return cast(Any, model).layers[0].mlp.down_proj

    def dense(layer: Any) -> mx.array:
        return mx.dequantize(layer.weight, layer.scales, layer.biases, 32, 4)

    whole = dense(quantized(None))
    for rank, (start, end) in enumerate(((0, 96), (96, 160))):
        assert mx.array_equal(dense(quantized(rank).block), whole[:, start:end])
    # 131 columns are no whole number of groups of 32: refused, not cut.
    with pytest.raises(UnsupportedShard, match="does not split into 2 parts of 32"):
        model, _ = load_model(
            make_tiny_model("llama", tmp_path / "odd", smollm_dir, 1, overrides=UNEVEN),
            lazy=True,
        )
        shard_model(model, "llama", cast(mx.distributed.Group, _Rank(0, 2)), 32)
