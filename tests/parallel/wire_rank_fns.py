"""Rank functions of tests/pipeline/test_plan_wire.py: run decode steps, LMHead forwards (every gather mode,
attention DP) and embedding lookups at tp 2 and 3, recording the bytes every collective really takes
(:func:`tests.parallel.wire_counter.count_collectives`), call by call."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import subgroups
from tests.parallel.wire_counter import count_collectives
from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig, VocabParallelEmbedding
from trtvocab.quant import fp8
from trtvocab.sampling import SamplingParams, decode_output

V, H, B, ROWS, TOKENS, CALLS = 1001, 16, 4, 7, 6, 3
SAMPLED = {"temperature": 0.8, "seed": 5}
DECODE = {
    "greedy": {"temperature": 0.0},
    "seeded": SAMPLED,
    "top_k": {**SAMPLED, "top_k": 20},
    "top_p": {**SAMPLED, "top_p": 0.9},
    "min_p": {**SAMPLED, "min_p": 0.05},
    "typical_p": {**SAMPLED, "typical_p": 0.9},
    "logprobs": {"temperature": 0.0, "logprobs": 3},
    "logprobs0": {**SAMPLED, "logprobs": 0},
    "top_k+min_p+logprobs": {**SAMPLED, "top_k": 20, "min_p": 0.05, "logprobs": 2},
}
FORWARD = [(True, None, "uneven"), (True, 3, "uneven"), (True, None, "padded"), ("rank0", None, "uneven"),
           ("rank0", 3, "padded"), (False, None, "uneven")]
ADP = [None, 2]
ADP_ROWS = (3, 0, 5)


def _weights(vocab: int = V) -> torch.Tensor:
    return torch.randn(vocab, H, generator=torch.Generator().manual_seed(1))


def _x(rows: int, call: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(100 + call))


def _calls(fn: Any) -> list[list[tuple[str, int]]]:
    out = []
    for call in range(CALLS):
        with count_collectives() as events:
            fn(call)
        out.append(list(events))
    return out


def wire_cases(rank: int, world: int) -> dict[str, Any]:
    groups = subgroups(world)
    out: dict[str, Any] = {}
    for tp in (t for t in groups if rank < t):
        group = groups[tp]
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
        for name, kw in DECODE.items():
            head = LMHead(V, H, dtype=torch.float32, mapping=mapping, gather_output=False, process_group=group)
            head.load_weights({"weight": _weights()})
            params = SamplingParams(**kw)
            out[f"tp={tp} decode {name}"] = _calls(lambda c, h=head, p=params: decode_output(_x(B, c), h, p, step=c))
        for mode, chunk, layout in FORWARD:
            head = LMHead(V, H, dtype=torch.float32, mapping=mapping, gather_output=mode, gather_chunk_rows=chunk,
                          vocab_layout=layout, process_group=group)
            head.load_weights({"weight": _weights()})
            out[f"tp={tp} forward {mode} {chunk} {layout}"] = _calls(lambda c, h=head: h(_x(ROWS, c)))
        adp = Mapping(world_size=tp, rank=rank, tp_size=tp, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
        rows = ADP_ROWS[rank]
        for chunk in ADP:
            head = LMHead(V, H, dtype=torch.float32, mapping=adp, gather_chunk_rows=chunk, process_group=group)
            head.load_weights({"weight": _weights()})
            out[f"tp={tp} adp {chunk}"] = _calls(lambda c, h=head, n=rows: h(_x(n, c)))
        ids = torch.tensor([0, 5, 500, 999, 1000, 17])
        emb = VocabParallelEmbedding(V, H, dtype=torch.bfloat16, mapping=mapping, process_group=group)
        emb.load_weights({"weight": _weights()})
        out[f"tp={tp} embedding bf16"] = _calls(lambda c, e=emb, i=ids: e(i))
        q, s = fp8.quantize_fp8(_weights(), per_row=True)
        emb8 = VocabParallelEmbedding(V, H, dtype=torch.bfloat16, mapping=mapping, process_group=group,
                                      quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, activation="none",
                                                               granularity="per_row"))
        emb8.load_weights({"weight": q, "weight_scale": s})
        out[f"tp={tp} embedding fp8"] = _calls(lambda c, e=emb8, i=ids: e(i))
    return out
