"""LogitsProcessor: last-token-only rows of packed batches, context logits, float32 output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.parallel.rank_fns import logits_processor_tp
from trtvocab import LMHead, LogitsProcessor
from trtvocab.errors import InputError
from trtvocab.logits import last_token_rows
from trtvocab.parallel.launch import run_ranks

VOCAB, HIDDEN = 257, 16


def _head(dtype: torch.dtype = torch.float32) -> LMHead:
    gen = torch.Generator().manual_seed(0)
    head = LMHead(VOCAB, HIDDEN, dtype=dtype)
    head.load_weights({"lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen)})
    return head


HEADS = {torch.float32: _head(torch.float32), torch.bfloat16: _head(torch.bfloat16)}


def _per_sequence(states: torch.Tensor, seq_lens: list[int], head: LMHead) -> torch.Tensor:
    """Reference: split the packed batch, run the head on each sequence alone, keep its last row."""
    rows = [head(seq)[-1] for seq in torch.split(states, seq_lens)]
    return torch.stack(rows).float()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9), st.sampled_from([torch.float32, torch.bfloat16]),
       st.integers(0, 2**31 - 1), st.booleans())
def test_last_token_rows_match_per_sequence(seq_lens: list[int], dtype: torch.dtype, seed: int,
                                             as_tensor: bool) -> None:
    head = HEADS[dtype]
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(sum(seq_lens), HIDDEN, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens) if as_tensor else seq_lens
    got = LogitsProcessor()(states, head, lens)
    assert got.dtype == torch.float32 and got.shape == (len(seq_lens), VOCAB)
    # Each selected row is the same dot products on the same data: equal up to the
    # GEMM's blocking (M = B rows vs M = one sequence); float32 tolerance for bf16 too,
    # since both sides round the same bf16 product.
    want = _per_sequence(states, seq_lens, head)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 0.05)
    # and it is exactly the head on the gathered last rows (the selection itself is exact)
    rows = torch.cumsum(torch.tensor(seq_lens), 0) - 1
    assert torch.equal(got, head(states[rows]).float())


def test_context_logits_are_all_rows() -> None:
    head = HEADS[torch.float32]
    states = torch.randn(10, HIDDEN)
    got = LogitsProcessor()(states, head, [3, 7], return_context_logits=True)
    assert got.shape == (10, VOCAB) and got.dtype == torch.float32
    assert torch.equal(got, head(states))
    # without seq_lens too
    assert torch.equal(LogitsProcessor()(states, head, return_context_logits=True), got)


def test_context_logits_still_validate_seq_lens() -> None:
    with pytest.raises(InputError, match="seq_lens"):
        LogitsProcessor()(torch.randn(10, HIDDEN), HEADS[torch.float32], [3, 6], return_context_logits=True)


def test_one_token_sequences_select_every_row() -> None:
    head = HEADS[torch.float32]
    states = torch.randn(5, HIDDEN)
    got = LogitsProcessor()(states, head, [1, 1, 1, 1, 1])
    assert torch.equal(got, head(states))


def test_seq_lens_none_is_the_last_row() -> None:
    head = HEADS[torch.bfloat16]
    states = torch.randn(7, HIDDEN).to(torch.bfloat16)
    got = LogitsProcessor()(states, head)
    assert got.shape == (1, VOCAB) and got.dtype == torch.float32
    assert torch.equal(got, head(states[-1:]).float())


def test_last_token_rows_values() -> None:
    assert last_token_rows([3, 1, 2], 6).tolist() == [2, 3, 5]
    assert last_token_rows(torch.tensor([4], dtype=torch.int32), 4).tolist() == [3]


@pytest.mark.parametrize(("seq_lens", "total", "match"), [
    ([3, 2], 6, "sum to 5"),
    ([3, 0, 3], 6, ">= 1"),
    ([7, -1], 6, ">= 1"),
    ([], 0, "empty"),
    (torch.tensor([3.0, 3.0]), 6, "integer"),
    (torch.tensor([[3, 3]]), 6, "1-D"),
    ("abc", 3, "seq_lens"),
])
def test_bad_seq_lens(seq_lens: object, total: int, match: str) -> None:
    with pytest.raises(InputError, match=match):
        last_token_rows(seq_lens, total)


def test_bad_hidden_states() -> None:
    head = HEADS[torch.float32]
    with pytest.raises(InputError, match="empty"):
        LogitsProcessor()(torch.empty(0, HIDDEN), head)
    with pytest.raises(InputError, match=r"\[T, H\]"):
        LogitsProcessor()(torch.randn(2, 3, HIDDEN), head)
    with pytest.raises(InputError, match="hidden_states"):
        LogitsProcessor()(torch.randn(4, HIDDEN + 1), head, [4])
    with pytest.raises(InputError, match="dtype"):
        LogitsProcessor()(torch.randn(4, HIDDEN).double(), head, [4])


@pytest.mark.ranks
def test_split_head_in_the_processor() -> None:
    """tp 2, padded layout: last-token, last-row and context logits equal the replicated head's
    to the parity bound (2 x single-device float32 error + 4 ulps)."""
    for rank, result in enumerate(run_ranks(logits_processor_tp, 2, 3, timeout_s=60)):
        for mode, rec in result.items():
            assert rec["shape"] == rec["want_shape"], (rank, mode)
            assert rec["dtype"] == "torch.float32"
            assert rec["err_tp"] <= 2 * rec["err_single"] + rec["floor"], (rank, mode, rec)
        assert result["none"]["shape"][0] == 1
        assert result["last"]["shape"][0] == 5
        assert result["context"]["shape"][0] > 5


def test_last_k_rows_per_sequence_for_speculative_decoding() -> None:
    """num_logits_per_seq: each sequence's last k rows, in order (an int or one per sequence)."""
    head = HEADS[torch.float32]
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    w = head.weights.weight.double()
    lens = [4, 2, 3]  # rows 0-3 | 4-5 | 6-8
    for k, rows in ((2, [2, 3, 4, 5, 7, 8]), ([1, 2, 3], [3, 4, 5, 6, 7, 8]), ([4, 1, 1], [0, 1, 2, 3, 5, 8])):
        got = LogitsProcessor()(x, head, lens, num_logits_per_seq=k)
        torch.testing.assert_close(got.double(), x.double()[rows] @ w.t(), rtol=1e-5, atol=1e-5)
    one = LogitsProcessor()(x, head, None, num_logits_per_seq=3)  # one sequence: its last 3 rows
    torch.testing.assert_close(one.double(), x.double()[6:] @ w.t(), rtol=1e-5, atol=1e-5)
    for bad in (0, [1, 3, 1], [1, 1], 2.0, True, "2"):
        with pytest.raises(InputError, match="num_logits_per_seq"):
            LogitsProcessor()(x, head, lens, num_logits_per_seq=bad)


def test_next_ids_without_the_logits_select_the_processors_rows() -> None:
    """``sampling.decode(hidden, head, params, seq_lens=...)``: the LogitsProcessor's rows, and the ids
    of ``sample`` on its logits; with a budget below the batch's float32 logits the vocab is streamed
    (``forward`` still returns the materialized logits) and the ids are bitwise the same."""
    from trtvocab.sampling import SamplingParams, decode, sample, streams

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    whole = LMHead(VOCAB, HIDDEN, dtype=torch.float32)
    small = LMHead(VOCAB, HIDDEN, dtype=torch.float32, logits_budget_bytes=3 * VOCAB * 4 - 1)
    for head in (whole, small):
        head.load_weights({"weight": weight})
    states = torch.randn(9, HIDDEN, generator=gen)
    lens = [4, 2, 3]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.8, seed=2)]
    assert not streams(whole, 3) and streams(small, 3)
    want = sample(LogitsProcessor()(states, whole, lens), whole, params, step=2)
    assert torch.equal(LogitsProcessor()(states, small, lens), LogitsProcessor()(states, whole, lens))
    for head in (whole, small):
        assert torch.equal(decode(states, head, params, step=2, seq_lens=lens), want)
    with pytest.raises(InputError, match="sum to"):
        decode(states, small, params, seq_lens=[4, 2, 2])
