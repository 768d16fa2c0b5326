"""The compare report as one PNG (matplotlib, Agg backend).

Top row: per-row KL(baseline || variant) as a CDF over all compared rows; the teacher-forced
KLD as a histogram over log-spaced bins; Δp = p_Q(next) - p_base(next) as a histogram with a
log count axis. Bottom row: the logit error histogram; PPL(Q) per variant with llama.cpp's ±
and the bootstrap 95 % interval, the baseline's PPL as a band; Same top p and EAR per variant
with their intervals. Without next-token ids the teacher-forced panels say so.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from trtvocab.base.publish import atomic_write_bytes
from trtvocab.errors import InputError

FLOOR = 1e-12  # identical rows have KL 0: drawn at the floor of the log axis


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}:\nno next_token_ids in the hidden file", ha="center", va="center",
            transform=ax.transAxes, fontsize=9, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _label(v: Any) -> str:
    """The format and which head: several variants share a format label (NVFP4 W4A16 and its searches)."""
    name = v.name if v.name.startswith(("sim:", "quantized:")) else (Path(v.name).name or v.name)
    return f"{v.label} [{name.removeprefix('sim:')}]"


def plot_report(report: Any, path: str | Path) -> Path:
    """Write the six panels of the module docstring for ``report`` (a ``CompareReport``) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not report.variants:
        raise InputError("nothing to plot: the report has no variants")
    fig, axes = plt.subplots(2, 3, figsize=(19, 9.6), constrained_layout=True)
    (ax_kl, ax_kld, ax_dp), (ax_err, ax_ppl, ax_top) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {v.name: colors[i % len(colors)] for i, v in enumerate(report.variants)}

    # KL as an ECDF (fraction of rows at or below x): six overlapping histograms are
    # unreadable, six CDF curves are not, and the p99 can be read off the y axis.
    for v in report.variants:
        k = np.sort(np.maximum(np.asarray(v.metrics.kl_per_row, dtype=np.float64), FLOOR))
        frac = np.arange(1, len(k) + 1, dtype=np.float64) / len(k)
        ax_kl.step(k, frac, where="post", linewidth=1.8, color=color[v.name],
                   label=f"{_label(v)}  (mean {v.metrics.kl_mean:.1e}, p99 {v.metrics.kl_p99:.1e})")
    ax_kl.axhline(0.99, color="grey", linewidth=0.8, linestyle=":")
    ax_kl.set_xscale("log")
    ax_kl.set_ylim(0, 1.02)
    ax_kl.set_xlabel("KL(baseline || variant) per row [nats]")
    ax_kl.set_ylabel("fraction of rows ≤ x")
    ax_kl.set_title(f"Per-row KL divergence, CDF ({report.rows} rows, {report.rows_mode})")
    ax_kl.legend(fontsize=7, loc="lower right")

    tf = [v for v in report.variants if v.llamacpp is not None and v.metrics.tokens is not None]
    if tf:
        klds = [np.maximum(v.metrics.tokens.kld, FLOOR) for v in tf]
        lo = max(min(float(k.min()) for k in klds), FLOOR)
        hi = max(float(k.max()) for k in klds)
        edges = np.logspace(np.log10(lo), np.log10(max(hi, lo * 10)), 60)
        for v, k in zip(tf, klds, strict=True):
            ax_kld.hist(k, bins=edges, histtype="step", linewidth=1.6, color=color[v.name],
                        label=f"{_label(v)}  (mean {v.llamacpp.kld_mean:.2e}, p99 {v.llamacpp.kld_p99:.2e})")
        ax_kld.set_xscale("log")
        ax_kld.set_yscale("log")
        ax_kld.set_xlabel("KLD(base || Q) per token [nats], log bins")
        ax_kld.set_ylabel("tokens")
        ax_kld.legend(fontsize=7, loc="upper left")
        span = max(float(np.abs(v.metrics.tokens.dp).max()) for v in tf) or 1e-6
        dp_edges = np.linspace(-100 * span, 100 * span, 81)
        for v in tf:
            ax_dp.hist(100 * v.metrics.tokens.dp, bins=dp_edges, histtype="step", linewidth=1.6, color=color[v.name],
                       label=f"{_label(v)}  (RMS {100 * v.llamacpp.dp_rms:.3f}%)")
        ax_dp.set_yscale("log")
        ax_dp.set_xlabel("Δp = p_Q(next) − p_base(next) [percentage points]")
        ax_dp.set_ylabel("tokens")
        ax_dp.legend(fontsize=7, loc="upper left")
    else:
        _no_data(ax_kld, "teacher-forced KLD")
        _no_data(ax_dp, "Δp")
    n_tf = tf[0].llamacpp.n if tf else 0
    ax_kld.set_title(f"Teacher-forced KLD distribution ({n_tf} tokens)")
    ax_dp.set_title("Δp of the true next token")

    span = max(float(np.abs(np.asarray(v.metrics.logit_err_sample)).max()) for v in report.variants) or 1.0
    edges = np.linspace(-span, span, 81)
    sampled = False
    for v in report.variants:
        errs = np.asarray(v.metrics.logit_err_sample)
        sampled |= errs.size < v.metrics.rows * report.vocab_size
        ax_err.hist(errs, bins=edges, histtype="step", linewidth=1.8, color=color[v.name],
                    label=f"{_label(v)}  (max |Δ| {v.metrics.max_abs_logit_err:.3f})")
    ax_err.set_yscale("log")
    ax_err.set_xlabel("logit error (variant − baseline)")
    ax_err.set_ylabel("logits (sampled)" if sampled else "logits")
    ax_err.set_title("Logit error distribution")
    ax_err.legend(fontsize=7, loc="upper left")

    if tf:
        ys = np.arange(len(tf))
        base = tf[0].llamacpp
        ax_ppl.axvspan(base.ppl_base - base.ppl_base_pm, base.ppl_base + base.ppl_base_pm, color="grey", alpha=0.2,
                       label=f"{report.baseline_label}: {base.ppl_base:.4f} ± {base.ppl_base_pm:.4f}")
        ax_ppl.axvline(base.ppl_base, color="grey", linewidth=1)
        for y, v in zip(ys, tf, strict=True):
            s = v.llamacpp
            ax_ppl.errorbar(s.ppl_q, y, xerr=s.ppl_q_pm, fmt="o", color=color[v.name], capsize=4)
            if "ppl_q" in s.ci95:
                lo, hi = s.ci95["ppl_q"]
                ax_ppl.plot([lo, hi], [y + 0.18, y + 0.18], color=color[v.name], linewidth=1, linestyle="--")
        ax_ppl.set_yticks(ys, [_label(v) for v in tf], fontsize=8)
        ax_ppl.set_xlabel("PPL(Q) ± llama.cpp's σ (dashed: bootstrap 95% interval)")
        ax_ppl.legend(fontsize=7, loc="lower right")
        width = 0.38
        for y, v in zip(ys, tf, strict=True):
            s = v.llamacpp
            for off, value, key, hatch in ((-width / 2, s.same_top, "same_top", ""), (width / 2, s.ear, "ear", "//")):
                lo, hi = s.ci95.get(key, (value, value))
                ax_top.barh(y + off, 100 * value, height=width, color=color[v.name], hatch=hatch, alpha=0.8,
                            xerr=[[100 * (value - lo)], [100 * (hi - value)]], capsize=3)
        ax_top.set_yticks(ys, [_label(v) for v in tf], fontsize=8)
        low = min(min(v.llamacpp.same_top, v.llamacpp.ear) for v in tf)
        ax_top.set_xlim(max(0.0, 100 * low - 5), 100.5)
        ax_top.set_xlabel("Same top p (solid) and EAR (hatched), %, bootstrap 95% interval")
    else:
        _no_data(ax_ppl, "PPL")
        _no_data(ax_top, "Same top p / EAR")
    ax_ppl.set_title("Perplexity of the true next token")
    ax_top.set_title("Argmax agreement and speculative acceptance (EAR)")

    fig.suptitle(f"LM-head quantization vs {report.baseline_label} (V={report.vocab_size:,}, tp={report.tp})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


__all__ = ["plot_report"]
