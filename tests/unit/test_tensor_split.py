"""How tensor ranks divide a layer: whole KV heads with their query heads, MLP
widths in whole quantization groups, as evenly as they go."""

from fractions import Fraction

import pytest

from exo.shared.tensor_split import (
    TensorSplit,
    bounds,
    card_split,
    head_unit,
    shares,
    split_layers,
)
from tests.unit.test_placement import card


@pytest.mark.parametrize(
    ("total", "ranks", "unit", "expected"),
    [
        (8, 2, 1, (4, 4)),
        (10, 3, 1, (4, 3, 3)),
        (128, 3, 1, (43, 43, 42)),
        (128, 3, 32, (64, 32, 32)),
        (1536, 2, 64, (768, 768)),
        (3, 4, 1, None),  # fewer units than ranks
        (100, 2, 32, None),  # not whole units
        (64, 3, 32, None),
    ],
)
def test_shares_are_whole_units_the_first_ranks_take_the_rest(
    total: int, ranks: int, unit: int, expected: tuple[int, ...] | None
) -> None:
    parts = shares(total, ranks, unit)
    assert parts == expected
    if parts is not None:
        assert sum(parts) == total and max(parts) - min(parts) <= unit


def test_bounds_lay_the_parts_end_to_end() -> None:
    assert [bounds((4, 3, 3), rank) for rank in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_a_head_unit_keeps_the_output_projections_groups_whole() -> None:
    assert head_unit(32, 8, 128, 64) == 1  # 4 heads of 128 a KV head: 8 groups
    assert head_unit(8, 4, 8, 32) == 2  # 2 heads of 8 a KV head: 16 columns, half a group
    assert head_unit(8, 8, 8, 64) == 8
    assert head_unit(9, 3, 64, 1) == 1


def test_smollm2_splits_in_two_by_whole_kv_heads() -> None:
    """9 query heads over 3 KV heads: rank 0 holds 2 KV heads and their 6 query
    heads, rank 1 the third and its 3; the MLP halves."""
    split = split_layers(
        2, n_heads=9, n_kv_heads=3, head_dim=64, widths={"MLP intermediate size": 1536}
    )
    assert isinstance(split, TensorSplit)
    assert (split.kv_heads, split.heads) == ((2, 1), (6, 3))
    assert split.widths == {"MLP intermediate size": (768, 768)}
    assert [split.weight_share(rank) for rank in (0, 1)] == [Fraction(2, 3), Fraction(1, 2)]
    assert [split.kv_share(rank) for rank in (0, 1)] == [Fraction(2, 3), Fraction(1, 3)]


@pytest.mark.parametrize(
    ("ranks", "sizes", "message"),
    [
        (
            4,
            {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64},
            "4 ranks need 4 KV heads at least, it has 3",
        ),
        (
            4,
            {"n_heads": 8, "n_kv_heads": 4, "head_dim": 8, "group_size": 32},
            "4 ranks need 8 KV heads at least (each 2, for whole quantization groups), it has 4",
        ),
        (
            2,
            {"n_heads": 8, "n_kv_heads": 8, "head_dim": 64, "group_size": 32, "width": 100},
            "its MLP intermediate size (100) does not split into 2 parts of whole "
            "quantization groups (32)",
        ),
        (2, {"n_heads": 6, "n_kv_heads": 4, "head_dim": 64}, "6 attention heads do not group"),
    ],
)
def test_a_split_that_does_not_go_says_why(ranks: int, sizes: dict[str, int], message: str) -> None:
    split = split_layers(
        ranks,
        n_heads=sizes["n_heads"],
        n_kv_heads=sizes["n_kv_heads"],
        head_dim=sizes["head_dim"],
        widths={"MLP intermediate size": sizes.get("width")},
        group_size=sizes.get("group_size", 1),
    )
    assert isinstance(split, str) and message in split


def test_unknown_sizes_are_not_split_here() -> None:
    split = split_layers(3, n_heads=0, n_kv_heads=0, head_dim=0, widths={"MLP": None})
    assert split == TensorSplit(ranks=3, kv_heads=None, heads=None, widths={})
    assert isinstance(split, TensorSplit)
    assert split.weight_share(0) == split.kv_share(2) == Fraction(1, 3)


def test_mlx_lms_shard_families_split_evenly_only() -> None:
    """A family exo does not slice itself is split by mlx-lm's `shard()`, which
    divides every size by the rank count."""
    sizes = {"n_heads": 32, "n_kv_heads": 8, "intermediate_size": 14336, "head_dim": 128}
    assert isinstance(card_split(card(architecture="llama", **sizes), 3), TensorSplit)
    assert card_split(card(architecture="gpt_oss", **sizes), 3) == (
        "3 does not divide its attention heads (32), KV heads (8), MLP intermediate size (14336)"
    )
    even = card_split(card(architecture="gpt_oss", **sizes), 2)
    assert isinstance(even, TensorSplit) and even.heads == (16, 16)


def test_a_card_splits_by_its_quantization_groups() -> None:
    """`card()` is 4-bit with groups of 32: 3 ranks take 14336 columns as
    448 groups, 150/149/149 of them."""
    model = card(n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=14336)
    split = card_split(model, 3)
    assert isinstance(split, TensorSplit)
    assert split.widths["MLP intermediate size"] == (4800, 4768, 4768)
    assert split.kv_heads == (3, 3, 2) and split.heads == (12, 12, 8)
    assert split.weight_share(0) == Fraction(3, 8)
