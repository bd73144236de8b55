import pytest

from exo.shared.units import human_bytes

MB = 10**6


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1500, "1.5 KB"),
        (140 * MB, "140.0 MB"),
        (2_100_000_000, "2.1 GB"),
        (3 * 10**12, "3.0 TB"),
        (-1500, "-1.5 KB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text
