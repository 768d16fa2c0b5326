"""The ledger of the vocabulary dimension (what ``trtvocab plan`` prints).

Both ends of a model touch the vocabulary, the embedding table and the LM head, with the same
``[V, H]`` shape and shard layout (widths from ``trtvocab.parallel.sharding`` only). Every
figure is an exact byte or FLOP count from the shard math; times are those counts over an
assumed bandwidth or throughput, nothing is measured. The formulas: docs/architecture.md,
"plan: the ledger".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from trtvocab.base.units import decimal_bytes, human_bytes, human_flops, human_seconds
from trtvocab.errors import ConfigError
from trtvocab.parallel.sharding import LAYOUTS, VocabLayout, all_shards
from trtvocab.quant.nvfp4 import BLOCK as NVFP4_BLOCK
from trtvocab.weights.lora import footprint

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
BF16, FP32 = DTYPE_BYTES["bf16"], DTYPE_BYTES["fp32"]

DEFAULT_TOKENS = 8192
DEFAULT_LINK_GBS = 300.0
DEFAULT_TFLOPS = 600.0


def weight_bytes(rows: int, hidden: int) -> dict[str, int]:
    """Resident bytes of ``rows`` vocab rows in each storage format (including scales)."""
    return {
        "bf16": rows * hidden * 2,
        "fp8": rows * hidden + 4,
        "nvfp4": rows * hidden // 2 + rows * (hidden // NVFP4_BLOCK) + 4,
    }


class RankPlan(BaseModel):
    """One rank's share of the ledger.

    Args:
        rank, start, end: the rank and its token columns ``[start, end)``.
        rows: columns it owns; width: columns it allocates (``rows`` + padding).
        weight_bytes: the head's shard per storage format; local_logits_bytes: ``[B, rows]`` per dtype.
        allgather_send_bytes / allgather_recv_bytes: the wire of the pad-and-trim all-gather per dtype.
        logits_gather_recv_bytes / logits_gather_time_s: bf16 logits received at the real shard widths.
        head_flops / head_time_s: this rank's GEMM ``2 B w H``.
        matrices_bytes: embedding + head shards in bf16 (one matrix when tied).
        replicated_extra_bytes: what holding both matrices whole would add on this card.
        adapter_bytes: this rank's part of the LoRA adapters (``--lora``; bf16 copies, float32 factors).
    """

    rank: int
    start: int
    end: int
    rows: int
    width: int
    weight_bytes: dict[str, int]
    local_logits_bytes: dict[str, int]
    allgather_send_bytes: dict[str, int]
    allgather_recv_bytes: dict[str, int]
    logits_gather_recv_bytes: int = Field(description="bf16 [B, w_s] pieces of the other ranks, real widths")
    logits_gather_time_s: float
    head_flops: int
    head_time_s: float
    matrices_bytes: int = Field(description="bf16 embedding + LM head shards (one matrix when tied)")
    replicated_extra_bytes: int = Field(description="replicated matrices minus this rank's shards")
    adapter_bytes: int = Field(default=0, description="this rank's part of the LoRA adapters (--lora)")


class EmbeddingAllReduce(BaseModel):
    """The input embedding's all-reduce of ``[tokens, H]`` bf16 rows (each rank looks up the ids it owns).

    Args:
        tokens: tokens per step ``T``; payload_bytes: ``T * H * 2``.
        ring_bytes_per_rank: ``2 (n-1)/n * payload`` a ring all-reduce sends (and receives) per rank.
        time_s: ``ring_bytes_per_rank`` at the link bandwidth.
    """

    tokens: int
    payload_bytes: int
    ring_bytes_per_rank: int
    time_s: float


class LogitsGather(BaseModel):
    """The LM head's all-gather of bf16 ``[B, w]`` logits pieces, at the real (uneven or padded) widths.

    Args:
        recv_bytes_per_rank: the most any rank receives (``B * V * (n-1)/n * 2`` when the split is even).
        time_s: that at the link bandwidth.
        wire_recv_bytes_per_rank: what the pad-and-trim all-gather moves (pieces padded to the largest shard).
    """

    recv_bytes_per_rank: int
    time_s: float
    wire_recv_bytes_per_rank: int


class GreedyReduction(BaseModel):
    """Greedy sampling without a gather: every rank's (max, argmax) pair per row, as float32.

    Args:
        values: ``B * n * 2`` float32 values; bytes: ``4 * values``; time_s: bytes at the link bandwidth.
    """

    values: int
    bytes: int
    time_s: float


class HeadCompute(BaseModel):
    """The head GEMM.

    Args:
        flops: ``2 B V H`` for the whole head; time_s: that at ``tflops`` (one device doing it all).
        flops_per_rank / time_per_rank_s: the largest shard's ``2 B w H`` and its time (what a step waits for).
    """

    flops: int
    time_s: float
    flops_per_rank: int
    time_per_rank_s: float


class Matrices(BaseModel):
    """The ``[V, H]`` matrices held, in bf16: input embedding and LM head, or one when tied.

    Args:
        tied: the head is the embedding; count: 1 (tied) or 2.
        bytes_per_rank: the largest rank's shards; replicated_bytes_per_card: ``count * V * H * 2``.
        replicated_extra_bytes_per_card: the most replication adds on one card.
        replicated_extra_bytes_total: what it adds over all cards.
    """

    tied: bool
    count: int
    bytes_per_rank: int
    replicated_bytes_per_card: int
    replicated_extra_bytes_per_card: int
    replicated_extra_bytes_total: int


class Plan(BaseModel):
    """The vocabulary dimension over ``tp_size`` ranks at a ``batch`` of logits rows: totals, ledger, ranks.

    Args:
        vocab_size, hidden_size, tp_size, batch, layout: the shape asked for.
        tokens, link_gbs, tflops: the step and the machine the times assume.
        full_weight_bytes / gathered_logits_bytes: the whole head per format, ``[B, V]`` per dtype.
        embedding_allreduce, logits_gather, greedy, head, matrices: the ledger; ranks: every rank.
    """

    vocab_size: int
    hidden_size: int
    tp_size: int
    batch: int = Field(description="rows of logits per step (sequences)")
    layout: str = Field(description="uneven | padded")
    tokens: int = Field(default=DEFAULT_TOKENS, description="tokens per step through the input embedding")
    link_gbs: float = Field(default=DEFAULT_LINK_GBS, description="effective interconnect bandwidth, GB/s (1e9)")
    tflops: float = Field(default=DEFAULT_TFLOPS, description="effective GEMM throughput, TFLOP/s (1e12)")
    full_weight_bytes: dict[str, int] = Field(description="the whole [V, H] matrix per format")
    gathered_logits_bytes: dict[str, int] = Field(description="[batch, V] after the gather, per dtype")
    embedding_allreduce: EmbeddingAllReduce
    logits_gather: LogitsGather
    greedy: GreedyReduction
    head: HeadCompute
    matrices: Matrices
    ranks: list[RankPlan]
    adapters: list[str] = Field(default_factory=list, description="the LoRA adapters counted (--lora)")


def _positive_int(value: object, name: str, upper: int | None = None, what: str = "") -> None:
    bound = f"[1, {upper:,}]{what}" if upper is not None else "[1, inf)"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        raise ConfigError(f"{name} must be an integer in {bound}, got {value!r}")


def _positive_float(value: object, name: str, unit: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"{name} must be a finite number > 0 ({unit}), got {value!r}")


def check_inputs(vocab: int, hidden: int, tp: int, batch: int, layout: str, pad_to: int, tokens: int,
                 link_gbs: float, tflops: float) -> None:
    """Refuse impossible input with a ``ConfigError`` naming the option and its allowed range."""
    _positive_int(vocab, "--vocab")
    _positive_int(hidden, "--hidden")
    _positive_int(tp, "--tp", vocab, " (at most the vocab size, one column per rank)")
    _positive_int(batch, "--batch")
    _positive_int(tokens, "--tokens")
    _positive_int(pad_to, "--pad-to")
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    _positive_float(link_gbs, "--link-gbs", "GB/s")
    _positive_float(tflops, "--tflops", "TFLOP/s")


def make_plan(vocab: int, hidden: int, tp: int, batch: int, layout: VocabLayout = "uneven", pad_to: int = 64, *,
              tokens: int = DEFAULT_TOKENS, link_gbs: float = DEFAULT_LINK_GBS, tflops: float = DEFAULT_TFLOPS,
              tied: bool = False, adapters: Sequence[Any] = ()) -> Plan:
    """The ledger of a ``[vocab, hidden]`` embedding + head over ``tp`` ranks (see the module docstring).
    ``adapters``: opened LoRA adapters (:func:`trtvocab.weights.lora.open_adapter`), counted per rank."""
    check_inputs(vocab, hidden, tp, batch, layout, pad_to, tokens, link_gbs, tflops)
    link = link_gbs * 1e9  # bytes per second
    gemm = tflops * 1e12  # FLOP per second
    shards = all_shards(vocab, tp, layout, pad_to)
    piece = max(s.width for s in shards)
    padded_total = sum(s.width for s in shards)
    count = 1 if tied else 2
    replicated = count * vocab * hidden * BF16
    ranks = []
    for s in shards:
        send = {k: batch * piece * b if tp > 1 else 0 for k, b in DTYPE_BYTES.items()}
        recv = batch * (padded_total - s.width) * BF16
        flops = 2 * batch * s.width * hidden
        mats = count * s.width * hidden * BF16
        ranks.append(
            RankPlan(
                rank=s.rank, start=s.start, end=s.end, rows=s.size, width=s.width,
                weight_bytes=weight_bytes(s.width, hidden),
                local_logits_bytes={k: batch * s.size * b for k, b in DTYPE_BYTES.items()},
                allgather_send_bytes=send,
                allgather_recv_bytes={k: v * (tp - 1) for k, v in send.items()},
                logits_gather_recv_bytes=recv, logits_gather_time_s=recv / link,
                head_flops=flops, head_time_s=flops / gemm,
                matrices_bytes=mats, replicated_extra_bytes=replicated - mats,
                adapter_bytes=sum(footprint(a, s, hidden, BF16, tied=tied) for a in adapters),
            )
        )
    payload = tokens * hidden * BF16
    ring = 2 * (tp - 1) * payload // tp
    gather = max(r.logits_gather_recv_bytes for r in ranks)
    pairs = batch * tp * 2 if tp > 1 else 0
    flops = 2 * batch * vocab * hidden
    flops_rank = max(r.head_flops for r in ranks)
    return Plan(
        vocab_size=vocab, hidden_size=hidden, tp_size=tp, batch=batch, layout=layout,
        tokens=tokens, link_gbs=link_gbs, tflops=tflops,
        full_weight_bytes=weight_bytes(vocab, hidden),
        gathered_logits_bytes={k: batch * vocab * b for k, b in DTYPE_BYTES.items()},
        embedding_allreduce=EmbeddingAllReduce(tokens=tokens, payload_bytes=payload, ring_bytes_per_rank=ring,
                                               time_s=ring / link),
        logits_gather=LogitsGather(recv_bytes_per_rank=gather, time_s=gather / link,
                                   wire_recv_bytes_per_rank=max(r.allgather_recv_bytes["bf16"] for r in ranks)),
        greedy=GreedyReduction(values=pairs, bytes=pairs * FP32, time_s=pairs * FP32 / link),
        head=HeadCompute(flops=flops, time_s=flops / gemm, flops_per_rank=flops_rank,
                         time_per_rank_s=flops_rank / gemm),
        matrices=Matrices(tied=tied, count=count, bytes_per_rank=max(r.matrices_bytes for r in ranks),
                          replicated_bytes_per_card=replicated,
                          replicated_extra_bytes_per_card=max(r.replicated_extra_bytes for r in ranks),
                          replicated_extra_bytes_total=sum(r.replicated_extra_bytes for r in ranks)),
        ranks=ranks, adapters=[a.name for a in adapters],
    )


# ---- display --------------------------------------------------------------------------------
# Bandwidth figures are decimal (they pair with GB/s); memory figures are binary (human_bytes).
def ledger_rows(p: Plan) -> list[tuple[str, str, str]]:
    """``(what, figure, time)`` rows of the ledger table, each figure in its unit (decimal or binary)."""
    e, g, gr, h, m = p.embedding_allreduce, p.logits_gather, p.greedy, p.head, p.matrices
    which = "one tied matrix" if m.tied else "embedding + LM head"
    at_link, at_gemm = f"at {p.link_gbs:g} GB/s", f"at {p.tflops:g} TFLOP/s"
    return [
        (f"embedding all-reduce payload [T={e.tokens:,}, H] bf16", decimal_bytes(e.payload_bytes), ""),
        ("  ring all-reduce per rank, 2(n-1)/n x payload", decimal_bytes(e.ring_bytes_per_rank),
         f"{human_seconds(e.time_s)} {at_link}"),
        ("logits all-gather received per rank (bf16, real widths)", decimal_bytes(g.recv_bytes_per_rank),
         f"{human_seconds(g.time_s)} {at_link}"),
        ("  on the wire (pieces padded to the largest shard)", decimal_bytes(g.wire_recv_bytes_per_rank), ""),
        (f"greedy pair reduction, B x n x 2 float32 ({gr.values:,} values)", human_bytes(gr.bytes),
         f"{human_seconds(gr.time_s)} {at_link}"),
        ("head GEMM 2 B V H", human_flops(h.flops), f"{human_seconds(h.time_s)} {at_gemm}"),
        ("  per rank (largest shard)", human_flops(h.flops_per_rank), f"{human_seconds(h.time_per_rank_s)} {at_gemm}"),
        ("gathered logits [B, V] bf16 / fp32",
         f"{human_bytes(p.gathered_logits_bytes['bf16'])} / {human_bytes(p.gathered_logits_bytes['fp32'])}", ""),
        (f"matrices per rank ({which}, bf16)", human_bytes(m.bytes_per_rank), ""),
        ("  replicated instead: extra per card", f"+{human_bytes(m.replicated_extra_bytes_per_card)}", ""),
        (f"  replicated instead: extra over all {p.tp_size} cards", f"+{human_bytes(m.replicated_extra_bytes_total)}",
         ""),
    ] + ([(f"LoRA adapters per rank ({len(p.adapters)}: {', '.join(p.adapters)})",
           human_bytes(max(r.adapter_bytes for r in p.ranks)), "")] if p.adapters else [])
