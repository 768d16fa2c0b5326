"""How byte counts are printed (``trtvocab plan``, ``build``, ``inspect``, ``compare``): binary units."""

from __future__ import annotations


def human_bytes(nbytes: int, digits: int | None = None) -> str:
    """``165478400`` -> ``'157.8 MiB'``, ``1323827200`` -> ``'1.23 GiB'``.

    ``digits`` None: one decimal below GiB, two from GiB; an int fixes the decimals for
    every unit above bytes (reports that compare sizes side by side use 2).
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"
            places = digits if digits is not None else (2 if unit in ("GiB", "TiB") else 1)
            return f"{value:.{places}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
