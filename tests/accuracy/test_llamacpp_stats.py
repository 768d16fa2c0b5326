"""llama.cpp's teacher-forced statistics against an independent float64 reference, known answers, gates."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.accuracy.llamacpp_reference import per_row, summary
from trtvocab.accuracy.compare import logit_metrics
from trtvocab.accuracy.gates import Gates
from trtvocab.accuracy.stats import (
    TokenRows,
    format_block,
    llamacpp_stats,
    markdown_table,
    token_rows,
)
from trtvocab.errors import ConfigError, InputError


def _logits(n: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _stats(base: torch.Tensor, var: torch.Tensor, next_ids: torch.Tensor, **kw):
    m = logit_metrics(base.float(), var.float(), next_ids=next_ids)
    assert m.tokens is not None
    return llamacpp_stats(m.tokens, **kw)


@pytest.mark.parametrize("n", [3, 4, 150])  # n - 1 scored rows: 2, 3, 149
def test_statistics_equal_the_float64_reference(n: int) -> None:
    vocab = 97
    base = _logits(n, vocab, 1).float()
    var = (base.double() + 0.3 * _logits(n, vocab, 2, 1.0)).float()
    next_ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3))
    next_ids[-1] = -1  # a sequence's last row has no next token
    got = _stats(base, var, next_ids, bootstrap=0).as_dict()
    want = summary(per_row(base.numpy(), var.numpy(), next_ids.numpy()))
    assert got["n"] == n - 1
    for key, value in want.items():
        # The uncertainties of PPL ratios/differences come from a covariance of exponentials: with
        # 2 or 3 rows it cancels, and float64 summation order alone moves the result by ~1e-9.
        rel = 1e-7 if key.endswith("_pm") else 1e-9
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-12), key


def test_identical_variant_known_answers() -> None:
    base = _logits(40, 50, 4)
    next_ids = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(5))
    s = _stats(base, base.clone(), next_ids)
    assert s.kld_mean == 0.0 and s.kld_max == 0.0 and s.kl_rev_mean == 0.0 and s.js_mean == pytest.approx(0, abs=1e-15)
    assert s.ear == pytest.approx(1.0, abs=1e-12) and s.same_top == 1.0 and s.same_top_pm == 0.0
    assert s.ppl_ratio == 1.0 and s.ln_ppl_ratio == 0.0 and s.ppl_diff == 0.0 and s.ln_ppl_ratio_pm == 0.0
    assert s.dp_rms == 0.0 and s.dp_mean == 0.0 and s.cor_ln_ppl == pytest.approx(1.0)
    assert s.ci95["kld_mean"] == (0.0, 0.0) and s.ci95["ppl_ratio"] == (1.0, 1.0)


def test_hand_computed_row() -> None:
    """Two tokens: p_base = (1/2, 1/2), p_Q = (3/4, 1/4); next token 1."""
    base = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    var = torch.log(torch.tensor([[0.75, 0.25], [0.75, 0.25]], dtype=torch.float64))
    rows = token_rows(torch.log_softmax(base, -1), torch.log_softmax(var, -1), torch.tensor([1, 1]))
    kld = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert rows.kld[0] == pytest.approx(kld, abs=1e-15)
    assert rows.kl_rev[0] == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-15)
    m = (0.625, 0.375)
    js = 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])) \
        + 0.5 * (0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1]))
    assert rows.js[0] == pytest.approx(js, abs=1e-15)
    assert rows.ear[0] == pytest.approx(0.75, abs=1e-15)  # min(.5,.75) + min(.5,.25)
    assert rows.dp[0] == pytest.approx(-0.25, abs=1e-15)
    assert rows.nll_q[0] == pytest.approx(math.log(4)) and rows.nll_base[0] == pytest.approx(math.log(2))
    assert rows.same_top.tolist() == [True, True]  # base ties (0.5, 0.5): argmax is the lowest id, 0
    s = llamacpp_stats(rows, bootstrap=0)
    assert s.ppl_ratio == pytest.approx(2.0) and s.same_top == 1.0


def test_argmax_ties_take_the_lowest_id() -> None:
    base = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 3)
    var = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 2.9, 3.0, 0.0], [1.0, 3.0, 2.9, 0.0]])
    m = logit_metrics(base, var, next_ids=torch.tensor([1, 1, 1]))
    assert m.tokens is not None and m.tokens.same_top.tolist() == [True, False, True]
    assert m.top1_agreement == pytest.approx(2 / 3)


def test_rows_without_next_token_are_left_out() -> None:
    base, var = _logits(6, 11, 7), _logits(6, 11, 8)
    m = logit_metrics(base, var, next_ids=torch.tensor([-1, -1, -1, -1, -1, -1]))
    assert m.tokens is not None and m.tokens.n == 0
    with pytest.raises(InputError, match="at least one row"):
        llamacpp_stats(m.tokens)
    with pytest.raises(InputError, match="next_token_ids"):
        logit_metrics(base, var, next_ids=torch.tensor([0, 1, 2, 3, 4, 11]))  # 11 is outside V
    with pytest.raises(InputError, match="entries"):
        logit_metrics(base, var, next_ids=torch.tensor([0, 1]))


def test_one_row_has_no_uncertainty() -> None:
    rows = TokenRows(*(np.array([0.5]) for _ in range(7)), same_top=np.array([True]))
    s = llamacpp_stats(rows)
    assert s.n == 1 and math.isnan(s.kld_mean_pm) and s.as_dict()["kld_mean_pm"] is None
    assert s.kld_median == s.kld_max == s.kld_min == 0.5


def test_bootstrap_is_seeded_and_brackets_the_mean() -> None:
    base = _logits(300, 64, 9)
    var = base + 0.5 * _logits(300, 64, 10, 1.0)
    ids = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(11))
    a, b = _stats(base, var, ids, seed=3), _stats(base, var, ids, seed=3)
    c = _stats(base, var, ids, seed=4)
    assert a.ci95 == b.ci95 and a.ci95 != c.ci95
    for key, mean in (("kld_mean", a.kld_mean), ("ear", a.ear), ("same_top", a.same_top), ("ppl_q", a.ppl_q),
                      ("js_mean", a.js_mean), ("kl_rev_mean", a.kl_rev_mean), ("dp_rms", a.dp_rms)):
        lo, hi = a.ci95[key]
        assert lo < mean < hi, key
    # A 95 % interval spans about +-1.96 standard errors.
    lo, hi = a.ci95["kld_mean"]
    assert (hi - lo) / (2 * 1.96 * a.kld_mean_pm) == pytest.approx(1.0, abs=0.15)


def test_text_block_and_markdown() -> None:
    base = _logits(120, 40, 12)
    ids = torch.randint(0, 40, (120,), generator=torch.Generator().manual_seed(13))
    s = _stats(base, base + 0.2 * _logits(120, 40, 14, 1.0), ids)
    text = format_block(s)
    for line in ("====== Perplexity statistics ======", "Mean PPL(Q)                   : ",
                 "Cor(ln(PPL(Q)), ln(PPL(base))): ", "====== KL divergence statistics ======", "Mean    KLD: ",
                 "99.9%   KLD: ", " 0.1%   KLD: ", "Minimum KLD: ", "RMS Δp    : ", "Same top p: ", "EAR"):
        assert line in text, line
    assert f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_mean_pm:10.6f}" in text
    assert f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_pm:5.3f} %" in text
    md = markdown_table([("a", s), ("b|c", s)]).splitlines()
    assert md[0] == "| statistic | a | b\\|c |" and md[1] == "|---|---:|---:|"
    assert any(line.startswith("| Mean KLD | ") for line in md)


def test_gates() -> None:
    base = _logits(50, 30, 15)
    ids = torch.randint(0, 30, (50,), generator=torch.Generator().manual_seed(16))
    s = _stats(base, base + 1.5 * _logits(50, 30, 17, 1.0), ids, bootstrap=0)
    assert Gates().failures("v", s) == []
    assert Gates(max_kld_mean=s.kld_mean * 1.01, min_same_top=s.same_top, max_ppl_ratio=s.ppl_ratio).failures("v", s) \
        == []
    assert s.same_top < 1
    fails = Gates(max_kld_mean=s.kld_mean * 0.99, min_same_top=1.0, max_ppl_ratio=0.5).failures("sim:x", s)
    assert len(fails) == 3 and all(f.startswith("gate failed: sim:x: ") for f in fails)
    assert "`max_kld_mean`" in fails[0] and "`min_same_top`" in fails[1] and "`max_ppl_ratio`" in fails[2]
    with pytest.raises(ConfigError, match="`min_same_top`"):
        Gates(min_same_top=98.0)
    with pytest.raises(ConfigError, match="`max_kld_mean`"):
        Gates(max_kld_mean=float("nan"))
    with pytest.raises(InputError, match="next_token_ids"):
        Gates(max_kld_mean=1.0).failures("v", None)
