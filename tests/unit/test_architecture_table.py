"""The README's architecture table says what the code does: which model types
load whole and which split into pipeline ranks, and it lists every one that
does not split, with the reason the code gives."""

import re
from pathlib import Path

from exo.shared.architectures import loadable_whole, mlx_lm_architectures, pipeline_refusal

README = Path(__file__).resolve().parents[2] / "README.md"
_ROW = re.compile(r"^\| (`[^|]+`)[^|]*\| (yes|no) \| (yes|no: [^|]+) \|$")


def table() -> dict[str, tuple[bool, str]]:
    """Architecture -> (whole, pipeline cell), from the README."""
    rows: dict[str, tuple[bool, str]] = {}
    for line in README.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            for name in re.findall(r"`([^`]+)`", match.group(1)):
                rows[name] = (match.group(2) == "yes", match.group(3))
    return rows


def test_every_row_says_what_the_code_does() -> None:
    rows = table()
    assert len(rows) > 20
    for architecture, (whole, pipeline) in rows.items():
        assert loadable_whole(architecture) == whole, architecture
        refusal = pipeline_refusal(architecture)
        if pipeline == "yes":
            assert refusal is None, (architecture, refusal)
        else:
            assert refusal is not None, architecture
            assert pipeline.removeprefix("no: ").strip() in refusal, (architecture, refusal)


def test_every_architecture_that_does_not_split_is_in_the_table() -> None:
    refused = {a for a in mlx_lm_architectures() if pipeline_refusal(a) is not None}
    assert refused <= set(table())


def test_the_readme_counts_are_the_code_s() -> None:
    known = mlx_lm_architectures()
    splitting = [a for a in known if pipeline_refusal(a) is None]
    text = README.read_text()
    assert f"Of the {len(known)} model types mlx-lm" in text
    assert f", {len(splitting)} split." in text
