"""Hostile sampling knobs (``trtvocab/sampling/params.py``): a ``logit_bias`` outside [-100, 100] and a
``repetition_penalty`` outside [0.01, 100] are refused where they enter; the bounds themselves keep the
odds and the greedy order.
"""

from __future__ import annotations

import pytest
import torch

from trtvocab import LMHead
from trtvocab.errors import InputError
from trtvocab.sampling import SamplingParams, TokenState, sample

V = 64


@pytest.mark.parametrize("bias", [1e30, 100.5, -1e300, float("inf"), float("nan"), 10**400])
def test_h3_logit_bias_is_bounded_to_plus_minus_100(bias: float) -> None:
    with pytest.raises(InputError, match=r"SamplingParams.logit_bias: bias of id 7 must be a number in \[-100, 100\]"):
        SamplingParams(logit_bias={7: bias})


def test_h3_bias_100_and_the_explicit_minus_inf_ban_keep_the_odds() -> None:
    torch.manual_seed(0)
    head = LMHead(V, 32, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, 32)})
    y = head(torch.randn(3, 32))
    draws = torch.stack([sample(y, head, SamplingParams(temperature=1.0, seed=s, logit_bias={7: 100, 9: 100}))
                         for s in range(200)])
    share = float((draws[:, 0] == 9).double().mean())
    want = float(torch.softmax(y[0, [7, 9]].double(), 0)[1])
    assert set(draws.unique().tolist()) <= {7, 9} and abs(share - want) < 0.12, (share, want)
    top = int(y[0].argmax())
    banned = sample(y, head, SamplingParams(temperature=0.0, logit_bias={top: float("-inf")}))
    assert int(banned[0]) != top  # -inf: a documented ban


@pytest.mark.parametrize("penalty", [1e-45, 1e-38, 1e-3, 0.0099, 100.5, 1e30])
def test_h3_repetition_penalty_is_bounded(penalty: float) -> None:
    with pytest.raises(InputError, match=r"SamplingParams.repetition_penalty: must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=penalty)


def test_h3_repetition_penalty_at_its_bounds_keeps_the_greedy_order() -> None:
    torch.manual_seed(0)
    head = LMHead(V, 32, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, 32)})
    y = head(torch.randn(3, 32))
    state = TokenState.for_head(head, [list(range(V))] * 3)  # every id seen: the penalty keeps the order
    for penalty in (0.01, 100.0):
        got = sample(y, head, SamplingParams(temperature=0.0, repetition_penalty=penalty), state=state)
        assert torch.equal(got, y.argmax(1)), (penalty, got)
