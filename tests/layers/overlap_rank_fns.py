"""Rank functions of tests/layers/test_gather_overlap.py: ``LMHead(overlap_chunks=k)`` (column chunks whose
all-gathers overlap the next chunk's GEMM) against ``overlap_chunks=1`` (GEMM, then one all-gather), bitwise.

Spawned ranks unpickle these by module name. Each function runs every case in one launch and returns
per-case records; the test makes the assertions.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import catch, hidden_states, subgroups, weights
from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig
from trtvocab.base.family import HeadOps
from trtvocab.quant import fp8

VOCAB = 1001  # uneven over 2 and 3 ranks
HIDDEN = 48
ROWS = 5
CHUNKS = (2, 3, 7, 5000)  # 5000: more chunks than owned columns (capped at one a column)
CALLS = 3  # the first call's handshake, then steady calls whose verdict rides on the first chunk


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _formats() -> list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]:
    """(name, LMHead kwargs, tensors): dense float32 / bf16 (plain, deterministic, float32 logits), a soft-capped
    head with a bias, and FP8 W8A8."""
    w32 = weights(VOCAB, HIDDEN, 11)
    q, s = fp8.quantize_fp8(w32)
    bias = torch.linspace(-1, 1, VOCAB)
    return [
        ("fp32", {"dtype": torch.float32}, {"weight": w32}),
        ("bf16", {"dtype": torch.bfloat16}, {"weight": w32}),
        ("bf16 deterministic", {"dtype": torch.bfloat16, "deterministic": True}, {"weight": w32}),
        ("bf16 float32 logits", {"dtype": torch.bfloat16, "output_dtype": torch.float32}, {"weight": w32}),
        ("fp32 softcap + bias", {"dtype": torch.float32, "head_ops": HeadOps(bias=True, softcap=30.0)},
         {"weight": w32, "bias": bias}),
        ("fp8 w8a8", {"dtype": torch.bfloat16, "quant_config": QuantConfig(quant_algo=QuantAlgo.FP8)},
         {"weight": q, "weight_scale": s, "input_scale": torch.tensor(0.05)}),
    ]


def overlap_cases(rank: int, world: int) -> list[dict[str, Any]]:
    groups = subgroups(world)
    out: list[dict[str, Any]] = []
    for tp in (t for t in groups if rank < t):
        group = groups[tp]
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
        for name, kw, tensors in _formats():
            for layout in ("uneven", "padded"):
                dtype = kw["dtype"]
                xs = [hidden_states(ROWS, HIDDEN, 20 + c).to(dtype) for c in range(CALLS)]
                heads = {}
                for k in (1, *CHUNKS):
                    head = LMHead(VOCAB, HIDDEN, mapping=mapping, process_group=group, vocab_layout=layout,
                                  overlap_chunks=k, **kw)
                    head.load_weights(dict(tensors))
                    heads[k] = head
                ref = [heads[1](x) for x in xs]
                rec = {"case": f"tp={tp} {name} {layout}", "tp": tp, "rank": rank, "chunks": {}}
                for k in CHUNKS:
                    got = [heads[k](x) for x in xs]
                    rec["chunks"][k] = all(_same(g, r) for g, r in zip(got, ref, strict=True))
                    rec[f"used {k}"] = heads[k].overlap_for(ROWS)
                out.append(rec)
        # A rank whose input is bad in a steady overlapped call: it raises its error, its peers PeerRankError.
        head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, mapping=mapping, process_group=group, overlap_chunks=3)
        head.load_weights({"weight": weights(VOCAB, HIDDEN, 11)})
        head(hidden_states(ROWS, HIDDEN, 1))
        bad = hidden_states(ROWS, HIDDEN, 1)
        if rank == 1:
            bad[2, 3] = float("nan")
        out.append({"case": f"tp={tp} failure", "tp": tp, "rank": rank, "failure": catch(lambda h=head, x=bad: h(x))})
        # Ranks built with other chunk counts: the first call's handshake names the field on every rank.
        head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, mapping=mapping, process_group=group,
                      overlap_chunks=2 + rank)
        head.load_weights({"weight": weights(VOCAB, HIDDEN, 11)})
        out.append({"case": f"tp={tp} mismatch", "tp": tp, "rank": rank,
                    "failure": catch(lambda h=head: h(hidden_states(ROWS, HIDDEN, 1)))})
    return out
