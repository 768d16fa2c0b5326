"""Seeded sampling without the gather, and xgrammar's bitmask per shard.

* Same seeded ids at tp 1, 2, 3, 5 (uneven) and 4 (padded): the noise is keyed by token id.
* Chi-square: the draws follow softmax(logits / T), and after top-k / top-p / min-p the
  renormalized distribution (expected probabilities computed independently in float64).
* Bitmasks: every shard's masked columns, gathered, equal ``xgrammar.apply_token_bitmask_inplace``
  on the full logits; a mask narrower than V disallows the ids it does not cover.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tests.sampling.draw_rank_fns import (
    ROWS,
    VOCAB,
    draw_cases,
    gathered_logits,
    group_cases,
    random_bitmask,
    row_params,
    tiny_temperature_cases,
)
from trtvocab import LMHead
from trtvocab.errors import InputError, KeywordOnlyError
from trtvocab.parallel.launch import run_ranks
from trtvocab.sampling import SamplingParams, greedy, sample
from trtvocab.sampling.noise import row_keys, uniforms

SEED = 21


@pytest.fixture(scope="module")
def records() -> list[dict]:
    per_rank = run_ranks(draw_cases, 5, SEED, timeout_s=60)
    return per_rank[0]  # rank 0 takes part in every case


@pytest.mark.ranks
def test_seeded_ids_are_the_same_at_every_tp(records: list[dict]) -> None:
    assert [r["case"] for r in records] == ["tp=1 uneven", "tp=2 uneven", "tp=3 uneven", "tp=5 uneven",
                                             "tp=4 padded"]
    for key in ("ids", "ids_next_step", "limited"):
        assert all(r[key] == records[0][key] for r in records), key
    g = gathered_logits(SEED)
    ids = records[0]["ids"]
    assert ids[5] == int(g[5].argmax()) and ids[6] == int(g[6].argmax())  # T = 0 and top-1 are greedy
    assert records[0]["ids"] != records[0]["ids_next_step"]  # the step is part of the key
    assert all(i < 500 for i in records[0]["limited"])


@pytest.mark.ranks
@pytest.mark.model
def test_bitmask_per_shard_equals_xgrammar(records: list[dict]) -> None:
    xgr = pytest.importorskip("xgrammar")
    g = gathered_logits(SEED)
    for words in ((VOCAB + 31) // 32, 20):
        want = g.clone()
        bitmask = random_bitmask(SEED + words, words)
        covered = min(VOCAB, 32 * words)
        view = want[:, :covered].contiguous()
        xgr.apply_token_bitmask_inplace(view, bitmask, vocab_size=covered)
        want[:, :covered] = view
        want[:, covered:] = float("-inf")  # not covered by the mask: not allowed (xgrammar leaves them)
        allowed = ~torch.isneginf(want)
        for r in records:
            m = r["masked"][words]
            assert np.array_equal(m["logits"], want.numpy()), (r["case"], words)
            assert m["padding_ok"], r["case"]
            assert all(bool(allowed[row, i]) for row, i in enumerate(m["ids"])), (r["case"], words)
            assert m["ids"] == records[0]["masked"][words]["ids"]
            assert m["greedy_ok"] == want.argmax(1).tolist(), r["case"]
        assert records[0]["masked"][words]["ids"][0] in (3, 1000)


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered, renormalized distribution in float64, written out plainly (vLLM's order)."""
    x = logits.double() / p.temperature
    order = torch.sort(x, descending=True, stable=True).indices
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k:
        keep[order[p.top_k :]] = False
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    if p.top_p < 1:
        sorted_p = probs[order]
        before = torch.cumsum(sorted_p, 0) - sorted_p
        inside = before < p.top_p
        inside[0] = True
        nucleus = torch.zeros_like(keep)
        nucleus[order[inside]] = True
        keep &= nucleus
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    return torch.softmax(x.masked_fill(~keep, float("-inf")), 0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=1.7, top_k=6),
    SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05),
], ids=lambda p: f"T={p.temperature},k={p.top_k},p={p.top_p},m={p.min_p}")
def test_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    """20000 seeded draws (one per seed) from one row of 16 logits: chi-square against the
    independent float64 expectation; filtered-out tokens are never drawn."""
    n = 20000
    logits = torch.linspace(-2.0, 1.5, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(4))]
    head = LMHead(16, 4, dtype=torch.float32)
    rows = [params.model_copy(update={"seed": s}) for s in range(n)]
    ids = sample(logits.expand(n, 16).contiguous(), head, rows, step=0)
    counts = torch.bincount(ids, minlength=16).double()
    expected = _expected(logits, params)
    assert counts[expected == 0].sum() == 0  # filtered-out tokens are never drawn
    present = expected > 0
    result = stats.chisquare(counts[present].numpy(), (expected[present] * n).numpy())
    assert result.pvalue > 1e-3, (result, counts.tolist(), (expected * n).tolist())


def test_uniforms_are_uniform_and_keyed_by_token_id() -> None:
    keys = row_keys([0, 1, 2**62], 5)
    u = uniforms(keys, torch.arange(200000))
    assert float(u.min()) > 0 and float(u.max()) < 1
    for row in u:  # Kolmogorov-Smirnov against U(0, 1)
        assert stats.kstest(row.numpy(), "uniform").pvalue > 1e-3
    assert torch.equal(uniforms(keys, torch.arange(1000, 1100)), u[:, 1000:1100])  # a shard sees its own ids
    assert not torch.equal(uniforms(row_keys([0], 6), torch.arange(10)), u[:1, :10])


def test_temperature_zero_equals_greedy_and_unseeded_rows_vary() -> None:
    g = gathered_logits(3)
    head = LMHead(VOCAB, 4, dtype=torch.float32)
    assert torch.equal(sample(g, head, SamplingParams(temperature=0.0)), greedy(g, head))
    draws = {tuple(sample(g, head, SamplingParams()).tolist()) for _ in range(3)}
    assert len(draws) > 1  # seed=None: a fresh seed per call


def test_tiny_and_subnormal_temperatures_draw_the_argmax_tp1() -> None:
    """Tiny and subnormal temperatures: T from below 1e-45 up to GREEDY_BELOW acts as greedy,
    with or without top-k / top-p / (subnormal) min-p, materialized and chunked."""
    out = tiny_temperature_cases(0, 1, 11)
    assert not out["wrong"], "\n".join(out["wrong"][:20])


@pytest.fixture(scope="module")
def group() -> list[dict]:
    """The second and last launch of the module: every tp 3 case that is not a ``draw_cases`` one."""
    return run_ranks(group_cases, 3, timeout_s=120)


@pytest.mark.ranks
def test_tiny_temperatures_draw_the_argmax_tp3(group: list[dict]) -> None:
    per_rank = [out["tiny"] for out in group]
    for out in per_rank:
        assert not out["wrong"], "\n".join(out["wrong"][:20])
    assert per_rank[0]["greedy"] == per_rank[1]["greedy"] == per_rank[2]["greedy"]


def test_greedy_below_is_the_documented_limit() -> None:
    from trtvocab.sampling.params import GREEDY_BELOW

    assert GREEDY_BELOW == 1e-5
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams().greedy
    g = gathered_logits(4)
    head = LMHead(VOCAB, 4, dtype=torch.float32)
    # just above the limit the draw still samples (a flat row: logits 0, ties everywhere)
    flat = torch.zeros(ROWS, VOCAB)
    draws = {tuple(sample(flat, head, SamplingParams(temperature=1e-5, seed=s)).tolist()) for s in range(3)}
    assert len(draws) > 1
    assert torch.equal(sample(g, head, SamplingParams(temperature=1e-40, seed=1)), greedy(g, head))


@pytest.mark.ranks
def test_seeds_equal_as_float64_are_a_mismatch(group: list[dict]) -> None:
    """Seeds (and steps) 2**60 on ranks 0, 2 and 2**60 + 1 on rank 1 fail the handshake on every rank."""
    results = [out["seeds"] for out in group]
    for case in ("sample seed", "decode seed", "chunked seed", "sample step", "chunked step"):
        for rank, got in enumerate(results):
            kind, message = got[case]
            assert kind == "RankMismatchError", (case, rank, kind, message)
    assert all(r["healthy after"] == ("ok", "") for r in results)


def test_sampling_params_are_keyword_only() -> None:
    with pytest.raises(TypeError, match=r"keyword-only.*temperature=0\.5"):
        SamplingParams(0.5)  # type: ignore[misc]
    with pytest.raises(KeywordOnlyError, match="keyword-only"):
        SamplingParams(0.5, 3, seed=1)  # type: ignore[misc]
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_sampling_params_are_validated() -> None:
    for field, value in (("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_k", 1.5),
                         ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 2), ("seed", -3),
                         ("seed", True), ("temperature", "hot"), ("top_k", 2**63)):
        with pytest.raises(InputError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})


@pytest.mark.ranks
def test_bad_arguments_raise_on_every_rank(group: list[dict]) -> None:
    want = {
        "params count": ("InputError", "PeerRankError", "params has 3 entries"),
        "params type": ("InputError", "PeerRankError", "params must be a SamplingParams"),
        "step": ("InputError", "PeerRankError", "step must be an int >= 0"),
        "vocab_limit": ("InputError", "PeerRankError", "vocab_limit must be an int"),
        # rank 1's rows run no top-k while the others' do: a different sampling plan
        "different params": ("RankMismatchError", "RankMismatchError", "sampling plan"),
        "bitmask dtype": ("InputError", "PeerRankError", "bitmask must be an int32"),
        "bitmask rows": ("InputError", "PeerRankError", "bitmask has 3 rows"),
        "nothing allowed": ("InputError", "InputError", "allow no token"),
        "healthy after": ("ok", "ok", ""),
    }
    results = [out["bad"] for out in group]
    for case, (bad_type, other_type, fragment) in want.items():
        for rank, got in enumerate(results):
            kind, message = got[case]
            assert kind == (bad_type if rank == 1 else other_type), (case, rank, kind, message)
            if rank == 1 or bad_type == other_type:
                assert fragment in message, (case, message)
    assert ROWS == len(row_params())
