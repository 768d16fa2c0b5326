"""Rank functions of tests/layers/test_gather_modes.py: every gather mode of a split head against the
all-gather in one collective, and against the replicated head (deterministic heads: bitwise).

Spawned ranks unpickle these by module name, as for ``tests.parallel.rank_fns``. Each function runs
every case in one launch and returns per-case records; the test makes the assertions.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import catch, hidden_states, subgroups, weights
from trtvocab import LMHead, LogitsProcessor, Mapping

VOCAB = 1001  # 7 * 11 * 13: uneven at tp 2 and 3
HIDDEN = 32
ROWS = 7
CHUNKS = (1, 3, 7, 100)  # one row a gather, uneven chunks, exactly N, more than N
ADP_ROWS = (3, 0, 5)  # rows each rank brings under attention DP (rank 1 idle)
SEQ_LENS = [2, 3, 2]  # the LogitsProcessor's sequences over the ROWS rows


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal (NaN payloads included): same dtype, shape and bytes."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _head(vocab: int, dtype: torch.dtype, mapping: Mapping | None, group: Any, layout: str, deterministic: bool,
          w32: torch.Tensor, **kw: Any) -> LMHead:
    head = LMHead(vocab, HIDDEN, dtype=dtype, mapping=mapping, process_group=group, vocab_layout=layout,
                  pad_to=64, deterministic=deterministic, **kw)
    head.load_weights({"lm_head.weight": w32})
    return head


def gather_mode_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """For tp 1 (world 1) or every tp in 2..world: each mode's logits against the one-collective all-gather
    of the same head (bitwise), and a deterministic head's against the replicated head (bitwise)."""
    groups = subgroups(world)
    tps = [1] if world == 1 else [tp for tp in groups if rank < tp]
    w32 = weights(VOCAB, HIDDEN, seed)
    x32 = hidden_states(ROWS, HIDDEN, seed + 1)
    out: list[dict[str, Any]] = []
    processor = LogitsProcessor()
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        replicated = {d: _head(VOCAB, dtype, None, None, "uneven", d, w32) for d in (False, True)}
        for tp in tps:
            group = groups.get(tp)
            mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
            for layout in ("uneven", "padded"):
                for deterministic in (False, True):
                    tag = f"tp={tp} {str(dtype)[6:]} {layout} det={deterministic}"
                    base = _head(VOCAB, dtype, mapping, group, layout, deterministic, w32)
                    ref = base(x)
                    ref_proc = processor(x, base, torch.tensor(SEQ_LENS))
                    rec: dict[str, Any] = {"case": tag, "tp": tp, "rank": rank,
                                           "matches_replicated": _same(ref, replicated[deterministic](x))
                                           if deterministic else None}
                    local = _head(VOCAB, dtype, mapping, group, layout, deterministic, w32, gather_output=False)
                    rec["local"] = _same(local(x), ref[:, local.vocab_start: local.vocab_end])
                    modes = []
                    for mode in (True, "rank0"):
                        for rows in (None, *CHUNKS):
                            head = _head(VOCAB, dtype, mapping, group, layout, deterministic, w32,
                                         gather_output=mode, gather_chunk_rows=rows)
                            expect = ref if mode is True or rank == 0 else None
                            # twice: the second call of an all-gather rides its verdict on the first chunk
                            first, second = head(x), head(x)
                            proc = processor(x, head, torch.tensor(SEQ_LENS))
                            modes.append({"mode": mode, "rows": rows, "ok": _same(first, expect)
                                          and _same(second, expect)
                                          and _same(proc, ref_proc if expect is not None else None)})
                    rec["modes"] = modes
                    out.append(rec)
    for tp in tps:
        if tp > 1:
            out.extend(_attention_dp(rank, tp, groups.get(tp), w32, seed))
            out.append(_peer_failure(rank, tp, groups.get(tp), w32))
    return out


def _attention_dp(rank: int, tp: int, group: Any, w32: torch.Tensor, seed: int) -> list[dict[str, Any]]:
    """Attention DP with the head split: every rank's rows come back to it, chunked or not, bitwise."""
    counts = [*ADP_ROWS, 2, 2][:tp]
    mine = hidden_states(counts[rank], HIDDEN, seed + 10 + rank)
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
    ref = _head(VOCAB, torch.float32, mapping, group, "uneven", True, w32)(mine)
    replicated = _head(VOCAB, torch.float32, None, None, "uneven", True, w32)
    records = []
    for rows in (1, 2, 100):
        head = _head(VOCAB, torch.float32, mapping, group, "uneven", True, w32, gather_chunk_rows=rows)
        y = head(mine)
        records.append({"case": f"tp={tp} ADP chunk={rows}", "tp": tp, "rank": rank, "adp": True,
                        "ok": _same(y, ref) and y.shape == (counts[rank], VOCAB)
                        and (counts[rank] == 0 or _same(y, replicated(mine)))})
    return records


def _peer_failure(rank: int, tp: int, group: Any, w32: torch.Tensor) -> dict[str, Any]:
    """A steady chunked all-gather where rank 1 brings NaN rows: it raises its error, the others PeerRankError."""
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    out: dict[str, Any] = {"case": f"tp={tp} peer failure", "tp": tp, "rank": rank, "failure": True}
    for mode in (True, "rank0"):
        head = _head(VOCAB, torch.float32, mapping, group, "uneven", False, w32, gather_output=mode,
                     gather_chunk_rows=2)
        x = hidden_states(ROWS, HIDDEN, 3)
        head(x)  # agreed: the next call is steady
        if rank == 1:
            x = x.clone()
            x[4, 0] = float("nan")
        out[str(mode)] = catch(lambda h=head, v=x: h(v))[0]
    return out
