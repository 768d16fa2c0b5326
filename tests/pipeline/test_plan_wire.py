"""``plan``'s collectives against the bytes a real run hands to torch.distributed (docs/architecture.md,
"plan: the ledger").

One launch of 3 gloo ranks runs, at tp 2 and tp 3 (``tests.parallel.rank_fns.subgroups``), three calls of:
``sampling.decode_output`` for every sampler knob (greedy, seeded, top-k, top-p, min-p, typical-p, logprobs
N and 0, a combination), ``LMHead.forward`` in every gather mode (all-gather, chunked, to rank 0, local;
uneven and padded), attention DP's row exchange (chunked or not) and the embedding lookup (bf16 rows, FP8
rows with per-row scales). A ``TorchDispatchMode`` (:mod:`tests.parallel.wire_counter`) records every
collective's kind and the bytes this rank puts in; the first call must equal ``plan``'s ``first`` list and
the later ones its ``steady`` list, collective for collective, in order, to the byte (the agreement header
included where it rides). Top-p's and typical-p's cut takes the same four rounds whatever the data.
"""

from __future__ import annotations

import pytest

from tests.parallel.wire_rank_fns import ADP_ROWS, DECODE, FORWARD, ROWS, TOKENS, B, H, V, wire_cases
from trtvocab.parallel.launch import run_ranks
from trtvocab.pipeline.plan import (
    Sampler,
    StepCollectives,
    decode_collectives,
    embedding_collectives,
    forward_collectives,
)

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_ranks(wire_cases, 3, timeout_s=120)


def _as_list(step: StepCollectives, steady: bool) -> list[tuple[str, int]]:
    return [(c.kind, c.bytes) for c in (step.steady if steady else step.first)]


def _matches(calls: list[list[tuple[str, int]]], step: StepCollectives) -> bool:
    return all([tuple(e) for e in events] == _as_list(step, i > 0) for i, events in enumerate(calls))


def _sampler(kw: dict) -> Sampler:
    return Sampler(top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0) < 1, min_p=kw.get("min_p", 0.0) > 0,
                   typical_p=kw.get("typical_p", 1.0) < 1, logprobs=kw.get("logprobs"))


@pytest.mark.parametrize("tp", [2, 3])
def test_decode_steps_send_what_plan_prices(measured: list[dict], tp: int) -> None:
    for rank in range(tp):
        for name, kw in DECODE.items():
            calls = measured[rank][f"tp={tp} decode {name}"]
            assert _matches(calls, decode_collectives(V, tp, B, _sampler(kw))), (tp, rank, name, calls)


@pytest.mark.parametrize("tp", [2, 3])
def test_forwards_send_what_plan_prices(measured: list[dict], tp: int) -> None:
    for rank in range(tp):
        for mode, chunk, layout in FORWARD:
            calls = measured[rank][f"tp={tp} forward {mode} {chunk} {layout}"]
            step = forward_collectives(V, H, tp, ROWS, layout, gather_output=mode, gather_chunk_rows=chunk,
                                       logits_bytes=4, hidden_bytes=4)
            assert _matches(calls, step), (tp, rank, mode, chunk, layout, calls, step)
        for chunk in (None, 2):
            calls = measured[rank][f"tp={tp} adp {chunk}"]
            step = forward_collectives(V, H, tp, 0, gather_chunk_rows=chunk, logits_bytes=4, hidden_bytes=4,
                                       adp_rows=ADP_ROWS[:tp])
            assert _matches(calls, step), (tp, rank, "adp", chunk, calls)


@pytest.mark.parametrize("tp", [2, 3])
def test_embedding_lookups_send_what_plan_prices(measured: list[dict], tp: int) -> None:
    for rank in range(tp):
        assert _matches(measured[rank][f"tp={tp} embedding bf16"], embedding_collectives(TOKENS, H, tp, "bf16"))
        fp8 = embedding_collectives(TOKENS, H, tp, "fp8", per_row_scales=True)
        assert _matches(measured[rank][f"tp={tp} embedding fp8"], fp8)
        assert fp8.steady[1].bytes == TOKENS * H  # one byte an element on the wire
