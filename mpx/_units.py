"""Numbers as people read them."""

from __future__ import annotations


def human_size(n: float) -> str:
    """``n`` bytes as '512 B', '1.5 KiB', '16.0 MiB', '2.0 GiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
