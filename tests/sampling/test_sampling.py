"""Distributed sampling (trtvocab.sampling) equals the same operation on gathered logits.

Exact: greedy ids, top-k values and ids (tie rule: value descending, then token id
ascending), min-p masks. Sums of exponentials (logsumexp, log-softmax, logprobs) are
added in another order than on the gathered row, so they agree to float32 rounding:
``SUM_TOL`` below. A per-shard softmax would be off by ``log(tp)``-sized amounts.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.rank_fns import sampling_cases
from trtvocab import LMHead, Mapping, sampling
from trtvocab.errors import InputError
from trtvocab.parallel.launch import run_ranks
from trtvocab.sampling.reductions import MAX_BLOCK, RADIX_ROUNDS, first_max, local_topk, nonfinite_rows

# logsumexp of <= 30011 float32 terms of magnitude <= ~20: the sums differ in order
# only, relative error ~ a few float32 eps (1.2e-7) per doubling of the term count at
# worst, i.e. well under 1e-5 absolute on values of magnitude ~10-20.
SUM_TOL = 2e-5


def _check(records: list[dict]) -> None:
    assert records
    failures = []
    for rec in records:
        if rec.get("exact") is False:
            failures.append(f"{rec['case']}: not exact")
        if rec.get("torch_ids_where_distinct") is False:
            failures.append(f"{rec['case']}: ids differ from torch.topk where values are distinct")
        if rec.get("err", 0.0) > SUM_TOL:
            failures.append(f"{rec['case']}: err {rec['err']:.3g} > {SUM_TOL}")
        if rec.get("shape_ok") is False:
            failures.append(f"{rec['case']}: wrong shape")
        if "handshakes" in rec and rec["handshakes"] != (1 if rec["split"] else 0):
            failures.append(f"{rec['case']}: {rec['handshakes']} handshakes in one top_p_mask call "
                            f"({rec['rounds']} cut rounds)")
    assert not failures, "\n".join(failures[:20])


@pytest.fixture(scope="module")
def tp1_records() -> list[dict]:
    return sampling_cases(0, 1, 11)


def test_replicated_tp1(tp1_records: list[dict]) -> None:
    _check(tp1_records)


@pytest.fixture(scope="module")
def split_records() -> list[list[dict]]:
    """One launch of 4 ranks: tp 2, 3 and 4 each run on a real gloo group of ranks [0, tp)."""
    return run_ranks(sampling_cases, 4, 11, timeout_s=60)


@pytest.mark.ranks
def test_top_p_cuts_in_fixed_rounds_behind_one_handshake(split_records: list[list[dict]]) -> None:
    """Every split top_p_mask call, whatever its logits and thresholds, gathers the cut's four mass
    histograms and nothing else of its own (the denominator rides the vocab tree's collective)."""
    rounds = [r["rounds"] for records in split_records for r in records if "rounds" in r and r["split"]]
    assert rounds and set(rounds) == {RADIX_ROUNDS}


@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_split(split_records: list[list[dict]], tp1_records: list[dict], tp: int) -> None:
    per_rank = [[r for r in split_records[rank] if r["case"].startswith(f"tp={tp} ")] for rank in range(tp)]
    for records in per_rank:
        _check(records)
    # every rank of the group ran every case (and got the same global answers)
    assert len({len(r) for r in per_rank}) == 1 and len(per_rank[0]) == len(tp1_records)


def test_local_topk_tie_rule() -> None:
    x = torch.tensor([[1.0, 3, 3, 2, 3, 0], [5, 5, 5, 5, 5, 5]])
    vals, ids = local_topk(x, 2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert vals.tolist() == [[3, 3], [5, 5]]
    vals, ids = local_topk(x, 4)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("width", [1, 2 * MAX_BLOCK - 1, 2 * MAX_BLOCK, 5 * MAX_BLOCK + 3, 49152, 65537])
def test_first_max_is_torch_max(width: int) -> None:
    """The blocked argmax gives ``torch.max(x, dim=1)``'s values (bitwise) and first indices on rows
    of many ties, a -inf row, signed zeros, a NaN and a column-strided view."""
    g = torch.Generator().manual_seed(width)
    x = torch.randint(-4, 4, (6, width), generator=g).float()
    x[1] = float("-inf")
    x[2] = torch.where(x[2] > 0, torch.zeros_like(x[2]), -torch.zeros_like(x[2]))
    x[3, width // 2] = float("nan")
    x[4] = torch.randn(width, generator=g)
    views = [x, torch.cat([x, x], 1)[:, 1:width + 1]]
    for v in views:
        want, got = torch.max(v, dim=1), first_max(v)
        assert torch.equal(got[1], want.indices)
        assert torch.equal(got[0].view(torch.int32), want.values.view(torch.int32))
        assert torch.equal(nonfinite_rows(v), (torch.isnan(v) | (v == float("inf"))).any(dim=1))
    assert not nonfinite_rows(x[:, :0]).any() and nonfinite_rows(x[:, :0]).shape == (6,)


def test_ids_are_int64_beyond_float32_range() -> None:
    """Token ids above 2**24 are not representable in float32: they must travel as int64."""
    vocab = 2**24 + 3
    head = LMHead(vocab, 1, dtype=torch.float32)
    local = torch.full((1, vocab), -1.0)
    local[0, vocab - 2] = 7.0  # 2**24 + 1: a float32 would round it to 2**24
    ids = sampling.greedy(local, head)
    assert ids.dtype == torch.int64 and ids.item() == vocab - 2
    _, top = sampling.topk(local, head, 1)
    assert top.item() == vocab - 2


def test_replicated_errors_are_typed() -> None:
    head = LMHead(10, 2, dtype=torch.float32)
    good = torch.randn(3, 10)
    with pytest.raises(InputError, match="k must be"):
        sampling.topk(good, head, 11)
    with pytest.raises(InputError, match="NaN"):
        sampling.greedy(torch.full((3, 10), float("nan")), head)
    with pytest.raises(InputError, match="shape"):
        sampling.greedy(good[:, :9], head)
    with pytest.raises(InputError, match="token_ids"):
        sampling.logprobs(good, head, torch.tensor([0, 1, 10]))
    with pytest.raises(InputError, match="token_ids"):
        sampling.logprobs(good, head, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(InputError, match="min_p"):
        sampling.min_p_mask(good, head, 1.5)
    with pytest.raises(InputError, match="empty"):
        sampling.greedy(good[:0], head)


def test_attention_dp_without_lm_head_tp_is_plain_torch() -> None:
    """ADP without LM-head TP replicates the head: sampling needs no process group."""
    head = LMHead(50, 2, dtype=torch.float32,
                  mapping=Mapping(world_size=2, rank=1, tp_size=2, enable_attention_dp=True))
    assert not head.is_split
    g = torch.randn(4, 50)
    assert torch.equal(sampling.greedy(g, head), g.argmax(1))
