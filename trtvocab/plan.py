"""Memory and traffic accounting of a vocab-parallel head (what ``trtvocab plan`` prints).

All figures are exact byte counts from the shard math; nothing is measured.
Per rank ``r`` with ``rows = shard.size`` (uneven layout) or the padded width:

    weights   bf16  rows * H * 2
              fp8   rows * H + 4                    (+ per-tensor fp32 scale)
              nvfp4 rows * H / 2 + rows * H / 16 + 4 (packed E2M1 + E4M3 block scales + fp32 global)
    logits    local [batch, rows], gathered [batch, V], in bf16 and fp32
    all-gather: each rank sends its [batch, max_rows] piece (pieces are padded to the
              largest shard) and receives tp - 1 of them.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from trtvocab.quant.nvfp4 import BLOCK as NVFP4_BLOCK
from trtvocab.sharding import VocabLayout, all_shards

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def weight_bytes(rows: int, hidden: int) -> dict[str, int]:
    """Resident bytes of ``rows`` vocab rows in each storage format (including scales)."""
    return {
        "bf16": rows * hidden * 2,
        "fp8": rows * hidden + 4,
        "nvfp4": rows * hidden // 2 + rows * (hidden // NVFP4_BLOCK) + 4,
    }


class RankPlan(BaseModel):
    """One rank: its columns ``[start, end)`` (``rows`` owned, ``width`` allocated) and its bytes
    per format (``weight_bytes``) and per logits dtype (local logits, all-gather sent / received)."""

    rank: int
    start: int
    end: int
    rows: int
    width: int
    weight_bytes: dict[str, int]
    local_logits_bytes: dict[str, int]
    allgather_send_bytes: dict[str, int]
    allgather_recv_bytes: dict[str, int]


class Plan(BaseModel):
    """The whole head over ``tp_size`` ranks at a ``batch`` of logits rows: totals and every rank."""

    vocab_size: int
    hidden_size: int
    tp_size: int
    batch: int = Field(description="rows of logits per step (sequences)")
    layout: str = Field(description="uneven | padded")
    full_weight_bytes: dict[str, int] = Field(description="the whole [V, H] matrix per format")
    gathered_logits_bytes: dict[str, int] = Field(description="[batch, V] after the gather, per dtype")
    ranks: list[RankPlan]


def make_plan(vocab: int, hidden: int, tp: int, batch: int, layout: VocabLayout = "uneven", pad_to: int = 64) -> Plan:
    shards = all_shards(vocab, tp, layout, pad_to)
    piece = max(s.width for s in shards)
    ranks = []
    for s in shards:
        send = {k: batch * piece * b if tp > 1 else 0 for k, b in DTYPE_BYTES.items()}
        ranks.append(
            RankPlan(
                rank=s.rank, start=s.start, end=s.end, rows=s.size, width=s.width,
                weight_bytes=weight_bytes(s.width, hidden),
                local_logits_bytes={k: batch * s.size * b for k, b in DTYPE_BYTES.items()},
                allgather_send_bytes=send,
                allgather_recv_bytes={k: v * (tp - 1) for k, v in send.items()},
            )
        )
    return Plan(
        vocab_size=vocab, hidden_size=hidden, tp_size=tp, batch=batch, layout=layout,
        full_weight_bytes=weight_bytes(vocab, hidden),
        gathered_logits_bytes={k: batch * vocab * b for k, b in DTYPE_BYTES.items()},
        ranks=ranks,
    )
