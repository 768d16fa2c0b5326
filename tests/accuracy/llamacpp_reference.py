"""An independent float64 reference of llama.cpp's ``perplexity --kl-divergence`` statistics.

Plain numpy, one row at a time, written from the formulas (tools/perplexity/perplexity.cpp):
no code shared with trtvocab.accuracy.
"""

from __future__ import annotations

import math

import numpy as np


def log_softmax(row: np.ndarray) -> np.ndarray:
    m = row.max()
    return row - m - math.log(np.exp(row - m).sum())


def per_row(base: np.ndarray, var: np.ndarray, next_ids: np.ndarray) -> dict[str, np.ndarray]:
    out: dict[str, list[float]] = {k: [] for k in ("nll_q", "nll_b", "kld", "kl_rev", "js", "ear", "dp", "same")}
    for b, v, y in zip(base.astype(np.float64), var.astype(np.float64), next_ids, strict=True):
        if y < 0:
            continue
        lb, lv = log_softmax(b), log_softmax(v)
        pb, pv = np.exp(lb), np.exp(lv)
        m = 0.5 * (pb + pv)
        out["nll_q"].append(-lv[y])
        out["nll_b"].append(-lb[y])
        out["kld"].append(float(np.sum(pb * (lb - lv))))
        out["kl_rev"].append(float(np.sum(pv * (lv - lb))))
        out["js"].append(0.5 * float(np.sum(pb * np.log(pb / m))) + 0.5 * float(np.sum(pv * np.log(pv / m))))
        out["ear"].append(float(np.minimum(pb, pv).sum()))
        out["dp"].append(pv[y] - pb[y])
        out["same"].append(float(int(np.argmax(b)) == int(np.argmax(v))))  # np.argmax: first index of ties
    return {k: np.array(x, dtype=np.float64) for k, x in out.items()}


def mean_pm(x: np.ndarray) -> tuple[float, float]:
    n = len(x)
    mean = x.sum() / n
    var = (x * x).sum() / n - mean * mean
    return float(mean), (math.sqrt(var / (n - 1)) if var > 0 else 0.0)


def pct(values: np.ndarray, f: float) -> float:
    v = np.sort(values)
    p = f * (len(v) - 1)
    i = math.floor(p)
    j = min(i + 1, len(v) - 1)
    return float((1 - (p - i)) * v[i] + (p - i) * v[j])


def summary(r: dict[str, np.ndarray]) -> dict[str, float]:
    n = len(r["nll_q"])
    lq, lq_e = mean_pm(r["nll_q"])
    lb, lb_e = mean_pm(r["nll_b"])
    cov = ((r["nll_q"] * r["nll_b"]).sum() / n - lq * lb) / (n - 1)
    ln_ratio_e = math.sqrt(max(lq_e ** 2 + lb_e ** 2 - 2 * cov, 0.0))
    ppl_q, ppl_b = math.exp(lq), math.exp(lb)
    mse, mse_e = mean_pm(r["dp"] ** 2)
    same = r["same"].mean()
    out = {"n": n, "ppl_q": ppl_q, "ppl_q_pm": ppl_q * lq_e, "ppl_base": ppl_b, "ppl_base_pm": ppl_b * lb_e,
           "ln_ppl_ratio": lq - lb, "ln_ppl_ratio_pm": ln_ratio_e, "ppl_ratio": math.exp(lq - lb),
           "ppl_ratio_pm": math.exp(lq - lb) * ln_ratio_e, "ppl_diff": ppl_q - ppl_b,
           "ppl_diff_pm": math.sqrt(max((ppl_q * lq_e) ** 2 + (ppl_b * lb_e) ** 2 - 2 * ppl_q * ppl_b * cov, 0.0)),
           "kld_max": float(r["kld"].max()), "kld_min": float(r["kld"].min()), "kld_median": pct(r["kld"], 0.5),
           "kld_p99": pct(r["kld"], 0.99), "kld_p95": pct(r["kld"], 0.95), "kld_p999": pct(r["kld"], 0.999),
           "kld_p90": pct(r["kld"], 0.9), "kld_p10": pct(r["kld"], 0.1), "kld_p01": pct(r["kld"], 0.01),
           "dp_max": float(r["dp"].max()), "dp_min": float(r["dp"].min()), "dp_median": pct(r["dp"], 0.5),
           "dp_p75": pct(r["dp"], 0.75), "dp_p25": pct(r["dp"], 0.25), "dp_p05": pct(r["dp"], 0.05),
           "dp_rms": math.sqrt(mse), "dp_rms_pm": 0.5 / math.sqrt(mse) * mse_e if mse > 0 else 0.0,
           "same_top": same, "same_top_pm": math.sqrt(same * (1 - same) / (n - 1))}
    if lq_e > 0 and lb_e > 0:
        out["cor_ln_ppl"] = cov / (lq_e * lb_e)
    for key, col in (("kld_mean", "kld"), ("dp_mean", "dp"), ("ear", "ear"), ("kl_rev_mean", "kl_rev"),
                     ("js_mean", "js")):
        out[key], out[key + "_pm"] = mean_pm(r[col])
    return out
