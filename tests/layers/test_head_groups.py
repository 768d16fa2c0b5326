"""An LM head split over a group of its own (``Mapping(..., lm_head_tp_size=N)``; docs/architecture.md,
"Head groups"), with real gloo groups: the logits each rank gets back and the greedy and seeded ids of
``sampling.decode``, ``DecodeStep`` and ``sample`` equal the replicated head's (tp 1) in every arrangement —
world 4 as a TP group of 4 with the head over 2, as 2 attention-DP head groups of 2, as attention DP with
``tp_size`` 2 and the head over 4; world 8 as attention TP 2 x DP 4 with the head over 4 (pairs bringing
their rows once or twice) and as 2 TP groups of 4 with the head over 2. Ranks built for other arrangements
raise naming ``head groups``; ``plan --lm-head-tp`` prices what a head group sends, byte for byte; bad
values are ConfigErrors naming the field.
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.head_group_rank_fns import ROWS, WIRE_ROWS, arrangements, reference
from trtvocab import LMHead, Mapping
from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import run_ranks
from trtvocab.pipeline.plan import make_plan
from trtvocab.sampling.reductions import HANDSHAKE as SAMPLING_HANDSHAKE

V, H = 1001, 16


def _check(per_rank: list[list[dict]]) -> int:
    """Assert every record against the replicated head; return how many arrangement records were checked."""
    checked = 0
    for recs in per_rank:
        for rec in recs:
            if rec["case"] in ("mismatch", "wire"):
                continue
            tag = f"{rec['case']}, rank {rec['rank']}"
            ref = reference(rec["rows"])
            assert torch.equal(rec["logits"], ref["logits"]), tag
            group = reference(rec.get("group rows", rec["rows"]))
            for how in ("decode", "step"):
                for seeded in (False, True):
                    key = f"ids seeded={seeded}"
                    assert rec[how][key] == group[key], (tag, how, seeded)
            for seeded in (False, True):
                if f"sample seeded={seeded}" in rec:
                    assert rec[f"sample seeded={seeded}"] == group[f"ids seeded={seeded}"], (tag, seeded)
            checked += 1
    return checked


@pytest.mark.ranks
def test_world_4_arrangements_equal_tp1_and_plan_prices_them() -> None:
    per_rank = run_ranks(arrangements, 4, timeout_s=180)
    assert _check(per_rank) == 3 * 4
    assert [r["tp"] for r in per_rank[0][:3]] == [2, 2, 4]
    for rank in (0, 1):  # one group of 2 built for two arrangements: both ranks name the field
        rec = next(r for r in per_rank[rank] if r["case"] == "mismatch")
        assert rec["error"] == "RankMismatchError" and "head groups" in rec["message"], rec
    wire = [next(r for r in recs if r["case"] == "wire") for recs in per_rank]
    busiest = max(r["group rows"] for r in wire)
    plan = make_plan(V, H, 4, busiest, lm_head_tp=2, adp_rows=list(WIRE_ROWS), logits_bytes=4)
    assert (plan.tp_size, plan.lm_head_tp_size, plan.head_groups) == (4, 2, 2)
    assert plan.forward is not None and plan.decode_step is not None
    for rec in wire[2:]:  # the group that brings the most rows: the one plan prices
        for i, events in enumerate(rec["forward"]):
            assert [tuple(e) for e in events] == [(c.kind, c.bytes) for c in plan.forward.first], (rec["rank"], i)
        # The decode step over a head group is sampling.decode at tp 2 on the group's rows: every
        # collective spans the 2 ranks (what plan's decode_step prices is checked by test_plan_wire).
        assert all(len(events) == len(rec["decode"][-1]) for events in rec["decode"][1:])
        assert rec["decode"][0][0][1] == (1 + len(SAMPLING_HANDSHAKE.fields)) * 8  # the first call's handshake


@pytest.mark.ranks
def test_world_8_arrangements_equal_tp1() -> None:
    per_rank = run_ranks(arrangements, 8, timeout_s=240)
    assert _check(per_rank) == 3 * 8


@pytest.mark.parametrize(("kw", "words"), [
    ({"lm_head_tp_size": 3}, ["lm_head_tp_size (3)", "divide world_size (4)"]),
    ({"lm_head_tp_size": 0}, ["lm_head_tp_size", ">= 1"]),
    ({"lm_head_tp_size": True}, ["lm_head_tp_size", "got True"]),
    ({"lm_head_tp_size": 2.0}, ["lm_head_tp_size", "got 2.0"]),
    ({"lm_head_tp_size": "2"}, ["lm_head_tp_size"]),
    ({"lm_head_tp_size": 8}, ["lm_head_tp_size (8)", "divide world_size (4)"]),
    ({"tp_size": 2, "lm_head_tp_size": 4}, ["lm_head_tp_size (4)", "divide tp_size (2)", "enable_attention_dp"]),
    ({"enable_attention_dp": True, "lm_head_tp_size": 2}, ["lm_head_tp_size (2)", "enable_lm_head_tp_in_adp"]),
])
def test_bad_head_tp_is_a_config_error_naming_the_field(kw: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        Mapping(**{"world_size": 4, "rank": 0, "tp_size": 4, **kw})
    for word in words:
        assert word in str(info.value)


def test_mapping_groups_and_defaults() -> None:
    assert Mapping(world_size=4, rank=3, tp_size=4).lm_head_tp_size == 4
    m = Mapping(world_size=8, rank=5, tp_size=2, enable_attention_dp=True, enable_lm_head_tp_in_adp=True,
                lm_head_tp_size=4)
    assert (m.lm_head_tp_rank, m.lm_head_tp_group, m.tp_group, m.lm_head_is_split) == (1, [4, 5, 6, 7], [4, 5], True)
    assert not Mapping(world_size=4, rank=1, tp_size=4, lm_head_tp_size=1).lm_head_is_split
    assert Mapping(**m.model_dump()) == m  # round-trips (manifests, pickles to the ranks)
    # A head group of its own needs its process group: without torch.distributed, a ConfigError.
    with pytest.raises(ConfigError, match="process_group"):
        LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=4, rank=0, tp_size=4, lm_head_tp_size=2))


def test_plan_prices_head_groups_and_refuses_bad_values() -> None:
    whole, groups = make_plan(V, H, 8, 4), make_plan(V, H, 8, 4, lm_head_tp=4)
    assert (groups.tp_size, groups.lm_head_tp_size, groups.head_groups, len(groups.ranks)) == (8, 4, 2, 4)
    assert groups.matrices.bytes_per_rank > whole.matrices.bytes_per_rank  # V / 4 rows a rank, not V / 8
    assert groups.forward is not None and groups.decode_step is not None
    # every collective spans a head group of 4 ranks: each receives its 3 peers' pieces (8 ranks: 7)
    assert all(c.wire_recv_bytes == 3 * c.bytes for c in groups.decode_step.steady + groups.forward.steady)
    assert all(c.wire_recv_bytes == 7 * c.bytes for c in whole.decode_step.steady)
    adp = make_plan(V, H, 4, ROWS, lm_head_tp=2, adp_rows=[1, 0, 6, 5])
    assert adp.forward is not None and "[6, H]" in adp.forward.first[1].what  # the group {2, 3} brings the most
    for bad, word in ((3, "must divide `tp` (8)"), (0, "`lm_head_tp`"), (16, "`lm_head_tp`")):
        with pytest.raises(ConfigError, match=word.replace("(", r"\(").replace(")", r"\)")):
            make_plan(V, H, 8, 4, lm_head_tp=bad)
