"""Rank functions for tests/sampling/test_prepared_step.py (importable by spawned processes).

Each rank builds the same random head (split over the world, uneven or padded), runs a few steps of
:class:`~trtvocab.sampling.DecodeStep` for every knob and, beside it, today's
:func:`~trtvocab.sampling.decode_output` with the same state: the ids and logprobs of both, the host
reads of each steady step (``trtvocab.base.host_reads``), and, where asked, the compiled step's.
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import LMHead, Mapping
from trtvocab.base.host_reads import HostReads
from trtvocab.errors import InputError
from trtvocab.sampling import DecodeStep, SamplingParams, TokenState, decode_output

V, H, B, STEPS = 1031, 32, 3, 4
PROMPTS = [[1, 2, 3, 700], [5, 6], [900, 7, 7]]
EOS = (2,)

KNOBS: dict[str, SamplingParams | list[SamplingParams]] = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=0.9, seed=7),
    "top_k": SamplingParams(temperature=0.8, top_k=20, seed=3),
    "top_p": SamplingParams(temperature=0.8, top_p=0.7, seed=3),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2, seed=9),
    "typical_p": SamplingParams(temperature=1.0, typical_p=0.8, seed=9),
    "penalties": SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.5, frequency_penalty=0.4,
                                presence_penalty=0.3),
    "bias": SamplingParams(temperature=0.0, logit_bias={5: 30.0, 1000: 40.0, 17: -20.0}),
    "allowed": SamplingParams(temperature=0.9, seed=1, allowed_token_ids=[3, 9, 600, 1030]),
    # greedy gives [[29, 334, 1021], [771, 414, 54], [644, 414, 617], [584, 941, 560]] (steps x rows): the
    # bans below bite (29 at step 0; 414 after 334; 617 after 1021, 54), and 941 comes at step 3 = min_tokens
    "bad_words": SamplingParams(temperature=0.0, bad_words=((29,), (334, 414), (1021, 54, 617))),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(29, 941)),
    "logprobs": SamplingParams(temperature=0.0, logprobs=4),
    "logprobs_processed": SamplingParams(temperature=0.8, seed=2, logprobs=3, logprobs_mode="processed_logprobs"),
    "mixed": [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.7, top_p=0.8, seed=4),
              SamplingParams(temperature=1.1, top_k=5, min_p=0.05, seed=8, repetition_penalty=1.2)],
}


def head_of(rank: int, world: int, layout: str = "uneven") -> LMHead:
    mapping = None if world == 1 else Mapping(world_size=world, rank=rank, tp_size=world)
    head = LMHead(V, H, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=64)
    head.load_weights({"weight": torch.randn(V, H, generator=torch.Generator().manual_seed(1))})
    return head


def hidden(step: int, rows: int = B) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(100 + step)) * 2


def _bad_prompt_words(params: SamplingParams | list[SamplingParams]) -> list[SamplingParams]:
    return list(params) if isinstance(params, list) else [params] * B


def bitmask(step: int) -> torch.Tensor:
    """xgrammar's int32 [B, W] layout: a random half of the ids allowed, differently each step."""
    bits = torch.randint(0, 2, (B, 33 * 32), generator=torch.Generator().manual_seed(7 + step), dtype=torch.int64)
    words = (bits.reshape(B, 33, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def run_knob(head: LMHead, params: list[SamplingParams], compiled: bool = False,
             masked: bool = False) -> dict[str, Any]:
    """Both paths over STEPS steps: ids and logprobs (lists), host reads of the steady steps."""
    state_ref = TokenState.for_head(head, PROMPTS, EOS)
    state = TokenState.for_head(head, PROMPTS, EOS)
    step_fn = DecodeStep(head, params, state=state, bitmask_width=33 if masked else None)
    call = torch.compile(step_fn, fullgraph=True) if compiled else step_fn
    out: dict[str, Any] = {"ref": [], "got": [], "reads": [], "ref_lp": [], "got_lp": []}
    for s in range(STEPS):
        mask = bitmask(s) if masked else None
        ref = decode_output(hidden(s), head, params, step=s, state=state_ref, bitmask=mask)
        state_ref.append(ref.token_ids)
        with HostReads() as reads:
            call(hidden(s), mask)
        out["reads"].append(reads.total)
        out["got"].append(step_fn.read())
        out["ref"].append(ref.token_ids.tolist())
        for key, lp in (("ref_lp", ref.logprobs), ("got_lp", step_fn.last_output.logprobs)):
            out[key].append(None if lp is None else [lp.ids.tolist(), lp.values.view(torch.int32).tolist(),
                                                     lp.ranks.tolist()])
    out["counts_equal"] = bool(torch.equal(state.output_counts, state_ref.output_counts))
    out["outputs_equal"] = state.output == state_ref.output
    return out


def all_knobs(rank: int, world: int, layout: str, names: list[str]) -> dict[str, Any]:
    torch.manual_seed(1234)  # the unseeded rows' fresh seed is agreed; the rest is seeded
    head = head_of(rank, world, layout)
    return {name: run_knob(head, _bad_prompt_words(KNOBS[name.removesuffix("+bitmask")]),
                           masked=name.endswith("+bitmask")) for name in names}


def compiled_knobs(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    head = head_of(rank, world)
    out = {}
    for name in names:
        torch._dynamo.reset()
        masked = name.endswith("+bitmask")
        params = _bad_prompt_words(KNOBS[name.removesuffix("+bitmask")])
        probe = DecodeStep(head, params, state=TokenState.for_head(head, PROMPTS, EOS),
                           bitmask_width=33 if masked else None)
        explain = torch._dynamo.explain(probe)(hidden(0), bitmask(0) if masked else None)
        out[name] = {"graphs": explain.graph_count, "breaks": explain.graph_break_count,
                     "reasons": [r.reason[:200] for r in explain.break_reasons],
                     **run_knob(head, params, compiled=True, masked=masked)}
    return out


def _read_error(step: DecodeStep) -> str:
    """``"Type: message"`` of what the step's ``read()`` raises ("no error": it raised nothing)."""
    try:
        step.read()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_rows(rank: int, world: int, bad_rank: int) -> dict[str, Any]:
    """A NaN hidden row (on ``bad_rank`` only: ranks may bring different rows), then +inf logits, then a
    row the filters leave empty: each raises on every rank when the ids are read, naming row and step."""
    head = head_of(rank, world)
    out: dict[str, Any] = {}
    step_fn = DecodeStep(head, SamplingParams(temperature=0.0))
    x = hidden(0)
    if rank == bad_rank:
        x[1, 3] = float("nan")
    step_fn(x)
    out["nan"] = _read_error(step_fn)
    step_fn(hidden(1))
    out["after"] = step_fn.read()
    y = hidden(2) * 1e37
    step_fn(y)
    out["inf"] = _read_error(step_fn)
    empty = DecodeStep(head, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0,
                                                                              allowed_token_ids=[3]),
                              SamplingParams(temperature=0.0)], bitmask_width=1)
    mask = torch.full((B, 1), -1, dtype=torch.int32)
    mask[1, 0] = 1 << 4  # row 1 allows id 4 only, its params id 3 only: nothing left
    empty(hidden(3), mask)
    out["empty"] = _read_error(empty)
    return out


def one_rank_bad_call(rank: int, world: int, bad_rank: int) -> dict[str, Any]:
    """``bad_rank`` alone passes a float64 hidden, then a bitmask of the wrong width (inputs only it sees):
    every rank still meets the step's collectives and raises at read() (alone: at the call); then good steps
    run, seeded, as steps 0 and 1 (a refused call is no step)."""
    head = head_of(rank, world)
    step_fn = DecodeStep(head, [SamplingParams(temperature=1.0, seed=11)] * B, bitmask_width=33)
    out: dict[str, Any] = {}

    def call(x: torch.Tensor, mask: torch.Tensor) -> str:
        try:
            step_fn(x, mask)
        except InputError as exc:  # alone, the step refuses at once
            return f"InputError: {exc}"
        return _read_error(step_fn)
    out["hidden"] = call(hidden(0).double() if rank == bad_rank else hidden(0), bitmask(0))
    out["bitmask"] = call(hidden(1), bitmask(1)[:, :5] if rank == bad_rank else bitmask(1))
    out["next_step"] = step_fn.next_step
    out["after"] = []
    for s in (2, 3):
        step_fn(hidden(s), bitmask(s))
        out["after"].append(step_fn.read())
    return out


def disagreeing_bitmasks(rank: int, world: int) -> str:
    """Rank 1 passes another bitmask than rank 0 (a grammar state gone out of step): every rank raises."""
    head = head_of(rank, world)
    step = DecodeStep(head, [SamplingParams(temperature=0.0)] * B, bitmask_width=33)
    mask = bitmask(0)
    if rank == 1:
        mask[2, 5] ^= 1
    step(hidden(0), mask)
    return _read_error(step)
