"""The README's architecture table says what the code does: which model types
load whole, which split into pipeline ranks and which into tensor ranks, and it
lists every one that does not split into pipeline ranks, with the reason the
code gives."""

import re
from collections.abc import Callable
from pathlib import Path

from exo.shared.architectures import (
    loadable_whole,
    mlx_lm_architectures,
    pipeline_refusal,
    tensor_refusal,
)

README = Path(__file__).resolve().parents[2] / "README.md"
_SPLIT = r"(yes|no: [^|]+)"
_ROW = re.compile(rf"^\| (`[^|]+`)[^|]*\| (yes|no) \| {_SPLIT} \| {_SPLIT} \|$")


def table() -> dict[str, tuple[bool, str, str]]:
    """Architecture -> (whole, pipeline cell, tensor cell), from the README."""
    rows: dict[str, tuple[bool, str, str]] = {}
    for line in README.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            for name in re.findall(r"`([^`]+)`", match.group(1)):
                rows[name] = (match.group(2) == "yes", match.group(3), match.group(4))
    return rows


def says_what_the_code_does(
    architecture: str, cell: str, refusal_of: Callable[[str], str | None]
) -> None:
    refusal = refusal_of(architecture)
    if cell == "yes":
        assert refusal is None, (architecture, refusal)
    else:
        assert refusal is not None, architecture
        assert cell.removeprefix("no: ").strip() in refusal, (architecture, refusal)


def test_every_row_says_what_the_code_does() -> None:
    rows = table()
    assert len(rows) > 20
    for architecture, (whole, pipeline, tensor) in rows.items():
        assert loadable_whole(architecture) == whole, architecture
        says_what_the_code_does(architecture, pipeline, pipeline_refusal)
        says_what_the_code_does(architecture, tensor, tensor_refusal)


def test_every_architecture_that_does_not_split_is_in_the_table() -> None:
    refused = {a for a in mlx_lm_architectures() if pipeline_refusal(a) is not None}
    assert refused <= set(table())


def test_the_readme_counts_are_the_code_s() -> None:
    known = mlx_lm_architectures()
    splitting = [a for a in known if pipeline_refusal(a) is None]
    by_tensors = [a for a in known if tensor_refusal(a) is None]
    text = README.read_text()
    assert f"Of the {len(known)} model types mlx-lm" in text
    assert f", {len(splitting)} split." in text
    assert f"By tensors, {len(by_tensors)} split" in text
