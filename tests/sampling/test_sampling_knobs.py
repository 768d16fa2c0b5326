"""The serving knobs (penalties, logit bias, allowed ids, bad words, min tokens, typical-p, logprobs)
computed on the vocab shards, against references independent of trtvocab.

* One launch of 4 ranks decodes :data:`knob_rank_fns.STEPS` steps at tp 1, 2, 3 (uneven) and 4 (padded),
  one knob per row: the same ids and returned logprobs **bitwise** at every tp; greedy rows equal
  transformers' own logits processors (``RepetitionPenaltyLogitsProcessor``, ``NoBadWordsLogitsProcessor``,
  ``MinNewTokensLengthLogitsProcessor``, ``SequenceBiasLogitsProcessor``) or vLLM's formulas in float64
  (presence / frequency, allowed ids) token for token; returned logprobs equal a float64 full-vocab
  log-softmax within 1e-5; a real head decoded with a ``TokenState`` gives the same tokens streamed.
* Typical-p keeps exactly transformers' ``TypicalLogitsWarper`` set; seeded draws with typical-p and
  penalties pass a chi-square test against the processed distribution.
* Every new field is validated, and the error names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from scipy import stats

from tests.sampling.knob_rank_fns import EOS, PROMPTS, STEPS, STOP, VOCAB, beam_scores, knob_cases, rows, step_logits
from trtvocab import LMHead
from trtvocab.errors import InputError
from trtvocab.sampling import SamplingParams, TokenState, sample, sample_output

tlp = pytest.importorskip("transformers.generation.logits_process")
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def records(launch_ranks: Callable[..., list[Any]]) -> list[dict[str, Any]]:
    return launch_ranks(knob_cases, 4, timeout_s=240)[0]  # rank 0 takes part in every case


def _processed(g: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's logits after vLLM's steps 3-6, by transformers' processors where they match vLLM
    (float32, ``[1, V]``) and vLLM's formulas otherwise."""
    x = g[None, :].clone()
    seq = torch.tensor([prompt + output])
    if p.allowed_token_ids is not None:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[list(p.allowed_token_ids)] = True
        x[:, ~keep] = float("-inf")
    if p.bad_words:
        x = tlp.NoBadWordsLogitsProcessor([list(w) for w in p.bad_words], eos_token_id=None)(seq, x)
    if p.min_tokens:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])
        x = tlp.MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops)(seq, x)
    if p.logit_bias:
        x = tlp.SequenceBiasLogitsProcessor({(i,): b for i, b in p.logit_bias.items()})(seq, x)
    if p.repetition_penalty != 1:
        x = tlp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seq, x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).double()
    x = (x.double() - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()).float()
    return x


@pytest.mark.ranks
def test_every_knob_is_tp_invariant_and_greedy_rows_equal_transformers(records: list[dict[str, Any]]) -> None:
    assert [r["case"] for r in records] == ["tp=1 uneven", "tp=2 uneven", "tp=3 uneven", "tp=4 padded"]
    for r in records[1:]:
        assert r["ids"] == records[0]["ids"], r["case"]
        assert r["logprobs"] == records[0]["logprobs"], r["case"]  # bitwise: the same floats
    ids = records[0]["ids"]
    params = rows()
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(STEPS):
        g = step_logits(step)
        for r, p in enumerate(params):
            x = _processed(g[r], p, PROMPTS[r], outputs[r])
            if p.greedy:
                assert ids[step][r] == int(x.argmax()), (step, r, p)
            else:
                if p.typical_p < 1 and p.top_k == 0 and p.top_p == 1 and p.min_p == 0:
                    kept = tlp.TypicalLogitsWarper(p.typical_p)(None, x / p.temperature)
                    assert torch.isfinite(kept[0, ids[step][r]]), (step, r)
                assert torch.isfinite(x[0, ids[step][r]]), (step, r)
            outputs[r].append(ids[step][r])
    assert ids[0][4] == 100 and ids[1][4] != 101 and 103 not in [s[4] for s in ids]  # bad words cut 100, 101
    assert not {EOS, STOP} & {s[5] for s in ids[:3]} and ids[3][5] in (EOS, STOP)  # min_tokens, then a stop
    assert ids[0][6] == EOS  # ignore_eos: eos not banned (ending the sequence is the loop's business)
    assert STOP not in [s[6] for s in ids[:3]]


@pytest.mark.ranks
def test_returned_logprobs_equal_a_float64_log_softmax(records: list[dict[str, Any]]) -> None:
    ids = records[0]["ids"]
    params = rows()
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(STEPS):
        g = step_logits(step)
        lp = records[0]["logprobs"][step]
        for r, p in enumerate(params):
            got_ids, got_v, got_rank = lp["ids"][r], lp["values"][r], lp["ranks"][r]
            x = _processed(g[r], p, PROMPTS[r], outputs[r])[0].double()
            if p.logprobs is None:
                assert got_ids == [-1] * len(got_ids) and got_rank == [0] * len(got_ids)
            else:
                if p.logprobs_mode == "raw_logprobs":
                    want = torch.log_softmax(g[r].double(), 0)
                elif p.logprobs_mode == "processed_logits":
                    want = x
                else:  # processed_logprobs: temperature and top-k too
                    y = x / p.temperature
                    kth = torch.sort(y.float(), descending=True, stable=True).values[p.top_k - 1]
                    want = torch.log_softmax(y.masked_fill(y.float() < kth, float("-inf")), 0)
                order = sorted(range(VOCAB), key=lambda i: (-float(want[i]), i))[: p.logprobs]
                assert got_ids[1 : 1 + p.logprobs] == order, (step, r)
                assert got_rank[1 : 1 + p.logprobs] == list(range(1, p.logprobs + 1))
                for j, i in enumerate(order):
                    assert abs(got_v[1 + j] - float(want[i])) <= LOGPROB_TOL, (step, r, i)
                assert got_ids[0] == ids[step][r]
                assert abs(got_v[0] - float(want[ids[step][r]])) <= LOGPROB_TOL
                assert got_rank[0] == int((want >= want[ids[step][r]] - 1e-12).sum())
            outputs[r].append(ids[step][r])


@pytest.mark.ranks
def test_streamed_decode_with_state_equals_the_materialized_one(records: list[dict[str, Any]]) -> None:
    for r in records:
        assert r["streamed"]["equal"], r["case"]
        assert r["streamed"]["ids"] == records[0]["streamed"]["ids"], r["case"]


@pytest.mark.ranks
def test_prompt_logprobs_streamed_equal_materialized_at_every_tp_and_float64(records: list[dict[str, Any]]) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(VOCAB, 16, generator=gen)
    torch.randn(VOCAB, 16, generator=gen)  # the decode loop's embedding table (knob_rank_fns._streamed)
    hidden = torch.randn(40, 16, generator=gen)
    nexts = torch.randint(0, VOCAB, (40,), generator=gen)
    lsm = torch.log_softmax(hidden.double() @ w.double().T, 1)
    want = records[0]["streamed"]["prompt"]["materialized"]
    for r in records:
        assert r["streamed"]["prompt"]["streamed"] == want, r["case"]  # bitwise
        assert r["streamed"]["prompt"]["materialized"] == want, r["case"]
    for t in range(40):
        ids, values, ranks = want["ids"][t], want["values"][t], want["ranks"][t]
        assert ids[0] == int(nexts[t]) and abs(values[0] - float(lsm[t, ids[0]])) <= LOGPROB_TOL
        mine = lsm[t, ids[0]]  # the rank counts ids >= it: exact up to float32 near-ties
        assert int((lsm[t] > mine + LOGPROB_TOL).sum()) + 1 <= ranks[0] <= int((lsm[t] >= mine - LOGPROB_TOL).sum())
        assert ids[1:] == torch.topk(lsm[t], 4).indices.tolist() and ranks[1:] == [1, 2, 3, 4]
        assert max(abs(v - float(lsm[t, i])) for v, i in zip(values[1:], ids[1:], strict=True)) <= LOGPROB_TOL


@pytest.mark.ranks
def test_beam_candidates_merge_the_best_2w_of_every_beam_at_every_tp(records: list[dict[str, Any]]) -> None:
    """3 requests x 4 beams: the best 8 (score, beam, id) of each request equal a float64 ranking of
    every beam's log-softmax plus its score; bitwise the same at tp 1, 2, 3 and 4 (padded)."""
    want = records[0]["beams"]
    assert all(r["beams"] == want for r in records), [r["case"] for r in records]
    total = torch.log_softmax(step_logits(0).double(), 1) + beam_scores().double()[:, None]
    for b in range(3):
        flat = total[4 * b : 4 * b + 4].reshape(-1)
        order = sorted(range(flat.numel()), key=lambda i: (-float(flat[i]), i))[:8]
        assert want["parents"][b] == [i // VOCAB for i in order] and want["tokens"][b] == [i % VOCAB for i in order]
        assert max(abs(v - float(flat[i])) for v, i in zip(want["scores"][b], order, strict=True)) <= LOGPROB_TOL
    assert set(want["parents"][0]) == {0}  # request 0's first step: only beam 0 is alive


def test_typical_p_keeps_transformers_typical_set() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=gen) * torch.linspace(0.5, 4.0, 12)[:, None]
    head = LMHead(VOCAB, 4, dtype=torch.float32)
    masses = [0.05, 0.2, 0.5, 0.9, 0.95, 0.99] * 2
    params = [SamplingParams(temperature=1.0, typical_p=m, logprobs=VOCAB, logprobs_mode="processed_logits", seed=i)
              for i, m in enumerate(masses)]
    out = sample_output(logits, head, params)
    assert out.logprobs is not None
    for r, m in enumerate(masses):
        want = tlp.TypicalLogitsWarper(m)(None, logits[r : r + 1].clone())[0]
        got_ids = out.logprobs.ids[r, 1:]
        got_v = out.logprobs.values[r, 1:]
        kept = set(got_ids[torch.isfinite(got_v)].tolist())
        assert kept == set(torch.isfinite(want).nonzero()[:, 0].tolist()), (r, m)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, typical_p=0.6),
    SamplingParams(temperature=0.7, typical_p=0.9, repetition_penalty=1.5, presence_penalty=0.4),
    SamplingParams(temperature=1.0, frequency_penalty=-0.8, logit_bias={3: 1.5}, bad_words=[[9, 2]]),
], ids=["typical", "typical+penalties", "bias+bad-words"])
def test_seeded_draws_follow_the_processed_distribution(params: SamplingParams) -> None:
    """20000 seeded draws of one row (16 logits, a prompt and an output with repeats): chi-square
    against the distribution transformers' processors give, in float64."""
    n, v = 20000, 16
    logits = torch.linspace(-2.0, 1.5, v)[torch.randperm(v, generator=torch.Generator().manual_seed(4))]
    head = LMHead(v, 4, dtype=torch.float32)
    prompt, output = [1, 2, 3], [3, 9, 5, 5]
    state = TokenState([prompt] * n, start=0, size=v)
    for t in output:
        state.append([t] * n)
    ids = sample(logits.expand(n, v).contiguous(), head, [params.model_copy(update={"seed": s}) for s in range(n)],
                 state=state)
    x = logits[None, :].clone()
    seq = torch.tensor([prompt + output])
    if params.bad_words:
        x = tlp.NoBadWordsLogitsProcessor([list(w) for w in params.bad_words], eos_token_id=None)(seq, x)
    if params.logit_bias:
        x = tlp.SequenceBiasLogitsProcessor({(i,): b for i, b in params.logit_bias.items()})(seq, x)
    if params.repetition_penalty != 1:
        x = tlp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seq, x)
    counts = torch.bincount(torch.tensor(output), minlength=v).double()
    x = x.double() - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    x = x / params.temperature
    if params.typical_p < 1:
        x = tlp.TypicalLogitsWarper(params.typical_p)(None, x)
    expected = torch.softmax(x[0], 0)
    got = torch.bincount(ids, minlength=v).double()
    assert got[expected == 0].sum() == 0
    present = expected > 0
    result = stats.chisquare(got[present].numpy(), (expected[present] * n).numpy())
    assert result.pvalue > 1e-3, (result, got.tolist(), (expected * n).tolist())


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("logit_bias", {1: float("nan")}), ("logit_bias", {-1: 1.0}), ("logit_bias", [1]),
    ("allowed_token_ids", []), ("allowed_token_ids", [1.5]), ("bad_words", [[]]), ("bad_words", "abc"),
    ("min_tokens", -1), ("stop_token_ids", [True]), ("ignore_eos", 1), ("typical_p", 0.0), ("typical_p", 1.5),
    ("logprobs", -1), ("logprobs_mode", "raw"),
])
def test_each_new_field_is_validated_and_named(field: str, value: Any) -> None:
    with pytest.raises(InputError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_ids_outside_the_vocab_and_a_wrong_state_are_refused() -> None:
    head = LMHead(16, 4, dtype=torch.float32)
    logits = torch.zeros(2, 16)
    with pytest.raises(InputError, match="token id 16"):
        sample(logits, head, SamplingParams(logit_bias={16: 1.0}))
    with pytest.raises(InputError, match="state holds 3 rows"):
        sample(logits, head, SamplingParams(), state=TokenState([[1]] * 3, start=0, size=16))
