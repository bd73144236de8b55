"""How tensor ranks divide a layer: attention by whole KV heads (each with the
query heads that read it), MLP and expert widths by columns, as evenly as they
go, the first ranks taking what is left over. A quantized weight is cut only at
its quantization groups, so the blocks a split moves are whole groups.

Placement (each node's memory, what is refused) and the runner (which rows and
columns a rank keeps) compute the split alike from the model's sizes, so the
master and every rank agree without sending it. Families whose slicing is
mlx-lm's own `shard()` need even splits (`even_only`): it divides by the rank
count."""

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from exo.shared.architectures import EXO_TENSOR_STRATEGIES
from exo.shared.types.model_card import ModelCard


def shares(total: int, ranks: int, unit: int = 1) -> tuple[int, ...] | None:
    """`total` in `ranks` positive parts, each a multiple of `unit`, no two more
    than a unit apart, the larger first; None when there are fewer units than
    ranks or `total` is not whole units."""
    if ranks < 1 or unit < 1 or total % unit:
        return None
    units, extra = divmod(total // unit, ranks)
    if units == 0:
        return None
    return tuple((units + (rank < extra)) * unit for rank in range(ranks))


def bounds(parts: tuple[int, ...], rank: int) -> tuple[int, int]:
    """The [start, end) of part `rank` of `parts` laid end to end."""
    start = sum(parts[:rank])
    return start, start + parts[rank]


def head_unit(n_heads: int, n_kv_heads: int, head_dim: int, group_size: int) -> int:
    """The fewest KV heads a rank's share is a multiple of: whole KV heads whose
    query heads' columns of the output projection are whole quantization groups."""
    per_kv_head = (n_heads // n_kv_heads) * head_dim
    unit = 1
    while (unit * per_kv_head) % group_size and unit < n_kv_heads:
        unit += 1
    return unit


@dataclass(frozen=True)
class TensorSplit:
    """Each rank's KV heads, query heads and MLP widths (None: unknown, not split here)."""

    ranks: int
    kv_heads: tuple[int, ...] | None
    heads: tuple[int, ...] | None
    widths: Mapping[str, tuple[int, ...]]

    def weight_share(self, rank: int) -> Fraction:
        """The largest fraction of any split part this rank holds: what it
        holds of a layer's weights at most."""
        parts = [p for p in (self.heads, *self.widths.values()) if p is not None]
        if not parts:
            return Fraction(1, self.ranks)
        return max(Fraction(p[rank], sum(p)) for p in parts)

    def kv_share(self, rank: int) -> Fraction:
        """The fraction of a layer's keys and values this rank holds (its KV heads')."""
        if self.kv_heads is None:
            return Fraction(1, self.ranks)
        return Fraction(self.kv_heads[rank], sum(self.kv_heads))


def split_layers(
    ranks: int,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    widths: Mapping[str, int | None],
    group_size: int = 1,
    even_only: bool = False,
) -> TensorSplit | str:
    """How `ranks` tensor ranks divide layers of these sizes, or why they cannot
    (a sentence). A size of 0 or None is not known here and not checked."""
    known = {name: total for name, total in widths.items() if total}
    if even_only:
        return _even_split(ranks, n_heads, n_kv_heads, known)
    problems: list[str] = []
    kv_split = heads_split = None
    if n_heads and n_kv_heads:
        kv_unit = head_unit(n_heads, n_kv_heads, head_dim, group_size)
        if n_heads % n_kv_heads:
            problems.append(
                f"its {n_heads} attention heads do not group over {n_kv_heads} KV heads"
            )
        elif (kv_split := shares(n_kv_heads, ranks, kv_unit)) is None:
            problems.append(
                f"{ranks} ranks need {ranks * kv_unit} KV heads at least"
                + (f" (each {kv_unit}, for whole quantization groups)" if kv_unit > 1 else "")
                + f", it has {n_kv_heads}"
            )
        else:
            heads_split = tuple(kv * (n_heads // n_kv_heads) for kv in kv_split)
    width_splits: dict[str, tuple[int, ...]] = {}
    for name, total in known.items():
        if (split := shares(total, ranks, group_size)) is None:
            problems.append(
                f"its {name} ({total}) does not split into {ranks} parts"
                + (f" of whole quantization groups ({group_size})" if group_size > 1 else "")
            )
        else:
            width_splits[name] = split
    if problems:
        return "; ".join(problems)
    return TensorSplit(ranks=ranks, kv_heads=kv_split, heads=heads_split, widths=width_splits)


def _even_split(
    ranks: int, n_heads: int, n_kv_heads: int, widths: Mapping[str, int]
) -> TensorSplit | str:
    """mlx-lm's `shard()`: every size divided by `ranks`."""
    sizes = {"attention heads": n_heads, "KV heads": n_kv_heads, **widths}
    uneven = [f"{name} ({size})" for name, size in sizes.items() if size and size % ranks]
    if uneven:
        return f"{ranks} does not divide its {', '.join(uneven)}"
    equal = {name: (size // ranks,) * ranks for name, size in widths.items()}
    kv = (n_kv_heads // ranks,) * ranks if n_kv_heads else None
    heads = (n_heads // ranks,) * ranks if n_heads else None
    return TensorSplit(ranks=ranks, kv_heads=kv, heads=heads, widths=equal)


def card_split(card: ModelCard, ranks: int) -> TensorSplit | str:
    """How `ranks` tensor ranks divide `card`'s layers, or why they cannot."""
    return split_layers(
        ranks,
        n_heads=card.n_heads,
        n_kv_heads=card.n_kv_heads,
        head_dim=card.head_dim,
        widths={
            "MLP intermediate size": card.intermediate_size,
            "MoE expert intermediate size": card.moe_intermediate_size,
        },
        group_size=card.quantization.group_size if card.quantization is not None else 1,
        even_only=card.architecture not in EXO_TENSOR_STRATEGIES,
    )
