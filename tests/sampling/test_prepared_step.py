"""The prepared decode step (trtvocab.sampling.DecodeStep): today's numbers, no host read, one graph.

The independent reference is :func:`trtvocab.sampling.decode_output`, the step the parity tests
against transformers and vLLM keep honest: the prepared step must give its ids, logprobs and token
counts **bitwise**, step after step, for every knob, at tp 1 (in process) and at tp 2 / 3 (real gloo
ranks, uneven and padded). Host reads of device values are counted with a ``TorchFunctionMode``
(:class:`trtvocab.base.host_reads.HostReads`): a new ``bool(t.any())`` in the step fails here.
Compiled: ``torch._dynamo.explain`` finds one graph and no break, and the compiled step gives the
eager ids bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.sampling import prepared_rank_fns as F
from trtvocab.base.host_reads import HostReads
from trtvocab.errors import ConfigError, InputError
from trtvocab.parallel.sharding import vocab_placement
from trtvocab.sampling import DecodeStep, SamplingParams
from trtvocab.sampling.prepared import bucket

KNOBS = [*F.KNOBS, "greedy+bitmask", "top_p+bitmask", "mixed+bitmask"]


def check_knob(name: str, r: dict[str, Any], tp: int) -> None:
    assert r["got"] == r["ref"], f"{name}: ids differ from decode_output's"
    assert r["got_lp"] == r["ref_lp"], f"{name}: logprobs differ from decode_output's"
    assert r["counts_equal"] and r["outputs_equal"], f"{name}: the TokenState advanced differently"
    assert r["reads"][1:] == [0] * (F.STEPS - 1), f"{name}: host reads per steady step at tp {tp}: {r['reads']}"


def test_tp1_every_knob_gives_decode_outputs_numbers_with_no_host_read() -> None:
    results = F.all_knobs(0, 1, "uneven", KNOBS)
    for name in KNOBS:
        check_knob(name, results[name], 1)


def test_the_knobs_change_what_they_should() -> None:
    """The parity above means something only if the filters bite: against plain greedy ids."""
    results = F.all_knobs(0, 1, "uneven", ["greedy", "bias", "bad_words", "min_tokens", "allowed"])
    plain = results["greedy"]["got"]
    for name in ("bias", "bad_words", "min_tokens", "allowed"):
        assert results[name]["got"] != plain, f"{name} changed no id"
    assert results["bad_words"]["got"][0][0] != 29 and results["bad_words"]["got"][1][1] != 414
    assert results["bad_words"]["got"][2][2] != 617
    assert results["min_tokens"]["got"][0][0] != 29 and results["min_tokens"]["got"][3][1] == 941
    assert all(row[0] == 1000 for row in results["bias"]["got"])  # +40 on id 1000 wins every row
    assert all(i in (3, 9, 600, 1030) for row in results["allowed"]["got"] for i in row)


@pytest.mark.ranks
@pytest.mark.parametrize(("tp", "layout"), [(2, "uneven"), (3, "padded")])
def test_split_heads_give_decode_outputs_numbers(launch_ranks: Callable[..., list[Any]], tp: int,
                                                 layout: str) -> None:
    per_rank = launch_ranks(F.all_knobs, tp, layout, KNOBS, timeout_s=120)
    for rank_results in per_rank:
        for name in KNOBS:
            check_knob(name, rank_results[name], tp)
    assert all(r == per_rank[0] for r in per_rank)


def test_a_refused_row_counts_nothing() -> None:
    """A row the step refuses (read() raises) leaves the state's counts as they were; the others count."""
    head = F.head_of(0, 1)
    state = F.TokenState.for_head(head, [[1], [2]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, allowed_token_ids=[3])]
    step = DecodeStep(head, params, state=state, bitmask_width=1)
    mask = torch.full((2, 1), -1, dtype=torch.int32)
    mask[1, 0] = 1 << 4  # row 1: the bitmask allows id 4 only, its params id 3 only
    step(F.hidden(0, 2), mask)
    with pytest.raises(InputError, match=r"row\(s\) \[1\]: no token"):
        step.read()
    assert int(state.output_counts[1].sum()) == 0 and int(state.output_counts[0].sum()) == 1
    assert step.next_step == 1


def test_bad_rows_raise_when_the_ids_are_read_naming_rows_and_step() -> None:
    out = F.bad_rows(0, 1, 0)
    assert out["nan"].startswith("InputError: sampling.decode (step 0): row(s) [1]: hidden rows are not finite")
    assert len(out["after"]) == F.B  # the step goes on after a refused one
    assert "+inf" in out["inf"] and out["inf"].startswith("InputError: sampling.decode (step 2)")
    assert out["empty"].startswith("InputError: sampling.decode (step 0): row(s) [1]: no token is allowed")


@pytest.mark.ranks
def test_a_bad_row_on_one_rank_raises_on_every_rank(launch_ranks: Callable[..., list[Any]]) -> None:
    per_rank = launch_ranks(F.bad_rows, 2, 1, timeout_s=60)
    for out in per_rank:
        assert out["nan"].startswith("InputError: sampling.decode (step 0): row(s) [1]: hidden rows are not finite")
        assert "+inf" in out["inf"] and out["empty"].startswith("InputError")
    assert per_rank[0]["after"] == per_rank[1]["after"]


@pytest.mark.ranks
def test_a_bad_call_on_one_rank_raises_on_every_rank_at_read(launch_ranks: Callable[..., list[Any]]) -> None:
    """A call input only one rank sees (its hidden's dtype, its bitmask's width): that rank runs the step
    on stand-in zeros so no peer waits on a collective, and every rank raises when the ids are read."""
    per_rank = launch_ranks(F.one_rank_bad_call, 2, 1, timeout_s=60)
    bad, good = per_rank[1], per_rank[0]
    assert bad["hidden"].startswith("InputError: sampling.decode (step 0): DecodeStep: hidden must be a "
                                    "torch.float32"), bad["hidden"]
    assert "torch.float64" in bad["hidden"]
    assert bad["bitmask"].startswith("InputError: sampling.decode (step 0): DecodeStep: bitmask must be int32 [3, 33]")
    for step, key in ((0, "hidden"), (0, "bitmask")):  # the refused call before was no step
        assert good[key] == (f"InputError: sampling.decode (step {step}): row(s) [0, 1, 2]: a rank refused its "
                             "input to this step (that rank's error names it)"), good[key]
    assert good["next_step"] == bad["next_step"] == 0  # a refused call is no step
    alone = F.one_rank_bad_call(0, 1, 0)  # tp 1: the bad calls raise at once, the good ones are steps 0, 1
    assert alone["hidden"].startswith("InputError: DecodeStep: hidden must be") and alone["next_step"] == 0
    assert good["after"] == bad["after"] == alone["after"]  # seeded draws: the same noise steps at every tp


def test_a_rank_without_columns_processes_an_empty_block() -> None:
    """Padded at tp 8, 20 ids leave rank 5 no column: its column-local steps get a [B, 0] block (hostile
    review of the streamed refactor: the spare column of the ban scatter was cut from an empty block)."""
    place = vocab_placement(20, 8, 5, "padded", 16)
    assert place.owned == 0
    params = [SamplingParams(temperature=0.7, seed=1, allowed_token_ids=[3, 4], logit_bias={5: 1.0})]
    step = DecodeStep.for_rows(place, params, [1], 0, None, None)
    assert step._process(torch.zeros(1, 0)).shape == (1, 0)


def test_building_refuses_bad_arguments_typed() -> None:
    head = F.head_of(0, 1)
    with pytest.raises(InputError, match=r"state holds 3 rows .* this call has 2 rows"):
        DecodeStep(head, [SamplingParams()] * 2, state=F.TokenState.for_head(head, F.PROMPTS))
    with pytest.raises(InputError, match="outside the vocab"):
        DecodeStep(head, SamplingParams(logit_bias={F.V: 1.0}), rows=2)
    with pytest.raises(InputError, match="bitmask_width"):
        DecodeStep(head, SamplingParams(), bitmask_width=-1, rows=1)
    step = DecodeStep(head, [SamplingParams()] * F.B)
    with pytest.raises(InputError, match=r"hidden must be a torch.float32 \[3, 32\] tensor"):
        step(torch.zeros(F.B + 1, F.H))
    with pytest.raises(InputError, match=r"\(the head's dtype\), got torch.float64"):
        step(torch.zeros(F.B, F.H, dtype=torch.float64))
    with pytest.raises(InputError, match="bitmask must be None"):
        step(F.hidden(0), torch.zeros(F.B, 1, dtype=torch.int32))
    with pytest.raises(InputError, match="no step has run"):
        DecodeStep(head, [SamplingParams()] * F.B).read()
    with pytest.raises(ConfigError, match="VocabPlacement"):
        DecodeStep(head.placement, [SamplingParams()] * F.B)(F.hidden(0))


def test_rows_pad_to_a_bucket_without_changing_a_real_row() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    head = F.head_of(0, 1)
    params = F.KNOBS["mixed"]
    three = DecodeStep(head, params)  # 3 rows in a bucket of 4
    assert three.padded_rows == 4
    alone = [DecodeStep(head, [p]) for p in params]  # 1 row each: no padding
    for s in range(3):
        ids = three(F.hidden(s)).tolist()
        assert ids == [alone[r](F.hidden(s)[r : r + 1]).tolist()[0] for r in range(3)]


def test_draw_on_a_placement_equals_the_heads_step() -> None:
    head = F.head_of(0, 1)
    params = F.KNOBS["mixed"]
    on_head, on_place = DecodeStep(head, params, start_step=5), DecodeStep(head.placement, params, start_step=5)
    on_place.seed_keys = on_head.seed_keys  # the unseeded row's fresh seed is drawn per step object
    for s in range(3):
        x = F.hidden(s)
        assert on_head(x).tolist() == on_place.draw(head.local_logits(x)).tolist()


def test_local_topk_is_a_stable_sorts_prefix_ties_to_the_lower_column() -> None:
    """Fixed shapes (no nonzero) and exact: against a stable descending sort's first k (value, then column)."""
    from trtvocab.sampling.reductions import local_topk

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 50), generator=g).float()  # many ties
    for k in (1, 3, 17, 50):
        want = torch.sort(x, dim=1, descending=True, stable=True)
        got = local_topk(x, k)
        assert torch.equal(got[0], want.values[:, :k]) and torch.equal(got[1], want.indices[:, :k])
    with HostReads() as reads:
        local_topk(x, 7)
    assert reads.total == 0


def test_host_read_counter_sees_the_reads_it_names() -> None:
    t = torch.tensor([1.0, 2.0])
    with HostReads() as reads:
        bool(t.any()), t.sum().item(), t.tolist(), t.nonzero(), t[t > 1], int(t[0])
        t + 1, t.argmax(), t[0:1]
    assert reads.total == 6, dict(reads.by_call)


@pytest.mark.slow
def test_compiled_step_is_one_graph_and_gives_the_eager_ids() -> None:
    results = F.compiled_knobs(0, 1, ["mixed+bitmask"])  # top-k, top-p, min-p, penalties, logprobs, bitmask
    for name, r in results.items():
        assert (r["graphs"], r["breaks"]) == (1, 0), f"{name}: {r['reasons']}"
        check_knob(name, r, 1)


@pytest.mark.ranks
def test_ranks_that_pass_different_bitmasks_all_raise(launch_ranks: Callable[..., list[Any]]) -> None:
    for out in launch_ranks(F.disagreeing_bitmasks, 2, timeout_s=60):
        assert out.startswith("InputError: sampling.decode (step 0): row(s) [2]: the ranks passed different bitmasks")


@pytest.mark.ranks
def test_compiled_split_step_with_functional_collectives(launch_ranks: Callable[..., list[Any]]) -> None:
    """tp 2: one graph with the functional all_gathers in it, for the knobs with the most collectives:
    top-p's and typical-p's fixed cut rounds, min-p's max, top-k's merge, logprobs, the race."""
    names = ["mixed", "typical_p"]
    per_rank = launch_ranks(F.compiled_knobs, 2, names, timeout_s=500)
    for out in per_rank:
        for name in names:
            r = out[name]
            assert (r["graphs"], r["breaks"]) == (1, 0), f"{name}: {r['reasons']}"
            check_knob(name, r, 2)


@pytest.mark.parametrize("path", ["materialized", "streamed", "sample"])
def test_plus_inf_logits_are_refused_beside_nan_naming_the_rows(path: str) -> None:
    """Hidden rows of 1e37 overflow the GEMM to +inf: the lowest +inf id would win every draw (hostile
    round 4, H2). Every sampler path refuses them as it refuses NaN."""
    from trtvocab.sampling import decode_output, sample

    head = F.head_of(0, 1)
    x = F.hidden(0)
    x[2] *= 1e37
    assert torch.isposinf(head.local_logits(x)[2]).any()  # the premise: a real overflow, no NaN
    assert not torch.isnan(head.local_logits(x)).any()
    if path == "streamed":
        head.logits_budget_bytes = 4 * F.V  # one row's float32 logits: the step streams
    with pytest.raises(InputError, match=r"NaN or \+inf.*row\(s\) \[2\]|row\(s\) \[2\].*NaN or \+inf"):
        if path == "sample":
            sample(head.local_logits(x), head, SamplingParams(temperature=0.7, seed=1))
        else:
            decode_output(x, head, SamplingParams(temperature=0.0))


@pytest.mark.slow
def test_compiled_core_is_shared_by_every_batch_of_a_bucket() -> None:
    """DecodeStep.compile(): batches of 3 and 4 rows (bucket 4) and different requests with the same knobs run
    one compiled graph (no recompile), with the eager ids."""
    from torch._dynamo.utils import counters

    head = F.head_of(0, 1)
    params = [SamplingParams(temperature=0.8, top_k=9, top_p=0.9, seed=s) for s in range(4)]
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (4, 3):
            eager = DecodeStep(head, params[:rows])
            compiled = DecodeStep(head, params[:rows]).compile("eager")
            for s in range(2):
                assert compiled(F.hidden(s, rows)).tolist() == eager(F.hidden(s, rows)).tolist()
    assert counters["stats"]["unique_graphs"] - before == 1
    # Many buckets and knob sets: each its own graph, never dynamo's limit of 8 graphs a code object.
    # (dynamo's tracing is what counts graphs: the eager backend, without inductor's code generation, is enough)
    for rows in (1, 2, 5, 9, 17, 33, 65, 129, 257):
        step = DecodeStep(head, [SamplingParams(temperature=0.0, top_k=rows % 7 + 1)] * rows).compile("eager")
        assert step(F.hidden(0, rows)).tolist() == DecodeStep(head, [SamplingParams(temperature=0.0)] * rows)(
            F.hidden(0, rows)).tolist()
