"""Numbers as people read them."""

from __future__ import annotations


def human_size(n: float) -> str:
    """``n`` bytes as '512 B', '64 KiB', '1.5 KiB', '16 MiB', '2.3 GiB' (a whole number of
    its unit without decimals)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if size.is_integer() else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
