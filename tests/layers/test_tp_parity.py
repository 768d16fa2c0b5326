"""TP parity (contract §1.4, docs/contract.md) with real gloo process groups: tp 1..5, V 30522 and 30011 (prime).

For every case a rank builds the single-device head and the split head from the same
weights and compares both against ``x.double() @ W.double().T`` (W as the head stores
it, so bf16 rounding of the weights is not counted as error):

* error of the gathered TP logits <= 2 x the single-device error + ``ulp_floor``
  (4 ulps of the output dtype at the largest |logit|; see ``rank_fns.ulp_floor``);
* argmax and top-k ids (tie rule: value desc, id asc) exactly equal to single-device;
* ``gather_output=False`` gives columns ``[vocab_start, vocab_end)`` to the same bound;
* attention DP: replicated without LM-head TP; with it, ranks bring 3/0/5/1/2 rows and
  each gets its own rows back with all V columns;
* world 4 as two TP groups of 2 (``distributed.new_tp_group``).

Spawning costs seconds per process, so tp 2..5 share ONE launch of 5 ranks: the
tp-``n`` phase runs on a real gloo group of ranks ``[0, n)`` (the default group for
n = 5) while the other ranks skip it. The rank function loops over the cases and
returns per-case numbers; the assertions are made here.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.parallel.rank_fns import ADP_ROWS, parity_cases
from trtvocab.parallel.launch import run_ranks


def _check(records: list[dict]) -> None:
    failures = []
    for rec in records:
        bound = 2 * rec["err_single"] + rec["floor"]
        if rec["err_tp"] > bound:
            failures.append(f"{rec['case']}: err_tp {rec['err_tp']:.3g} > 2 x {rec['err_single']:.3g} "
                            f"+ floor {rec['floor']:.3g}")
        if not rec["argmax_equal"]:
            failures.append(f"{rec['case']}: argmax differs from single-device")
        if not rec["topk_equal"]:
            failures.append(f"{rec['case']}: top-k ids differ from single-device")
        if rec.get("local_shape_ok") is False:
            failures.append(f"{rec['case']}: gather_output=False returned the wrong shape")
        if "is_split" in rec and rec["is_split"] != rec["expect_split"]:
            failures.append(f"{rec['case']}: is_split={rec['is_split']}")
        if rec.get("rows_ok") is False:
            failures.append(f"{rec['case']}: did not get back its own rows")
        if rec.get("processor_ok") is False:
            failures.append(f"{rec['case']}: LogitsProcessor under attention DP gave the wrong rows")
    assert not failures, "\n".join(failures)


def _cases_per_tp(records: list[dict]) -> Counter:
    return Counter(r["case"].split()[0] for r in records)


def test_tp1_in_process() -> None:
    """tp 1: the head is replicated and equals the single-device head bitwise."""
    records = parity_cases(0, 1, seed=5)
    _check(records)
    assert all(r["bitwise"] for r in records)
    # 2 vocabs x 2 dtypes x 2 layouts x (gathered, local) + 2 vocabs x 2 ADP modes
    assert _cases_per_tp(records) == {"tp=1": 20}


@pytest.fixture(scope="module")
def tp_records() -> list[list[dict]]:
    return run_ranks(parity_cases, 5, 5, timeout_s=90)


@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 3, 4, 5])
def test_tp_parity(tp_records: list[list[dict]], tp: int) -> None:
    for rank in range(tp):
        records = [r for r in tp_records[rank] if r["case"].startswith(f"tp={tp} ")]
        assert len(records) == 20, f"rank {rank}: {len(records)} cases for tp={tp}"
        _check(records)
        gathered = [r for r in records if r["case"].endswith("gathered")]
        assert all(r["shape"][1] in (30522, 30011) for r in gathered)
        for rec in (r for r in records if "ADP" in r["case"]):
            assert rec["shape"] == [ADP_ROWS[rank], int(rec["case"].split()[1][2:])], rec["case"]
    for rank in range(tp, 5):  # ranks outside the tp group ran none of its cases
        assert not [r for r in tp_records[rank] if r["case"].startswith(f"tp={tp} ")]


@pytest.mark.ranks
def test_two_tp_groups_of_two(tp_records: list[list[dict]]) -> None:
    records = [r for rank in range(4) for r in tp_records[rank] if r["case"].startswith("world=4")]
    assert len(records) == 4
    _check(records)
