"""Every gather strategy of a split LMHead (docs/architecture.md, "Gather strategies"), with real gloo groups.

``gather_output=True`` (all-gather), ``False`` (local columns), ``"rank0"`` (rank 0 of the group gets
``[N, V]``, the others None), each with ``gather_chunk_rows`` None / 1 / 3 / 7 / 100: the logits are
bitwise those of the one-collective all-gather at tp 1, 2 and 3, uneven and padded, float32 and
bfloat16, through ``LMHead`` and ``LogitsProcessor``; a deterministic head's are bitwise the replicated
head's at every tp. Attention DP with LM-head TP, chunked, gives every rank its own rows bitwise; a rank
that fails in a steady chunked call makes its peers raise. A wrong value is a ConfigError naming the
choices. tp 2 and tp 3 share one launch of 3 ranks (``tests.parallel.rank_fns.subgroups``).
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.gather_rank_fns import gather_mode_cases
from trtvocab import LMHead, Mapping
from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import run_ranks

# 2 dtypes x 2 layouts x 2 determinism
CASES_PER_TP = 8


def _check(records: list[dict]) -> None:
    failures = []
    for rec in records:
        if rec.get("failure"):
            want = "InputError" if rec["rank"] == 1 else "PeerRankError"
            if rec["True"] != want or rec["rank0"] != want:
                failures.append(f"{rec['case']} rank {rec['rank']}: {rec['True']}, {rec['rank0']} (want {want})")
        elif rec.get("adp"):
            if not rec["ok"]:
                failures.append(f"{rec['case']} rank {rec['rank']}")
        else:
            if rec["matches_replicated"] is False:
                failures.append(f"{rec['case']} rank {rec['rank']}: not the replicated head's bits")
            if not rec["local"]:
                failures.append(f"{rec['case']} rank {rec['rank']}: local columns differ")
            failures += [f"{rec['case']} rank {rec['rank']}: mode {m['mode']!r} chunk {m['rows']}"
                         for m in rec["modes"] if not m["ok"]]
    assert not failures, "\n".join(failures)


def test_tp1_every_mode_in_process() -> None:
    records = gather_mode_cases(0, 1, seed=7)
    assert len(records) == CASES_PER_TP
    _check(records)


@pytest.mark.ranks
def test_every_mode_at_tp2_and_tp3() -> None:
    per_rank = run_ranks(gather_mode_cases, 3, 7, timeout_s=90)
    for tp in (2, 3):
        for rank in range(tp):
            records = [r for r in per_rank[rank] if r["tp"] == tp]
            assert sum(1 for r in records if "modes" in r) == CASES_PER_TP
            assert sum(1 for r in records if r.get("adp")) == 3
            assert sum(1 for r in records if r.get("failure")) == 1
            _check(records)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"gather_output": "rank1"}, ["True", "False", "'rank0'", "'rank1'"]),
    ({"gather_output": 1}, ["'rank0'", "got 1"]),
    ({"gather_output": None}, ["'rank0'"]),
    ({"gather_chunk_rows": 0}, ["gather_chunk_rows", ">= 1"]),
    ({"gather_chunk_rows": 2.0}, ["gather_chunk_rows"]),
    ({"gather_chunk_rows": True}, ["gather_chunk_rows"]),
    ({"gather_output": False, "gather_chunk_rows": 4}, ["gather_output=True or 'rank0'"]),
])
def test_a_wrong_gather_value_is_a_config_error_naming_the_choices(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        LMHead(10, 4, dtype=torch.float32, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_rank0_with_attention_dp_is_refused_and_settable_values_are_checked() -> None:
    mapping = Mapping(world_size=2, rank=0, tp_size=2, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
    with pytest.raises(ConfigError, match="attention DP"):
        LMHead(10, 4, dtype=torch.float32, mapping=mapping, gather_output="rank0", process_group=None)
    head = LMHead(10, 4, dtype=torch.float32, gather_output="rank0", gather_chunk_rows=3)
    assert "gather_output='rank0', gather_chunk_rows=3" in repr(head)
    with pytest.raises(ConfigError, match="'rank0'"):
        head.gather_output = "all"
    with pytest.raises(ConfigError, match="gather_chunk_rows"):
        head.gather_chunk_rows = -1
    head.gather_output = True
    assert head.gather_output is True and head.gather_chunk_rows == 3
