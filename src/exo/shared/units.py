"""Sizes as users read them."""


def human_bytes(n: int) -> str:
    """Decimal units with one decimal, as disk and RAM sizes are sold: "2.1 GB"."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
