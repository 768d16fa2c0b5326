"""`trtvocab generate --attention-dp --lm-head-tp N`: the bodies data-parallel as with `--attention-dp`, the
head (and its tied table) split over groups of N of the `--tp` ranks (`Mapping.lm_head_tp_size`; the groups
made by `distributed.lm_head_group`). The body ranks are spread over the groups (`rank_blocks`), each group
decodes only its own ranks' rows (SGLang's `enable_dp_lm_head`), and the sampled ids (and logprobs) are
exchanged over the world once a step. The tokens equal the same request at tp 1, greedy and seeded, in
every arrangement (world 4 as 2 groups of 2, world 6 as 2 groups of 3, world 4 as 4 heads of 1); the rows
each rank's head decoded are its own group's, counted from the tp 1 run; bad values are ConfigErrors
naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.pipeline.head_group_rank_fns import CASES, drawn, exchange_cases, group_logprobs
from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import run_ranks
from trtvocab.pipeline import generate as G
from trtvocab.sampling import SamplingParams

PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "My favourite colour is"]


def _rows_decoded(want: G.GenerateReport, rows: list[int]) -> int:
    """The rows a head decoding ``rows`` (prompt indices) decodes over a run: one per step a row runs,
    which is the number of tokens it generated in the tp 1 run."""
    return sum(len(want.results[b].token_ids) for b in rows)


def _same_logprobs(got: G.GenerateReport, want: G.GenerateReport) -> None:
    for g, w in zip(got.results, want.results, strict=True):
        assert (g.logprobs is None) == (w.logprobs is None)
        for gs, ws in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert [e[0] for e in gs] == [e[0] for e in ws] and [e[2] for e in gs] == [e[2] for e in ws]
            assert max(abs(a[1] - b[1]) for a, b in zip(gs, ws, strict=True)) < 5e-5


@pytest.mark.model
@pytest.mark.ranks
def test_tp4_as_two_head_groups_of_two_equals_tp1(smollm2: Path) -> None:
    """Two body ranks, one per group (ranks 0 and 2): group {0, 1} decodes prompts 0-1 only, group {2, 3}
    prompts 2-3 only; penalties (the token state's rows), logprobs (exchanged) and a seeded draw included."""
    pytest.importorskip("transformers")
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
              SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, logprobs=0),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3)]
    want = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params)
    got = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params, tp=4, attention_dp=True, body_ranks=2,
                lm_head_tp=2)
    assert got.attention_dp and got.tp == 4 and got.lm_head_tp == 2
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    _same_logprobs(got, want)
    first, second = _rows_decoded(want, [0, 1]), _rows_decoded(want, [2, 3])
    assert got.head_rows == (first, first, second, second)


@pytest.mark.model
@pytest.mark.ranks
def test_tp6_as_two_head_groups_of_three_equals_tp1(smollm2: Path) -> None:
    """World 6, the head over 3 (an uneven vocab split): three body ranks spread as 2 + 1 (ranks 0, 1 and
    3), four prompts as blocks of 2, 1, 1: group {0, 1, 2} decodes prompts 0-2, group {3, 4, 5} prompt 3;
    rows finish at different steps (a stop token), so a group's rows leave while the other's run on."""
    pytest.importorskip("transformers")
    want_plain = G.run(smollm2, PROMPTS, max_new_tokens=6)
    stop = want_plain.results[3].token_ids[1]  # prompt 3 stops after two tokens
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.7, seed=5),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=0.0, stop_token_ids=(stop,), logprobs=3)]
    want = G.run(smollm2, PROMPTS, max_new_tokens=6, params=params)
    assert len(want.results[3].token_ids) == 2
    got = G.run(smollm2, PROMPTS, max_new_tokens=6, params=params, tp=6, attention_dp=True, body_ranks=3,
                lm_head_tp=3)
    assert got.tp == 6 and got.body_ranks == 3 and got.lm_head_tp == 3
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    _same_logprobs(got, want)
    first, second = _rows_decoded(want, [0, 1, 2]), _rows_decoded(want, [3])
    assert got.head_rows == (first,) * 3 + (second,) * 3


@pytest.mark.model
@pytest.mark.ranks
def test_tp4_as_four_heads_of_one_with_idle_groups_equals_tp1(smollm2: Path) -> None:
    """`lm_head_tp` 1: every rank holds the whole head and decodes its own rows (a replicated head under
    attention DP); two body ranks (0 and 1), so ranks 2 and 3 decode nothing and only take part in the
    exchange of the ids. Prompt 2 (rank 1's) under a regex: every rank's matcher advances on its ids."""
    pytest.importorskip("transformers")
    from trtvocab.sampling.grammar import grammar_spec

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7, logprobs=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=5, seed=2)]
    options = {"max_new_tokens": 4, "params": params,
               "grammars": [None, None, grammar_spec(regex="( [a-z]+,){1,4}"), None]}
    want = G.run(smollm2, PROMPTS, **options)
    got = G.run(smollm2, PROMPTS, tp=4, attention_dp=True, body_ranks=2, lm_head_tp=1, **options)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    _same_logprobs(got, want)
    assert got.head_rows == (_rows_decoded(want, [0, 1]), _rows_decoded(want, [2, 3]), 0, 0)


@pytest.mark.model
@pytest.mark.ranks
def test_without_head_groups_every_rank_decodes_every_row(smollm2: Path) -> None:
    """`attention_dp` alone (the head over all tp ranks): each rank's head decodes every row."""
    pytest.importorskip("transformers")
    want = G.run(smollm2, PROMPTS[:3], max_new_tokens=3)
    got = G.run(smollm2, PROMPTS[:3], max_new_tokens=3, tp=2, attention_dp=True, body_ranks=2)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    assert got.lm_head_tp == 0 and got.head_rows == (_rows_decoded(want, [0, 1, 2]),) * 2


@pytest.mark.model
@pytest.mark.ranks
def test_cli_says_which_ranks_ran_a_body_and_the_head_groups(smollm2: Path) -> None:
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from trtvocab.commands.cli import app

    res = CliRunner().invoke(app, ["generate", str(smollm2), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                                   "--max-new-tokens", "2", "--tp", "4", "--attention-dp", "--body-ranks", "2",
                                   "--lm-head-tp", "2"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "ranks 0, 2 ran the body" in text and "the head split over 2 groups of 2 ranks" in text


@given(batch=st.integers(1, 40), head_tp=st.integers(1, 4), groups=st.integers(1, 4), data=st.data())
def test_rank_blocks_spread_the_bodies_over_the_head_groups(batch: int, head_tp: int, groups: int,
                                                            data: st.DataObject) -> None:
    tp = head_tp * groups
    bodies = data.draw(st.integers(1, min(tp, batch)))
    blocks = G.rank_blocks(batch, tp, bodies, head_tp)
    body = [r for r, (lo, hi) in enumerate(blocks) if lo < hi]
    assert len(body) == bodies  # every body rank owns a prompt (bodies <= batch)
    assert [b for r in body for b in range(*blocks[r])] == list(range(batch))  # each once, in rank order
    per_group = [sum(1 for r in body if r // head_tp == g) for g in range(groups)]
    assert max(per_group) - min(per_group) <= 1 and per_group == sorted(per_group, reverse=True)
    for g in range(groups):  # a group's body ranks are its first ranks
        assert [r % head_tp for r in body if r // head_tp == g] == list(range(per_group[g]))
    sizes = [blocks[r][1] - blocks[r][0] for r in body]
    assert max(sizes) - min(sizes) <= 1
    if head_tp == tp:  # no head groups: the first ranks, as prompt_block has it
        assert blocks == tuple(G.prompt_block(batch, bodies, r) for r in range(tp))


@pytest.mark.ranks
def test_the_id_exchange_gives_every_rank_every_row_in_one_all_gather() -> None:
    """`BodyRows.exchange` on 4 gloo ranks: every rank gets every active row's id and logprobs in row order,
    as the group that decoded the row made them (widths padded to the widest asked: -1, -inf, 0), in one
    all-gather of int64 `[max rows of a group, 1 + 3 w]` per rank (`w`: 1 + the widest `logprobs`, 0 when
    no row asks); a rank whose own draw differs from its group's first rank's raises DistributedError."""
    measured = run_ranks(exchange_cases, 4, timeout_s=120)
    for name, (batch, bodies, head_tp, active, asked) in CASES.items():
        blocks = G.rank_blocks(batch, 4, bodies, head_tp)
        group_rows = [[b for b in active if any(blocks[r][0] <= b < blocks[r][1]
                                                for r in range(g * head_tp, (g + 1) * head_tp))]
                      for g in range(4 // head_tp)]
        width = max((asked[b] + 1 for b in active if asked[b] is not None), default=0)
        for rank in range(4):
            got = measured[rank][name]
            assert got["mine"] == group_rows[rank // head_tp], (name, rank)
            assert got["ids"] == [drawn(b) for b in active], (name, rank)
            assert got["sent"] == [("all_gather", max(map(len, group_rows)) * (1 + 3 * width) * 8)], (name, rank)
            if not width:
                assert got["logprobs"] is None
                continue
            ids, values, ranks = got["logprobs"]
            for j, b in enumerate(active):
                g = next(g for g, rows in enumerate(group_rows) if b in rows)
                lp = group_logprobs(group_rows[g], asked)
                n = 0 if lp is None else lp.ids.shape[1]
                want_ids = [-1] * width
                want_values = [float("-inf")] * width
                want_ranks = [0] * width
                if lp is not None:
                    k = group_rows[g].index(b)
                    want_ids[:n], want_values[:n] = lp.ids[k].tolist(), lp.values[k].tolist()
                    want_ranks[:n] = lp.ranks[k].tolist()
                assert (ids[j], values[j], ranks[j]) == (want_ids, want_values, want_ranks), (name, rank, b)
    assert measured[1]["mismatch"] is not None and "rank 1 drew other token ids" in measured[1]["mismatch"]
    assert [measured[r]["mismatch"] for r in (0, 2, 3)] == [None] * 3


@pytest.mark.parametrize(("fields", "words"), [
    ({"tp": 4, "attention_dp": True, "lm_head_tp": 3}, ["`lm_head_tp` 3", "divides", "tp 4"]),
    ({"tp": 4, "lm_head_tp": 2}, ["`lm_head_tp` 2", "needs `attention_dp`"]),
    ({"tp": 4, "attention_dp": True, "lm_head_tp": 0}, ["`lm_head_tp`", ">= 1"]),
    ({"tp": 4, "attention_dp": True, "lm_head_tp": True}, ["`lm_head_tp`", "got True"]),
    ({"attention_dp": True, "lm_head_tp": 2}, ["`lm_head_tp` 2", "tp None"]),
])
def test_bad_lm_head_tp_is_a_config_error_naming_the_field(fields: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        G.GenerateOptions(prompts=("x",), **fields)
    for word in words:
        assert word in str(info.value)
