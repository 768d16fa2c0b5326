"""Hostile inputs to a head (``trtvocab/base/inputs.py``): NaN / inf hidden states are refused by the head, the
logits processor and the runtime, naming the first row and column; ``seq_lens`` whose int64 sum wraps
around are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hostile import H, V, build_art
from trtvocab.errors import InputError


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


def test_nan_hidden_states_are_refused_by_head_processor_and_runtime(art: Path) -> None:
    from trtvocab import LMHead, LogitsProcessor
    from trtvocab.pipeline.infer import infer

    head = LMHead(V, H, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, H)})
    x = torch.randn(5, H)
    x[2, 3] = float("nan")
    with pytest.raises(InputError, match=r"hidden_states: contains NaN or inf \(first at row 2, column 3"):
        head(x)
    with pytest.raises(InputError, match="NaN or inf"):
        LogitsProcessor()(x, head, seq_lens=[3, 2])  # row 2 is the last row of sequence 0
    head.check_finite = False  # the caller validated already: the switch skips the scan
    assert torch.isnan(head(x)[2]).all()
    x[2, 3] = float("inf")
    with pytest.raises(InputError, match="row 2, column 3"):
        infer(art, x, torch.tensor([3, 2]), "torch")


def test_seq_lens_whose_int64_sum_wraps_are_refused() -> None:
    from trtvocab import LMHead, LogitsProcessor
    from trtvocab.base.inputs import last_token_rows

    wrapping = [2**62, 2**62, 2**62, 2**62 + 6]  # sums to 6 modulo 2**64
    with pytest.raises(InputError, match=r"seq_lens: length 4611686018427387904 \(sequence 0\) is longer .* T = 6"):
        last_token_rows(torch.tensor(wrapping), 6)
    head = LMHead(V, H, dtype=torch.float32)
    with pytest.raises(InputError, match="seq_lens: length"):
        LogitsProcessor()(torch.randn(6, H), head, seq_lens=wrapping)
