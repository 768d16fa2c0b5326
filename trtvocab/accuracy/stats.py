"""The KL-divergence statistics of llama.cpp's ``llama-perplexity``, in float64 over the full vocabulary.

Per row with a next token: the NLLs (PPL), KL(base || Q) over every token, KL(Q || base) and
JSD, EAR, Δp and same-top; the summary uses llama.cpp's formulas for ± and percentiles, plus a
bootstrap 95 % interval per mean (``DEFAULT_BOOTSTRAP`` resamples, ``DEFAULT_SEED``). The
formulas and the two deliberate differences from llama.cpp (exact KLD; ± from n >= 2) are in
docs/accuracy.md, "The teacher-forced block".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from trtvocab.errors import ConfigError, InputError

DEFAULT_BOOTSTRAP = 1000
DEFAULT_SEED = 0
# Bounds of the bootstrap options: the means of every resample are kept ([resamples, k] float64), so a
# billion resamples would ask for ~75 GiB; 10**5 resamples already put the 2.5 / 97.5 percentiles within
# a fraction of a standard error of where 10**7 would. Seeds are numpy's: non-negative, here below 2**63.
MAX_BOOTSTRAP = 100_000
MAX_SEED = 2**63 - 1


def check_bootstrap(bootstrap: object, seed: object) -> None:
    """``bootstrap`` an int in ``[0, MAX_BOOTSTRAP]``, ``seed`` an int in ``[0, MAX_SEED]``
    (:class:`ConfigError` naming the option and the range)."""
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or not 0 <= bootstrap <= MAX_BOOTSTRAP:
        raise ConfigError(f"`bootstrap`: resamples must be an int in [0, {MAX_BOOTSTRAP}] (MAX_BOOTSTRAP; each "
                          f"resample's means are kept), got {bootstrap!r:.40}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"`seed`: the bootstrap seed must be an int in [0, 2**63 - 1], got {seed!r:.40}")
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DP_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)
_BOOT_BYTES = 1 << 26  # resample-count matrix held per batch of bootstrap draws


# ---- per-row numbers -----------------------------------------------------------------------------
@dataclass
class TokenRows:
    """Per-row float64 numbers of one variant against the baseline (rows with a next token only)."""

    nll_q: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    kl_rev: np.ndarray
    js: np.ndarray
    ear: np.ndarray
    dp: np.ndarray
    same_top: np.ndarray  # bool

    @property
    def n(self) -> int:
        return int(self.nll_q.shape[0])

    @classmethod
    def concat(cls, parts: list[TokenRows]) -> TokenRows:
        if not parts:
            return cls(*(np.zeros(0, dtype=bool if f.name == "same_top" else np.float64) for f in fields(cls)))
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))


def token_rows(lb: torch.Tensor, lq: torch.Tensor, next_ids: torch.Tensor,
               arg_b: torch.Tensor | None = None, arg_q: torch.Tensor | None = None) -> TokenRows:
    """:class:`TokenRows` of the rows of float64 log-softmax ``lb``, ``lq [N, V]`` whose ``next_ids >= 0``.

    ``arg_b`` / ``arg_q`` (the argmax of the logits, if already known) default to the
    log-softmax's argmax, which is the same token.
    """
    keep = next_ids >= 0
    if not bool(keep.any()):
        return TokenRows.concat([])
    if not bool(keep.all()):
        lb, lq, next_ids = lb[keep], lq[keep], next_ids[keep]
        arg_b = None if arg_b is None else arg_b[keep]
        arg_q = None if arg_q is None else arg_q[keep]
    arg_b = lb.argmax(-1) if arg_b is None else arg_b
    arg_q = lq.argmax(-1) if arg_q is None else arg_q
    pb, pq = lb.exp(), lq.exp()
    zero = torch.zeros((), dtype=lb.dtype)
    # p log(p / q) with 0 log 0 = 0 (an underflowed probability contributes nothing).
    kld = torch.where(pb > 0, pb * (lb - lq), zero).sum(-1)
    kl_rev = torch.where(pq > 0, pq * (lq - lb), zero).sum(-1)
    lm = torch.logaddexp(lb, lq) - math.log(2.0)
    js = 0.5 * (torch.where(pb > 0, pb * (lb - lm), zero).sum(-1) + torch.where(pq > 0, pq * (lq - lm), zero).sum(-1))
    ear = torch.minimum(pb, pq).sum(-1)
    idx = next_ids.long().unsqueeze(-1)
    tb, tq = lb.gather(-1, idx).squeeze(-1), lq.gather(-1, idx).squeeze(-1)
    return TokenRows(nll_q=(-tq).numpy(), nll_base=(-tb).numpy(), kld=kld.clamp_min(0.0).numpy(),
                     kl_rev=kl_rev.clamp_min(0.0).numpy(), js=js.clamp_min(0.0).numpy(),
                     ear=ear.clamp(0.0, 1.0).numpy(), dp=(tq.exp() - tb.exp()).numpy(),
                     same_top=(arg_b == arg_q).numpy())


# ---- llama.cpp's formulas ------------------------------------------------------------------------
def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    """``(mean, sqrt((mean(x^2) - mean^2) / (n - 1)))``; ± 0 when the variance is not positive, NaN for n < 2."""
    n = x.shape[0]
    if n == 0:
        return math.nan, math.nan
    mean = float(np.sum(x) / n)
    if n < 2:
        return mean, math.nan
    var = float(np.sum(x * x) / n) - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 else 0.0


def covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    """``(mean(ab) - mean(a) mean(b)) / (n - 1)``: the covariance of the two means."""
    n = a.shape[0]
    if n < 2:
        return math.nan
    return (float(np.sum(a * b) / n) - float(np.sum(a) / n) * float(np.sum(b) / n)) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation at ``fraction * (n - 1)`` of ascending ``sorted_values``."""
    n = sorted_values.shape[0]
    if n == 0:
        return math.nan
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    pos = fraction * (n - 1)
    lo = int(pos)
    frac = pos - lo
    hi = min(lo + 1, n - 1)
    return float((1 - frac) * sorted_values[lo] + frac * sorted_values[hi])


def bootstrap_means(columns: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, k]`` means of ``columns [n, k]`` over rows resampled with replacement (fixed seed)."""
    n = columns.shape[0]
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, columns.shape[1]), dtype=np.float64)
    batch = max(1, min(n_boot, _BOOT_BYTES // (8 * max(n, 1))))
    uniform = np.full(n, 1.0 / n)
    for start in range(0, n_boot, batch):
        size = min(batch, n_boot - start)
        counts = rng.multinomial(n, uniform, size=size).astype(np.float64)  # [size, n] draws of each row
        out[start:start + size] = counts @ columns / n
    return out


def _interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class LlamaCppStats:
    """One variant's teacher-forced statistics (probabilities as fractions; see the module docstring).

    ``*_pm`` is llama.cpp's ± (one standard error); ``ci95`` maps a statistic to its
    bootstrap 95 % interval ``(low, high)``.
    """

    n: int
    ppl_q: float
    ppl_q_pm: float
    ppl_base: float
    ppl_base_pm: float
    cor_ln_ppl: float
    ln_ppl_ratio: float
    ln_ppl_ratio_pm: float
    ppl_ratio: float
    ppl_ratio_pm: float
    ppl_diff: float
    ppl_diff_pm: float
    kld_mean: float
    kld_mean_pm: float
    kld_max: float
    kld_p999: float
    kld_p99: float
    kld_p95: float
    kld_p90: float
    kld_median: float
    kld_p10: float
    kld_p05: float
    kld_p01: float
    kld_p001: float
    kld_min: float
    dp_mean: float
    dp_mean_pm: float
    dp_max: float
    dp_p999: float
    dp_p99: float
    dp_p95: float
    dp_p90: float
    dp_p75: float
    dp_median: float
    dp_p25: float
    dp_p10: float
    dp_p05: float
    dp_p01: float
    dp_p001: float
    dp_min: float
    dp_rms: float
    dp_rms_pm: float
    same_top: float
    same_top_pm: float
    ear: float
    ear_pm: float
    kl_rev_mean: float
    kl_rev_mean_pm: float
    js_mean: float
    js_mean_pm: float
    ci95: dict[str, tuple[float, float]]
    bootstrap: int
    seed: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN / inf become ``None``; ``ci95`` values are ``[low, high]``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "ci95":
                out[f.name] = {k: [_finite(lo), _finite(hi)] for k, (lo, hi) in value.items()}
            else:
                out[f.name] = _finite(value) if isinstance(value, float) else value
        return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# The means the bootstrap resamples, and how each interval is read off them.
_BOOT_COLUMNS = ("nll_q", "nll_base", "ln_ratio", "kld", "dp", "dp2", "same_top", "ear", "kl_rev", "js")


def llamacpp_stats(rows: TokenRows, *, bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = DEFAULT_SEED) -> LlamaCppStats:
    """llama.cpp's statistics (and EAR, KL(Q || base), JS, bootstrap intervals) of ``rows``."""
    n = rows.n
    if n == 0:
        raise InputError("teacher-forced statistics need at least one row with a next token")
    check_bootstrap(bootstrap, seed)
    nll_q, nll_b = rows.nll_q, rows.nll_base
    lq, lq_pm = mean_and_uncertainty(nll_q)
    lb, lb_pm = mean_and_uncertainty(nll_b)
    cov = covariance_of_means(nll_q, nll_b)
    ppl_q, ppl_b = math.exp(lq), math.exp(lb)
    ppl_q_pm, ppl_b_pm = ppl_q * lq_pm, ppl_b * lb_pm
    cor = cov / (lq_pm * lb_pm) if lq_pm > 0 and lb_pm > 0 else math.nan
    ln_ratio = lq - lb
    ln_ratio_pm = math.sqrt(max(lq_pm ** 2 + lb_pm ** 2 - 2.0 * cov, 0.0)) if n >= 2 else math.nan
    ratio = math.exp(ln_ratio)
    diff_pm = (math.sqrt(max(ppl_q_pm ** 2 + ppl_b_pm ** 2 - 2.0 * ppl_q * ppl_b * cov, 0.0))
               if n >= 2 else math.nan)
    kld_sorted, dp_sorted = np.sort(rows.kld), np.sort(rows.dp)
    kld_mean, kld_pm = mean_and_uncertainty(rows.kld)
    dp_mean, dp_pm = mean_and_uncertainty(rows.dp)
    mse, mse_pm = mean_and_uncertainty(rows.dp * rows.dp)
    rms = math.sqrt(mse)
    rms_pm = 0.5 / rms * mse_pm if rms > 0 else (0.0 if n >= 2 else math.nan)
    same = float(np.count_nonzero(rows.same_top)) / n
    same_pm = math.sqrt(same * (1 - same) / (n - 1)) if n >= 2 else math.nan
    ear, ear_pm = mean_and_uncertainty(rows.ear)
    kl_rev, kl_rev_pm = mean_and_uncertainty(rows.kl_rev)
    js, js_pm = mean_and_uncertainty(rows.js)
    kp = {f: percentile(kld_sorted, f) for f in KLD_PERCENTILES}
    dq = {f: percentile(dp_sorted, f) for f in DP_PERCENTILES}
    ci: dict[str, tuple[float, float]] = {}
    if bootstrap > 0:
        columns = np.stack([nll_q, nll_b, nll_q - nll_b, rows.kld, rows.dp, rows.dp * rows.dp,
                            rows.same_top.astype(np.float64), rows.ear, rows.kl_rev, rows.js], axis=1)
        boot = bootstrap_means(columns, bootstrap, seed)
        col = {name: boot[:, i] for i, name in enumerate(_BOOT_COLUMNS)}
        ci = {"ppl_q": _interval(np.exp(col["nll_q"])), "ppl_base": _interval(np.exp(col["nll_base"])),
              "ln_ppl_ratio": _interval(col["ln_ratio"]), "ppl_ratio": _interval(np.exp(col["ln_ratio"])),
              "kld_mean": _interval(col["kld"]), "dp_mean": _interval(col["dp"]),
              "dp_rms": _interval(np.sqrt(col["dp2"])), "same_top": _interval(col["same_top"]),
              "ear": _interval(col["ear"]), "kl_rev_mean": _interval(col["kl_rev"]), "js_mean": _interval(col["js"])}
    return LlamaCppStats(
        n=n, ppl_q=ppl_q, ppl_q_pm=ppl_q_pm, ppl_base=ppl_b, ppl_base_pm=ppl_b_pm, cor_ln_ppl=cor,
        ln_ppl_ratio=ln_ratio, ln_ppl_ratio_pm=ln_ratio_pm, ppl_ratio=ratio, ppl_ratio_pm=ratio * ln_ratio_pm,
        ppl_diff=ppl_q - ppl_b, ppl_diff_pm=diff_pm,
        kld_mean=kld_mean, kld_mean_pm=kld_pm, kld_max=float(kld_sorted[-1]), kld_p999=kp[0.999], kld_p99=kp[0.99],
        kld_p95=kp[0.95], kld_p90=kp[0.90], kld_median=percentile(kld_sorted, 0.5), kld_p10=kp[0.10],
        kld_p05=kp[0.05], kld_p01=kp[0.01], kld_p001=kp[0.001], kld_min=float(kld_sorted[0]),
        dp_mean=dp_mean, dp_mean_pm=dp_pm, dp_max=float(dp_sorted[-1]), dp_p999=dq[0.999], dp_p99=dq[0.99],
        dp_p95=dq[0.95], dp_p90=dq[0.90], dp_p75=dq[0.75], dp_median=percentile(dp_sorted, 0.5), dp_p25=dq[0.25],
        dp_p10=dq[0.10], dp_p05=dq[0.05], dp_p01=dq[0.01], dp_p001=dq[0.001], dp_min=float(dp_sorted[0]),
        dp_rms=rms, dp_rms_pm=rms_pm, same_top=same, same_top_pm=same_pm, ear=ear, ear_pm=ear_pm,
        kl_rev_mean=kl_rev, kl_rev_mean_pm=kl_rev_pm, js_mean=js, js_mean_pm=js_pm, ci95=ci, bootstrap=bootstrap,
        seed=seed)


# ---- printing ------------------------------------------------------------------------------------
def _ci(s: LlamaCppStats, key: str, scale: float = 1.0, fmt: str = "{:.6f}") -> str:
    if key not in s.ci95:
        return ""
    lo, hi = s.ci95[key]
    return f"   [95% CI {fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"


def format_block(s: LlamaCppStats) -> str:
    """The statistics as ``llama-perplexity`` prints them in its KL-divergence mode (percent where it prints
    percent), then trtvocab's additions (EAR, KL(Q || base), JS, bootstrap intervals)."""
    pct = 100.0
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl_q:10.6f} ± {s.ppl_q_pm:10.6f}",
        f"Mean PPL(base)                : {s.ppl_base:10.6f} ± {s.ppl_base_pm:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {pct * s.cor_ln_ppl:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio:10.6f} ± {s.ln_ppl_ratio_pm:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio:10.6f} ± {s.ppl_ratio_pm:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff:10.6f} ± {s.ppl_diff_pm:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_mean_pm:10.6f}",
        f"Maximum KLD: {s.kld_max:10.6f}",
        f"99.9%   KLD: {s.kld_p999:10.6f}",
        f"99.0%   KLD: {s.kld_p99:10.6f}",
        f"95.0%   KLD: {s.kld_p95:10.6f}",
        f"90.0%   KLD: {s.kld_p90:10.6f}",
        f"Median  KLD: {s.kld_median:10.6f}",
        f"10.0%   KLD: {s.kld_p10:10.6f}",
        f" 5.0%   KLD: {s.kld_p05:10.6f}",
        f" 1.0%   KLD: {s.kld_p01:10.6f}",
        f" 0.1%   KLD: {s.kld_p001:10.6f}",
        f"Minimum KLD: {s.kld_min:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {pct * s.dp_mean:6.3f} ± {pct * s.dp_mean_pm:5.3f} %",
        f"Maximum Δp: {pct * s.dp_max:6.3f}%",
        f"99.9%   Δp: {pct * s.dp_p999:6.3f}%",
        f"99.0%   Δp: {pct * s.dp_p99:6.3f}%",
        f"95.0%   Δp: {pct * s.dp_p95:6.3f}%",
        f"90.0%   Δp: {pct * s.dp_p90:6.3f}%",
        f"75.0%   Δp: {pct * s.dp_p75:6.3f}%",
        f"Median  Δp: {pct * s.dp_median:6.3f}%",
        f"25.0%   Δp: {pct * s.dp_p25:6.3f}%",
        f"10.0%   Δp: {pct * s.dp_p10:6.3f}%",
        f" 5.0%   Δp: {pct * s.dp_p05:6.3f}%",
        f" 1.0%   Δp: {pct * s.dp_p01:6.3f}%",
        f" 0.1%   Δp: {pct * s.dp_p001:6.3f}%",
        f"Minimum Δp: {pct * s.dp_min:6.3f}%",
        f"RMS Δp    : {pct * s.dp_rms:6.3f} ± {pct * s.dp_rms_pm:5.3f} %",
        f"Same top p: {pct * s.same_top:6.3f} ± {pct * s.same_top_pm:5.3f} %",
        "",
        f"====== trtvocab additions (full-vocabulary float64, n = {s.n}) ======",
        f"EAR (Σ min(p_base, p_Q))  : {pct * s.ear:7.3f} ± {pct * s.ear_pm:5.3f} %{_ci(s, 'ear', pct, '{:.3f}%')}",
        f"Mean KLD(Q || base)       : {s.kl_rev_mean:10.6f} ± {s.kl_rev_mean_pm:10.6f}{_ci(s, 'kl_rev_mean')}",
        f"Mean JSD                  : {s.js_mean:10.6f} ± {s.js_mean_pm:10.6f}{_ci(s, 'js_mean')}",
    ]
    if s.ci95:
        lines += [
            f"bootstrap 95% intervals ({s.bootstrap} resamples of the rows, seed {s.seed}):",
            f"  PPL(Q)           {_ci(s, 'ppl_q').strip()}",
            f"  PPL(Q)/PPL(base) {_ci(s, 'ppl_ratio').strip()}",
            f"  Mean KLD         {_ci(s, 'kld_mean').strip()}",
            f"  Mean Δp          {_ci(s, 'dp_mean', pct, '{:.3f}%').strip()}",
            f"  RMS Δp           {_ci(s, 'dp_rms', pct, '{:.3f}%').strip()}",
            f"  Same top p       {_ci(s, 'same_top', pct, '{:.3f}%').strip()}",
        ]
    return "\n".join(lines) + "\n"


# (label, value, ±) of the markdown table: llama.cpp's names, its units.
def _markdown_rows(s: LlamaCppStats) -> list[tuple[str, str]]:
    pct = 100.0

    def pm(v: float, e: float, f: str = "{:.6f}") -> str:
        return f"{f.format(v)} ± {f.format(e)}"

    def ci(key: str, scale: float = 1.0, f: str = "{:.6f}") -> str:
        if key not in s.ci95:
            return ""
        lo, hi = s.ci95[key]
        return f" [{f.format(scale * lo)}, {f.format(scale * hi)}]"

    p3 = "{:.3f}"
    return [
        ("n (rows with a next token)", str(s.n)),
        ("Mean PPL(Q)", pm(s.ppl_q, s.ppl_q_pm) + ci("ppl_q")),
        ("Mean PPL(base)", pm(s.ppl_base, s.ppl_base_pm) + ci("ppl_base")),
        ("Cor(ln(PPL(Q)), ln(PPL(base)))", f"{pct * s.cor_ln_ppl:.2f}%"),
        ("Mean ln(PPL(Q)/PPL(base))", pm(s.ln_ppl_ratio, s.ln_ppl_ratio_pm) + ci("ln_ppl_ratio")),
        ("Mean PPL(Q)/PPL(base)", pm(s.ppl_ratio, s.ppl_ratio_pm) + ci("ppl_ratio")),
        ("Mean PPL(Q)-PPL(base)", pm(s.ppl_diff, s.ppl_diff_pm)),
        ("Mean KLD", pm(s.kld_mean, s.kld_mean_pm) + ci("kld_mean")),
        ("Maximum KLD", f"{s.kld_max:.6f}"),
        ("99.9% KLD", f"{s.kld_p999:.6f}"),
        ("99.0% KLD", f"{s.kld_p99:.6f}"),
        ("95.0% KLD", f"{s.kld_p95:.6f}"),
        ("90.0% KLD", f"{s.kld_p90:.6f}"),
        ("Median KLD", f"{s.kld_median:.6f}"),
        ("10.0% KLD", f"{s.kld_p10:.6f}"),
        ("5.0% KLD", f"{s.kld_p05:.6f}"),
        ("1.0% KLD", f"{s.kld_p01:.6f}"),
        ("0.1% KLD", f"{s.kld_p001:.6f}"),
        ("Minimum KLD", f"{s.kld_min:.6f}"),
        ("Mean Δp", pm(pct * s.dp_mean, pct * s.dp_mean_pm, p3) + " %" + ci("dp_mean", pct, p3)),
        ("Maximum Δp", f"{pct * s.dp_max:.3f}%"),
        ("99.9% Δp", f"{pct * s.dp_p999:.3f}%"),
        ("99.0% Δp", f"{pct * s.dp_p99:.3f}%"),
        ("95.0% Δp", f"{pct * s.dp_p95:.3f}%"),
        ("90.0% Δp", f"{pct * s.dp_p90:.3f}%"),
        ("75.0% Δp", f"{pct * s.dp_p75:.3f}%"),
        ("Median Δp", f"{pct * s.dp_median:.3f}%"),
        ("25.0% Δp", f"{pct * s.dp_p25:.3f}%"),
        ("10.0% Δp", f"{pct * s.dp_p10:.3f}%"),
        ("5.0% Δp", f"{pct * s.dp_p05:.3f}%"),
        ("1.0% Δp", f"{pct * s.dp_p01:.3f}%"),
        ("0.1% Δp", f"{pct * s.dp_p001:.3f}%"),
        ("Minimum Δp", f"{pct * s.dp_min:.3f}%"),
        ("RMS Δp", pm(pct * s.dp_rms, pct * s.dp_rms_pm, p3) + " %" + ci("dp_rms", pct, p3)),
        ("Same top p", pm(pct * s.same_top, pct * s.same_top_pm, p3) + " %" + ci("same_top", pct, p3)),
        ("EAR", pm(pct * s.ear, pct * s.ear_pm, p3) + " %" + ci("ear", pct, p3)),
        ("Mean KLD(Q \\|\\| base)", pm(s.kl_rev_mean, s.kl_rev_mean_pm) + ci("kl_rev_mean")),
        ("Mean JSD", pm(s.js_mean, s.js_mean_pm) + ci("js_mean")),
    ]


def markdown_table(named: list[tuple[str, LlamaCppStats]]) -> str:
    """The llama.cpp block of every variant as one GitHub table: a row per statistic, a column per
    variant (± is llama.cpp's standard error, brackets the bootstrap 95 % interval)."""
    if not named:
        return ""
    table = [_markdown_rows(s) for _, s in named]
    header = "| statistic | " + " | ".join(name.replace("|", "\\|") for name, _ in named) + " |"
    lines = [header, "|---|" + "---:|" * len(named)]
    for i, (label, _) in enumerate(table[0]):
        lines.append(f"| {label} | " + " | ".join(t[i][1] for t in table) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["DEFAULT_BOOTSTRAP", "DEFAULT_SEED", "MAX_BOOTSTRAP", "MAX_SEED", "LlamaCppStats", "TokenRows",
           "bootstrap_means", "check_bootstrap", "covariance_of_means", "format_block", "llamacpp_stats",
           "markdown_table", "mean_and_uncertainty", "percentile", "token_rows"]
