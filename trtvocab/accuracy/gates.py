"""CI gates on the teacher-forced statistics: a variant passes when every threshold set holds.

``max_kld_mean X``  mean KL(base || Q) <= X (nats)
``min_same_top Y``  fraction of rows whose argmax is the baseline's >= Y (a fraction, not percent)
``max_ppl_ratio Z`` PPL(Q) / PPL(base) <= Z

Errors and failure lines name each threshold by its field (`` `max_kld_mean` ``); the command line
spells it as its flag.

Gates read the block of rows with a next token (``next_token_ids`` in the hidden file);
a variant without one cannot be judged, which is an error, never a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trtvocab.errors import ConfigError, InputError


@dataclass(frozen=True)
class Gates:
    """Thresholds (``None`` = not gated)."""

    max_kld_mean: float | None = None
    min_same_top: float | None = None
    max_ppl_ratio: float | None = None

    def __post_init__(self) -> None:
        for option, value, lo, hi in (("max_kld_mean", self.max_kld_mean, 0.0, math.inf),
                                      ("min_same_top", self.min_same_top, 0.0, 1.0),
                                      ("max_ppl_ratio", self.max_ppl_ratio, 0.0, math.inf)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not lo <= value <= hi:
                raise ConfigError(f"`{option}`: must be a finite number in [{lo:g}, {hi:g}], got {value!r}"
                                  + (" (a fraction, not percent)" if option == "min_same_top" else ""))

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_kld_mean, self.min_same_top, self.max_ppl_ratio))

    def failures(self, name: str, stats: Any) -> list[str]:
        """One line per missed gate of the variant ``name`` (``stats``: its LlamaCppStats or None)."""
        if not self.active:
            return []
        if stats is None:
            raise InputError(f"{name}: gates need teacher-forced rows (a hidden file with next_token_ids, "
                             "written by `trtvocab hidden` for a causal LM, compared with `all_tokens`)")
        out = []
        if self.max_kld_mean is not None and not stats.kld_mean <= self.max_kld_mean:
            out.append(f"gate failed: {name}: KLD mean {stats.kld_mean:.6g} > `max_kld_mean` {self.max_kld_mean:g}")
        if self.min_same_top is not None and not stats.same_top >= self.min_same_top:
            out.append(f"gate failed: {name}: same top {stats.same_top:.6g} < `min_same_top` {self.min_same_top:g}")
        if self.max_ppl_ratio is not None and not stats.ppl_ratio <= self.max_ppl_ratio:
            out.append(f"gate failed: {name}: PPL ratio {stats.ppl_ratio:.6g} > `max_ppl_ratio` "
                       f"{self.max_ppl_ratio:g}")
        return out


def check_gates(report: Any, gates: Gates) -> list[str]:
    """Every missed gate of every variant of a :class:`trtvocab.accuracy.compare.CompareReport`, one line each."""
    lines: list[str] = []
    for v in report.variants:
        lines += gates.failures(v.name, v.llamacpp)
    return lines


__all__ = ["Gates", "check_gates"]
