"""How quantities are printed (``trtvocab plan``, ``build``, ``inspect``, ``compare``).

Bytes held in memory in binary units (MiB, GiB); bytes that travel at a link's GB/s in
decimal units (MB, GB); times and FLOPs with three significant digits.
"""

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


def decimal_bytes(nbytes: int) -> str:
    """``83886080`` -> ``'83.9 MB'``: decimal units (1000), for figures that travel at GB/s.

    Same shape as :func:`human_bytes` (one decimal below GB, two from GB).
    """
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.{2 if unit in ('GB', 'TB') else 1}f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _sig3(value: float) -> str:
    """Three significant digits, never in exponent form (``999.7`` -> ``'1000'``)."""
    return f"{value:.3g}" if abs(value) < 999.5 else f"{value:.0f}"


def human_seconds(seconds: float) -> str:
    """``0.000193`` -> ``'193 us'``: the largest of s / ms / us / ns that keeps the value >= 1, 3 significant."""
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{_sig3(seconds / scale)} {unit}"
    return f"{_sig3(seconds / 1e-9)} ns"


def human_flops(flops: int) -> str:
    """``338894028800`` -> ``'339 GFLOP'`` (decimal prefixes, 3 significant digits)."""
    value = float(flops)
    for unit in ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"):
        if value < 1000 or unit == "PFLOP":
            return f"{_sig3(value)} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
