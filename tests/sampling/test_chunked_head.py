"""trtvocab.sampling.chunked: greedy / top-k / logsumexp / logprobs / seeded sample streamed over
vocab chunks equal the materialized path (``head.local_logits`` then trtvocab.sampling) bitwise.

* ids (greedy, top-k, sampled), top-k values, and the vocab-tree logsumexp / logprobs: bitwise, at
  chunk sizes 1, 7, the shard's size and larger, dense bf16 / fp32 / bf16 with float32 logits /
  deterministic bf16, FP8 W8A8 (dynamic), NVFP4 W4A4 and W4A16, tp 1 and tp 3 (uneven and padded).
* logsumexp / logprobs against ``sampling.logsumexp`` / ``logprobs``: bitwise for every head (both
  compute the fixed vocab tree of ``trtvocab.sampling.treesum``, in one pass).
* the budget picks chunking by itself; the chunked peak memory stays far below ``[B, V]`` float32;
  bad input on one rank raises on every rank.
* ``sampling.decode`` streams when the batch's float32 ``[B, V_local]`` exceeds the head's budget:
  the same ids bitwise as the materialized step (greedy, seeded, top-p, vocab_limit, bitmask; steady
  steps too), tp 1 and tp 3; ``LMHead.column_logits`` of the whole shard is ``local_logits``' bits.

Every multi-rank case runs in one launch of three ranks (:func:`chunked_rank_fns.all_cases`; tp 2 on
a subgroup of it).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.sampling.chunked_rank_fns import (
    FORMATS,
    all_cases,
    decode_cases,
    equality_cases,
    long_nucleus_cases,
    make_head,
)
from trtvocab import LMHead
from trtvocab.errors import ConfigError, InputError
from trtvocab.sampling import SamplingParams, chunked

SEED = 5
WORLD = 3
NUCLEUS_SPLITS = [(3, 64 * 1024), (2, 96000)]  # (tp, logits budget) of the multi-rank long-nucleus cases


@pytest.fixture(scope="module")
def launched(launch_ranks: Callable[..., list[Any]]) -> list[dict[str, Any]]:
    return launch_ranks(all_cases, WORLD, SEED, NUCLEUS_SPLITS, timeout_s=120)


def _check(records: list[dict]) -> None:
    assert records
    failures = []
    for r in records:
        for key in ("greedy", "topk", "sample", "sample_limited", "sample_top_p"):
            if r.get(key) is False:
                failures.append(f"{r['case']}: {key} differs")
        if not (r["lse_materialized"] and r["logprobs_materialized"]):
            failures.append(f"{r['case']}: logsumexp / logprobs not bitwise (max err {r['lse_err']:.3g})")
    assert not failures, "\n".join(failures[:20])


def test_tp1_chunked_equals_materialized() -> None:
    records = equality_cases(0, 1, SEED)
    _check(records)
    assert {r["fmt"] for r in records} >= {"bf16", "fp32", "FP8 W8A8-dyn", "NVFP4 W4A4"}


@pytest.mark.ranks
def test_tp3_uneven_and_padded_chunked_equals_materialized(launched: list[dict[str, Any]]) -> None:
    per_rank = [r["equality"] for r in launched]
    for records in per_rank:
        _check(records)
        assert {c.split()[-2] for c in (r["case"] for r in records)} == {"uneven", "padded"}
    answers = [[r["ids"] for r in records] for records in per_rank]
    assert answers[0] == answers[1] == answers[2]  # every rank got the same seeded ids


def _check_decode(records: list[dict[str, Any]]) -> None:
    assert records
    for r in records:
        assert r["streams"] == [False, True], r["case"]  # the default budget materializes, the small one streams
        assert r["column_logits"], r["case"]
        assert r["equal"], r["case"]


def test_decode_above_the_budget_streams_with_the_same_ids_tp1() -> None:
    records = decode_cases(0, 1, SEED)
    _check_decode(records)
    assert len(records) == len(FORMATS)


@pytest.mark.ranks
def test_decode_above_the_budget_streams_with_the_same_ids_tp3(launched: list[dict[str, Any]]) -> None:
    per_rank = [r["decode"] for r in launched]
    for records in per_rank:
        _check_decode(records)
    assert [[r["ids"] for r in records] for records in per_rank].count([r["ids"] for r in per_rank[0]]) == WORLD


@pytest.mark.ranks
def test_bad_input_on_one_rank_raises_on_every_rank(launched: list[dict[str, Any]]) -> None:
    per_rank = [r["bad input"] for r in launched]
    bad_rank = {"nan hidden": 1, "wrong shape": 2, "bad k": 1, "bad chunk": 2, "bad token ids": 1}
    for case, culprit in bad_rank.items():
        for rank, out in enumerate(per_rank):
            kind, _ = out[case]
            if case == "bad token ids":
                assert kind in ("InputError", "PeerRankError"), (case, rank, out[case])
                continue
            want = "InputError" if rank == culprit else "PeerRankError"
            assert kind == want, (case, rank, out[case])
    assert "NaN" in per_rank[1]["nan hidden"][1] or "finite" in per_rank[1]["nan hidden"][1]
    for out in per_rank:
        assert out["wrong rows"][0] == "RankMismatchError" and "batch rows" in out["wrong rows"][1]
        assert out["top_p"] == ("ok", "")
        assert out["different params"][0] == "RankMismatchError"
        assert out["healthy after"] == ("ok", "")
        assert out["decode steady"][0] == "ok" and out["decode healthy after"][0] == "ok"
        assert out["decode wrong rows"][0] == "RankMismatchError" and "batch rows" in out["decode wrong rows"][1]
        assert out["decode materialized rank"][0] == "RankMismatchError"
    assert [out["decode nan hidden"][0] for out in per_rank] == ["PeerRankError", "InputError", "PeerRankError"]
    assert len({str(out["decode healthy after"]) for out in per_rank}) == 1


def test_each_weight_format_declares_its_own_gemm_tiles() -> None:
    """The chunk split is read from the weight format (``WeightMethod.gemm_tiles``, declared next to its
    GEMM), and the format's GEMM over each declared tile gives the whole-shard call's columns bitwise."""
    from trtvocab.weights import base, dense, fp8, gguf, nvfp4

    for cls in (dense.DenseWeight, fp8.FP8Weight, nvfp4.NVFP4Weight, gguf.GGUFWeight):
        assert cls.gemm_tiles is not base.WeightMethod.gemm_tiles, cls.__name__
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    for fmt in FORMATS:
        head = make_head(fmt, None, "uneven", None, vocab=3001, seed=1)
        tiles = head.gemm_tiles()
        assert chunked.gemm_tiles(head) == tiles
        assert tiles[0][0] == 0 and tiles[-1][1] == head.shard.size
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(tiles)), fmt
        whole = head.local_logits(x.to(head.dtype))
        parts = torch.cat([head.column_logits(x.to(head.dtype), lo, hi) for lo, hi in tiles], dim=1)
        assert torch.equal(parts, whole), fmt
        chunks = chunked.plan_chunks(head, x.shape[0], 700)
        assert [t for c in chunks for t in c] == tiles  # chunks are runs of the declared tiles


def test_budget_chooses_chunking() -> None:
    budget = chunked.STREAM_BYTES_PER_LOGIT * 8 * 1000
    head = make_head("fp32", None, "uneven", None, vocab=3001, logits_budget_bytes=budget)
    assert chunked.chunk_columns(head, 8, None) == 1000  # 8 rows x 3001 columns of float32 > the budget
    assert len(chunked.plan_chunks(head, 8, None)) > 1
    assert chunked.plan_chunks(head, 2, None) == [chunked.gemm_tiles(head)]  # fits: one chunk, one GEMM
    widths = [c[-1][1] - c[0][0] for c in chunked.plan_chunks(head, 8, None)]
    assert max(widths) < 1000 + 2 * chunked.DENSE_TILE and sum(widths) == 3001
    x = torch.randn(8, head.hidden_size)
    assert torch.equal(chunked.stream_greedy(x, head), chunked.stream_greedy(x, head, chunk=10**6))
    default = LMHead(10, 4)
    assert default.logits_budget_bytes == 256 << 20
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ConfigError, match="logits_budget_bytes"):
            LMHead(10, 4, logits_budget_bytes=bad)  # type: ignore[arg-type]


PEAK_SCRIPT = """
import json, re, sys, torch
from trtvocab import LMHead, sampling
from trtvocab.sampling import SamplingParams, chunked

def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

op, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
B, V, H = 256, 65536, 64
head = LMHead(V, H, dtype=torch.float32, logits_budget_bytes=4 << 20)
with torch.no_grad():
    head.weights.weight.normal_(generator=torch.Generator().manual_seed(0))
x = torch.randn(B, H)
params = SamplingParams(temperature=0.8, top_k=20, seed=3)
def run(x):
    if mode == "materialized":
        local = head.local_logits(x)
        return {"greedy": lambda: sampling.greedy(local, head), "topk": lambda: sampling.topk(local, head, 8),
                "logsumexp": lambda: sampling.logsumexp(local, head),
                "sample": lambda: sampling.sample(local, head, params)}[op]()
    return {"greedy": lambda: chunked.stream_greedy(x, head), "topk": lambda: chunked.stream_topk(x, head, 8),
            "logsumexp": lambda: chunked.stream_logsumexp(x, head),
            "sample": lambda: chunked.stream_sample(x, head, params)}[op]()
run(x[:2])  # warm-up: lazy imports and allocator set-up are not the call
base = rss()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
run(x)
print(json.dumps({"peak_delta": hwm() - base}))
"""


def _peak(op: str, mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, op, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_delta"])


@pytest.mark.subprocess
@pytest.mark.parametrize("op", ["greedy", "sample"])
def test_chunked_peak_memory_is_far_below_the_logits(op: str) -> None:
    """B=256, V=65536: the materialized float32 logits are 64 MiB; the chunked call (a 4 MiB budget)
    peaks at a small multiple of one chunk (peak RSS of a fresh process, not a timing)."""
    logits_bytes = 256 * 65536 * 4
    chunked_peak = _peak(op, "chunked")
    materialized_peak = _peak(op, "materialized")
    assert materialized_peak >= logits_bytes * 0.9, materialized_peak
    assert chunked_peak <= 0.35 * logits_bytes, (chunked_peak, materialized_peak)


def _long_nuclei(per_rank: list[dict[str, Any]]) -> None:
    assert per_rank
    for out in per_rank:
        for fmt, r in out.items():
            assert r["equal"], fmt
            assert r["long rows"] >= 1, fmt  # the T = 5, top-p 0.99 row's nucleus outgrew 1024 candidates
    assert len({str(out) for out in per_rank}) == 1


def test_long_nuclei_past_the_candidates_still_equal_the_materialized_path_tp1() -> None:
    _long_nuclei([long_nucleus_cases(0, 1, 64 * 1024)])


@pytest.mark.ranks
@pytest.mark.parametrize(("tp", "budget"), NUCLEUS_SPLITS)
def test_long_nuclei_past_the_candidates_still_equal_the_materialized_path(launched: list[dict[str, Any]], tp: int,
                                                                           budget: int) -> None:
    # tp 2, 96000 bytes: shards of 1501 and 1500 columns, where a per-rank group size would differ
    per_rank = [r["long nucleus"][tp, budget] for r in launched]
    assert per_rank[tp:] == [None] * (WORLD - tp)  # ranks outside the tp group sat the case out
    _long_nuclei(per_rank[:tp])


def test_nan_logits_from_an_overflowing_gemm_raise_input_error() -> None:
    # Hidden states near float32's max: the GEMM's partial sums overflow to +inf and -inf, so some
    # logits are NaN. Every streamed operation must say so (not fail inside its top-k selection).
    torch.manual_seed(0)
    head = LMHead(300, 4, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(300, 4)})
    x = torch.full((2, 4), 3e38)
    assert bool(torch.isnan(head.local_logits(x)).any())
    calls = {"topk": lambda: chunked.stream_topk(x, head, 3, chunk=100),
             "sample top-k": lambda: chunked.stream_sample(x, head, SamplingParams(top_k=3, seed=1), chunk=100),
             "sample top-p": lambda: chunked.stream_sample(x, head, SamplingParams(top_p=0.9, seed=1), chunk=100),
             "logsumexp": lambda: chunked.stream_logsumexp(x, head, chunk=100),
             "greedy": lambda: chunked.stream_greedy(x, head, chunk=100)}
    for call in calls.values():
        with pytest.raises(InputError, match="NaN"):
            call()
