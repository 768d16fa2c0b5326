"""The ledger of the vocabulary dimension (what ``trtvocab plan`` prints).

Both ends of a model touch the vocabulary, the embedding table and the LM head, with the same
``[V, H]`` shape and shard layout (widths from ``trtvocab.parallel.sharding`` only). Every
figure is an exact byte or FLOP count from the shard math; times are those counts over an
assumed bandwidth or throughput, nothing is measured. The formulas: docs/architecture.md,
"plan: the ledger".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from trtvocab.base.units import decimal_bytes, human_bytes, human_flops, human_seconds
from trtvocab.embedding import LOOKUP_HANDSHAKE
from trtvocab.errors import ConfigError
from trtvocab.lm_head import FORWARD_HANDSHAKE, GATHER_MODES, default_overlap_chunks
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import LAYOUTS, VocabLayout, all_shards
from trtvocab.quant.nvfp4 import BLOCK as NVFP4_BLOCK
from trtvocab.sampling.reductions import HANDSHAKE as SAMPLING_HANDSHAKE
from trtvocab.sampling.reductions import RADIX_BINS, RADIX_ROUNDS
from trtvocab.sampling.treesum import node_width
from trtvocab.weights.lora import footprint

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
BF16, FP32 = DTYPE_BYTES["bf16"], DTYPE_BYTES["fp32"]

WORD = 8  # an int64: trtvocab's candidate pairs and handshake fields
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
        adapter_bytes: this rank's part of the LoRA adapters (``adapters``; bf16 copies, float32 factors).
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
    adapter_bytes: int = Field(default=0, description="this rank's part of the LoRA adapters (adapters)")


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
    """Greedy sampling without a gather: every rank's (max, argmax) pair per row, all ranks' after the gather.

    Args:
        values: ``B * n * 2`` values (a pair per row and rank); bytes: what trtvocab sends, ``B * n * 3`` int64
            (the score's float64 bits and the id, so ids past 2**24 stay exact, and the row's status, which
            carries a refused row to every rank); time_s: bytes at the link bandwidth.
        float32_bytes: ``4 * values``, the pairs as float32 (the article's figure, vLLM's layout).
    """

    values: int
    bytes: int
    time_s: float
    float32_bytes: int = 0


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


class Collective(BaseModel):
    """One collective of a step, priced as the bytes each rank hands to it (its input tensor).

    Args:
        what: what it moves; kind: ``all_gather`` | ``all_reduce`` | ``all_to_all`` | ``gather`` | ``broadcast``.
        bytes: one rank's input (an all-gather's piece, an all-reduce's buffer, an all-to-all's whole send
            buffer), the agreement header included where it rides (``header``: 24 bytes and the payload
            rounded up to 8-byte words, on a steady step's first data collective).
        wire_recv_bytes: what one rank receives over the wire (a ring: ``(n-1) x bytes`` for an all-gather,
            ``2 (n-1)/n x bytes`` for an all-reduce; a gather: rank 0 receives ``(n-1) x bytes``; a broadcast:
            every rank but the source receives ``bytes``).
    """

    what: str
    kind: str
    bytes: int
    header: bool = False
    wire_recv_bytes: int


class StepCollectives(BaseModel):
    """Every collective of one call, first (handshake) and steady (the verdict riding on the data), summed."""

    first: list[Collective]
    steady: list[Collective]
    first_bytes: int
    steady_bytes: int


class Sampler(BaseModel):
    """The knobs of a decode step that change what crosses ranks (``sampling.decode``).

    ``logprobs``: None, or the top-N returned (0: the chosen token's). Top-p and typical-p cut their
    prefix in a fixed number of rounds (:data:`RADIX_ROUNDS`), whatever the distribution.
    """

    top_k: int = 0
    top_p: bool = False
    min_p: bool = False
    typical_p: bool = False
    logprobs: int | None = None
    bitmask: bool = False  # a grammar's bitmask: each row's digest rides the race (the ranks compare them)


class KVPricing(BaseModel):
    """Replication priced in KV-cache tokens (``kv_bytes_per_token`` B, ``layers`` L).

    Args:
        kv_bytes_per_token_per_layer: B; kv_layers: L; kv_bytes_per_token: ``B x L`` (a token's KV over the model).
        kv_tokens_replicated_extra_per_card: what replicating the matrices adds on one card, in KV tokens.
        kv_tokens_shard_per_rank: this plan's matrices per rank, in KV tokens.
    """

    kv_bytes_per_token_per_layer: int
    kv_layers: int
    kv_bytes_per_token: int
    kv_tokens_replicated_extra_per_card: int
    kv_tokens_shard_per_rank: int


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
    lm_head_tp_size: int = Field(default=0, description="ranks the vocabulary is split over (lm_head_tp; "
                                 "default tp_size): ranks, matrices and collectives are one head group's")
    head_groups: int = Field(default=1, description="tp_size / lm_head_tp_size head groups in the world")
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
    adapters: list[str] = Field(default_factory=list, description="the LoRA adapters counted (adapters)")
    decode_step: StepCollectives | None = Field(default=None, description="sampling.decode's collectives (tp > 1)")
    forward: StepCollectives | None = Field(default=None, description="LMHead.forward's collectives (tp > 1)")
    embedding: StepCollectives | None = Field(default=None, description="the embedding lookup's (tp > 1)")
    kv: KVPricing | None = Field(default=None, description="replication in KV tokens (kv_bytes_per_token)")


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
    _positive_int(vocab, "`vocab`")
    _positive_int(hidden, "`hidden`")
    _positive_int(tp, "`tp`", vocab, " (at most the vocab size, one column per rank)")
    _positive_int(batch, "`batch`")
    _positive_int(tokens, "`tokens`")
    _positive_int(pad_to, "`pad_to`")
    if layout not in LAYOUTS:
        raise ConfigError(f"`layout` must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    _positive_float(link_gbs, "`link_gbs`", "GB/s")
    _positive_float(tflops, "`tflops`", "TFLOP/s")


def make_plan(vocab: int, hidden: int, tp: int, batch: int, layout: VocabLayout = "uneven", pad_to: int = 64, *,
              tokens: int = DEFAULT_TOKENS, link_gbs: float = DEFAULT_LINK_GBS, tflops: float = DEFAULT_TFLOPS,
              tied: bool = False, adapters: Sequence[Any] = (), sampler: Sampler | None = None,
              logits_per_seq: int = 1, gather_output: bool | str = True, gather_chunk_rows: int | None = None,
              logits_bytes: int = BF16, adp_rows: Sequence[int] | None = None, embedding_dtype: str = "bf16",
              per_row_scales: bool = False, kv_bytes_per_token: int | None = None, layers: int = 1,
              lm_head_tp: int | None = None, overlap_chunks: int | None = None) -> Plan:
    """The ledger of a ``[vocab, hidden]`` embedding + head over ``tp`` ranks (see the module docstring).
    ``lm_head_tp``: the vocabulary split over head groups of that many of the ``tp`` ranks instead
    (``Mapping.lm_head_tp_size``): the ranks, matrices and collectives are one head group's (``batch`` rows
    a group; with ``adp_rows``, one count per rank of the world, the group that brings the most rows), the
    totals over the world count every group.
    ``adapters``: opened LoRA adapters (:func:`trtvocab.weights.lora.open_adapter`), counted per rank.
    At tp > 1 it also prices every collective (:func:`decode_collectives` for ``batch * logits_per_seq`` rows and
    ``sampler``, :func:`forward_collectives` in the gather mode, :func:`embedding_collectives` at ``tokens``);
    ``kv_bytes_per_token``: replication in KV tokens (:func:`kv_pricing`); ``overlap_chunks``: as for
    :func:`forward_collectives`."""
    check_inputs(vocab, hidden, tp, batch, layout, pad_to, tokens, link_gbs, tflops)
    world = tp
    tp, adp_rows = _head_group(world, lm_head_tp, adp_rows)
    groups = world // tp
    link = link_gbs * 1e9  # bytes per second
    gemm = tflops * 1e12  # FLOP per second
    count = 1 if tied else 2
    replicated = count * vocab * hidden * BF16
    ranks = _rank_plans(all_shards(vocab, tp, layout, pad_to), batch, hidden, link, gemm, count, replicated,
                        adapters, tied)
    plan = Plan(
        vocab_size=vocab, hidden_size=hidden, tp_size=world, lm_head_tp_size=tp, head_groups=groups,
        batch=batch, layout=layout,
        tokens=tokens, link_gbs=link_gbs, tflops=tflops,
        full_weight_bytes=weight_bytes(vocab, hidden),
        gathered_logits_bytes={k: batch * vocab * b for k, b in DTYPE_BYTES.items()},
        **_traffic(ranks, vocab, hidden, batch, tokens, link, gemm),
        matrices=Matrices(tied=tied, count=count, bytes_per_rank=max(r.matrices_bytes for r in ranks),
                          replicated_bytes_per_card=replicated,
                          replicated_extra_bytes_per_card=max(r.replicated_extra_bytes for r in ranks),
                          replicated_extra_bytes_total=groups * sum(r.replicated_extra_bytes for r in ranks)),
        ranks=ranks, adapters=[a.name for a in adapters],
    )
    _positive_int(logits_per_seq, "`logits_per_seq`")
    if gather_chunk_rows is not None:
        _positive_int(gather_chunk_rows, "`gather_chunk_rows`")
    if tp > 1:
        _embedding_table(embedding_dtype, "`embedding_dtype`")
        _price_collectives(plan, batch * logits_per_seq, layout, pad_to, sampler, gather_output=gather_output,
                           gather_chunk_rows=gather_chunk_rows, logits_bytes=logits_bytes, adp_rows=adp_rows,
                           overlap_chunks=overlap_chunks, embedding_dtype=embedding_dtype,
                           per_row_scales=per_row_scales)
    if groups > 1 and adp_rows is not None:
        plan.decode_step = _with_group_exchange(plan.decode_step, sum(adp_rows), sampler, world)
    if kv_bytes_per_token is not None:
        plan.kv = kv_pricing(plan, kv_bytes_per_token, layers)
    return plan


def _traffic(ranks: list[RankPlan], vocab: int, hidden: int, batch: int, tokens: int, link: float,
             gemm: float) -> dict[str, Any]:
    """:class:`Plan`'s embedding all-reduce, logits gather, greedy pairs and head compute of one head group."""
    tp = len(ranks)
    payload = tokens * hidden * BF16
    ring = 2 * (tp - 1) * payload // tp
    gather = max(r.logits_gather_recv_bytes for r in ranks)
    pairs = batch * tp * 2 if tp > 1 else 0
    flops = 2 * batch * vocab * hidden
    flops_rank = max(r.head_flops for r in ranks)
    return {"embedding_allreduce": EmbeddingAllReduce(tokens=tokens, payload_bytes=payload, ring_bytes_per_rank=ring,
                                                      time_s=ring / link),
            "logits_gather": LogitsGather(recv_bytes_per_rank=gather, time_s=gather / link,
                                          wire_recv_bytes_per_rank=max(r.allgather_recv_bytes["bf16"] for r in ranks)),
            "greedy": GreedyReduction(values=pairs, bytes=pairs * 3 // 2 * WORD, time_s=pairs * 3 // 2 * WORD / link,
                                      float32_bytes=pairs * FP32),
            "head": HeadCompute(flops=flops, time_s=flops / gemm, flops_per_rank=flops_rank,
                                time_per_rank_s=flops_rank / gemm)}


def _with_group_exchange(step: StepCollectives | None, rows: int, sampler: Sampler | None,
                         world: int) -> StepCollectives:
    """``step`` and, after it, the head groups' exchange ``generate`` makes under attention DP: every group's
    sampled rows to every rank of the ``world``, one all_gather of ``[rows, 1 + 3 w]`` int64 (the id, then the
    logprobs' ids, float32 value bits and ranks, ``w`` = top-N + 1 when asked), ``rows`` the busiest group's."""
    w = sampler.logprobs + 1 if sampler is not None and sampler.logprobs is not None else 0
    exchange = collective(f"head groups' ids [{rows}, {1 + 3 * w}] int64 (every group's rows to every rank)",
                          "all_gather", rows * (1 + 3 * w) * WORD, world)
    first, steady = (step.first, step.steady) if step is not None else ([], [])
    return _step([*first, exchange], [*steady, exchange])


def _price_collectives(plan: Plan, rows: int, layout: VocabLayout, pad_to: int, sampler: Sampler | None, *,
                       gather_output: bool | str,
                       gather_chunk_rows: int | None, logits_bytes: int, adp_rows: Sequence[int] | None,
                       overlap_chunks: int | None, embedding_dtype: str, per_row_scales: bool) -> None:
    """Fill ``plan``'s collectives (one head group of tp > 1): the decode step of ``rows`` rows, the forward
    in its gather mode, the embedding lookup of ``plan.tokens``."""
    vocab, hidden, tp = plan.vocab_size, plan.hidden_size, plan.lm_head_tp_size
    if gather_output == "rank0" and adp_rows is None:  # rank 0 gathers, samples and broadcasts the ids
        plan.decode_step = rank0_decode_collectives(vocab, hidden, tp, rows, layout, pad_to, sampler=sampler,
                                                    gather_chunk_rows=gather_chunk_rows, logits_bytes=logits_bytes)
    else:
        plan.decode_step = decode_collectives(vocab, tp, rows, sampler)
    plan.forward = forward_collectives(vocab, hidden, tp, rows, layout, pad_to, gather_output=gather_output,
                                       gather_chunk_rows=gather_chunk_rows, logits_bytes=logits_bytes,
                                       hidden_bytes=logits_bytes, adp_rows=adp_rows, overlap_chunks=overlap_chunks)
    plan.embedding = embedding_collectives(plan.tokens, hidden, tp, embedding_dtype, per_row_scales=per_row_scales)


def _head_group(world: int, lm_head_tp: int | None,
                adp_rows: Sequence[int] | None) -> tuple[int, Sequence[int] | None]:
    """``(tp, adp_rows)`` of one head group: ``lm_head_tp`` ranks of the ``world`` (all of them when None),
    and under attention DP the row counts of the group that brings the most rows."""
    if lm_head_tp is None:
        return world, adp_rows
    _positive_int(lm_head_tp, "`lm_head_tp`", world, f" (a divisor of `tp` {world})")
    if world % lm_head_tp:
        raise ConfigError(f"`lm_head_tp` ({lm_head_tp}) must divide `tp` ({world}): the head's groups tile the ranks")
    groups = world // lm_head_tp
    if adp_rows is not None and groups > 1:
        if len(adp_rows) != world:
            raise ConfigError(f"`adp_rows`: expected {world} row counts (one per rank), got {len(adp_rows)}")
        adp_rows = max((adp_rows[g * lm_head_tp:(g + 1) * lm_head_tp] for g in range(groups)), key=sum)
    return lm_head_tp, adp_rows


def _rank_plans(shards: Sequence[Any], batch: int, hidden: int, link: float, gemm: float, count: int,
                replicated: int, adapters: Sequence[Any], tied: bool) -> list[RankPlan]:
    """Each rank's :class:`RankPlan` of one head group's ``shards`` (``count`` matrices; ``link`` bytes/s,
    ``gemm`` FLOP/s; ``replicated``: the bytes of both matrices whole)."""
    tp = len(shards)
    piece = max(s.width for s in shards)
    padded_total = sum(s.width for s in shards)
    ranks = []
    for s in shards:
        send = {k: batch * piece * b if tp > 1 else 0 for k, b in DTYPE_BYTES.items()}
        recv = batch * (padded_total - s.width) * BF16
        flops = 2 * batch * s.width * hidden
        mats = count * s.width * hidden * BF16
        ranks.append(RankPlan(
            rank=s.rank, start=s.start, end=s.end, rows=s.size, width=s.width,
            weight_bytes=weight_bytes(s.width, hidden),
            local_logits_bytes={k: batch * s.size * b for k, b in DTYPE_BYTES.items()},
            allgather_send_bytes=send,
            allgather_recv_bytes={k: v * (tp - 1) for k, v in send.items()},
            logits_gather_recv_bytes=recv, logits_gather_time_s=recv / link,
            head_flops=flops, head_time_s=flops / gemm,
            matrices_bytes=mats, replicated_extra_bytes=replicated - mats,
            adapter_bytes=sum(footprint(a, s, hidden, BF16, tied=tied) for a in adapters),
        ))
    return ranks


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
        (f"greedy reduction, B x n x 3 int64 ({gr.values:,} pair values + status; as float32 pairs: "
         f"{human_bytes(gr.float32_bytes)})", human_bytes(gr.bytes), f"{human_seconds(gr.time_s)} {at_link}"),
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


# ---- every collective trtvocab issues, priced ------------------------------------------------------
# A handshake is one all_gather of [failed, *fields] int64 per rank; a steady call's verdict instead rides on
# its first data collective as a 3-word header, that payload padded to whole 8-byte words
# (trtvocab.parallel.distributed.Agreement). Counts come from the handshakes' declared fields, so a field added
# there is priced here.
HEADER_BYTES = D.AGREEMENT_HEADER_BYTES
EMBEDDING_TABLE_BYTES = {"bf16": 2, "fp32": 4, "fp8": 1}


def handshake_bytes(handshake: D.Handshake) -> int:
    """One rank's piece of a :class:`~trtvocab.parallel.distributed.Handshake`'s all_gather."""
    return (1 + len(handshake.fields)) * WORD


def collective(what: str, kind: str, nbytes: int, tp: int, *, header: bool = False) -> Collective:
    """A :class:`Collective` of ``nbytes`` per rank (``header``: the agreement header rides on it)."""
    if header:
        nbytes = HEADER_BYTES + WORD * -(-nbytes // WORD)
    wire = {"all_gather": (tp - 1) * nbytes, "gather": (tp - 1) * nbytes, "broadcast": nbytes,
            "all_reduce": 2 * (tp - 1) * nbytes // tp, "all_to_all": (tp - 1) * nbytes // tp}[kind]
    return Collective(what=what, kind=kind, bytes=nbytes, header=header, wire_recv_bytes=wire)


def _step(first: list[Collective], steady: list[Collective]) -> StepCollectives:
    return StepCollectives(first=first, steady=steady, first_bytes=sum(c.bytes for c in first),
                           steady_bytes=sum(c.bytes for c in steady))


def _with_header(data: list[tuple[str, str, int]], tp: int, handshake: int, what: str) -> StepCollectives:
    """A call under an Agreement: first the handshake then the data; steady the data, the header on its first."""
    first = [collective(f"{what} handshake", "all_gather", handshake, tp)]
    first += [collective(w, k, n, tp) for w, k, n in data]
    steady = [collective(w, k, n, tp, header=i == 0) for i, (w, k, n) in enumerate(data)]
    return _step(first, steady)


def _radix_rounds(knob: str, rows: int) -> list[tuple[str, str, int]]:
    """A nucleus cut's rounds (``reductions.prefix_keep``): ``[B, 256]`` int64 mass histograms, each gathered."""
    return [(f"{knob} cut round {i + 1}/{RADIX_ROUNDS} [B, {RADIX_BINS}] int64 mass histogram", "all_gather",
             rows * RADIX_BINS * WORD) for i in range(RADIX_ROUNDS)]


def decode_collectives(vocab: int, tp: int, rows: int, sampler: Sampler | None = None) -> StepCollectives:
    """``sampling.decode``'s collectives for ``rows`` rows (sampled rows for the filters; greedy rows race alone).

    In the order the draw issues them: top-k's merge of ``[B, k]`` (value bits, id) int64 pairs; top-p's vocab
    tree (``[B, 2 node_width(V)]`` float32 ``(max, sum exp)`` pairs) and its cut's radix rounds (``[B, 256]``
    int64 mass histograms, :func:`_radix_rounds`); min-p's global max ``[B]`` float32; typical-p's tree, its
    entropy ``[B]`` int64 and its radix rounds; the race's ``[B, 3]`` int64 (score bits, id, the
    row's status; a fourth word, the row's bitmask digest, under a grammar); the
    returned logprobs' tree with the picks ``[B, 2w + 1]`` float32, the rank count ``[B]`` int64 and the top-N
    pairs ``[B, N]``.
    """
    s = sampler or Sampler()
    tree = 2 * node_width(vocab)
    data: list[tuple[str, str, int]] = []
    if s.top_k:
        k = min(s.top_k, vocab)
        data.append((f"top-k merge [B, {k}] int64 pairs", "all_gather", rows * k * 2 * WORD))
    if s.top_p:
        data.append((f"top-p logsumexp tree [B, {tree}] float32", "all_gather", rows * tree * 4))
        data += _radix_rounds("top-p", rows)
    if s.min_p:
        data.append(("min-p global max [B] float32", "all_gather", rows * 4))
    if s.typical_p:
        data.append((f"typical-p logsumexp tree [B, {tree}] float32", "all_gather", rows * tree * 4))
        data.append(("typical-p entropy [B] int64 fixed point", "all_gather", rows * WORD))
        data += _radix_rounds("typical-p", rows)
    words = 4 if s.bitmask else 3
    data.append((f"race / greedy [B, {words}] int64 (score bits, id, status{', bitmask digest' * s.bitmask})",
                 "all_gather", rows * words * WORD))
    if s.logprobs is not None:
        data.append((f"logprobs tree + picks [B, {tree + 1}] float32", "all_gather", rows * (tree + 1) * 4))
        data.append(("logprobs rank count [B] int64", "all_gather", rows * WORD))
        if s.logprobs:
            data.append((f"logprobs top-{s.logprobs} [B, {s.logprobs}] int64 pairs", "all_gather",
                         rows * s.logprobs * 2 * WORD))
    return _with_header(data, tp, handshake_bytes(SAMPLING_HANDSHAKE), "sampling")


def forward_collectives(vocab: int, hidden: int, tp: int, rows: int, layout: VocabLayout = "uneven", pad_to: int = 64,
                        *, gather_output: bool | str = True, gather_chunk_rows: int | None = None,
                        logits_bytes: int = BF16, hidden_bytes: int = BF16,
                        adp_rows: Sequence[int] | None = None, overlap_chunks: int | None = None) -> StepCollectives:
    """``LMHead.forward``'s collectives (a split head): the handshake (every call unless the verdict rides on an
    all-gather), then the logits pieces ``[R, w]`` (``w`` the widest shard's owned columns, R rows a collective),
    all-gathered or gathered to rank 0. ``adp_rows``: attention DP (every rank's row count): the hidden rows
    ``[max rows, H]`` all-gathered, then ``[tp, R, w]`` blocks through an all-to-all per chunk of R rows.
    ``overlap_chunks``: the all-gather in k column chunks ``[N, w_j]`` (``LMHead(overlap_chunks=k)``; None: the
    library's default for this shape, :func:`~trtvocab.lm_head.default_overlap_chunks`)."""
    if not any(gather_output is m or (isinstance(m, str) and gather_output == m) for m in GATHER_MODES):
        raise ConfigError(f"`gather_output` must be one of true, false, rank0; got {gather_output!r}")
    width = max(sh.size for sh in all_shards(vocab, tp, layout, pad_to))
    hs = collective("LMHead handshake", "all_gather", handshake_bytes(FORWARD_HANDSHAKE), tp)
    if adp_rows is not None:
        height = max(adp_rows)
        step = height if gather_chunk_rows is None else max(1, min(gather_chunk_rows, height))
        calls = [hs, collective(f"attention DP hidden rows [{height}, H]", "all_gather", height * hidden * hidden_bytes,
                                tp)]
        calls += [collective(f"attention DP logits blocks [tp, {step}, {width}]", "all_to_all",
                             tp * step * width * logits_bytes, tp) for _ in range(-(-max(height, 1) // step))]
        return _step(calls, calls)
    if gather_output is False:
        return _step([hs], [hs])
    if gather_output is True and gather_chunk_rows is None and rows > 0:
        if overlap_chunks is None:
            overlap_chunks = default_overlap_chunks(tp, rows, hidden, width, logits_bytes)
        _positive_int(overlap_chunks, "`overlap_chunks`")
        k = min(overlap_chunks, width)
        if k > 1:
            edges = sorted({width * j // k for j in range(k + 1)})
            return _with_header([(f"logits all-gather, column chunk [{rows}, {b - a}]", "all_gather",
                                  rows * (b - a) * logits_bytes) for a, b in itertools.pairwise(edges)],
                                tp, handshake_bytes(FORWARD_HANDSHAKE), "LMHead")
    step = rows if gather_chunk_rows is None else max(1, min(gather_chunk_rows, rows))
    chunks = [min(step, rows - lo) for lo in range(0, rows, step)]
    if gather_output == "rank0":
        calls = [hs] + [collective(f"logits to rank 0 [{r}, {width}]", "gather", r * width * logits_bytes, tp)
                        for r in chunks]
        return _step(calls, calls)
    return _with_header([(f"logits all-gather [{r}, {width}]", "all_gather", r * width * logits_bytes)
                         for r in chunks], tp, handshake_bytes(FORWARD_HANDSHAKE), "LMHead")


def rank0_decode_collectives(vocab: int, hidden: int, tp: int, rows: int, layout: VocabLayout = "uneven",
                             pad_to: int = 64, *, sampler: Sampler | None = None, gather_chunk_rows: int | None = None,
                             logits_bytes: int = BF16) -> StepCollectives:
    """``sampling.decode``'s collectives for a head with ``gather_output="rank0"`` (:mod:`trtvocab.sampling.rank0`):
    the forward's (:func:`forward_collectives`: the handshake, the logits to rank 0), then rank 0's broadcast of
    ``[1 + B]`` int64 (a status word, the ids) and, when the rows ask for logprobs, of ``[B, 3 (1 + N)]`` int64
    (ids, ranks, the values' float32 bits). The sampler's knobs cross no rank: rank 0 holds the whole vocabulary."""
    s = sampler or Sampler()
    forward = forward_collectives(vocab, hidden, tp, rows, layout, pad_to, gather_output="rank0",
                                  gather_chunk_rows=gather_chunk_rows, logits_bytes=logits_bytes,
                                  hidden_bytes=logits_bytes)
    calls = [collective(f"sampled ids from rank 0 [1 + {rows}] int64 (status, ids)", "broadcast", (1 + rows) * WORD,
                        tp)]
    if s.logprobs is not None:
        cols = 3 * (1 + s.logprobs)
        calls.append(collective(f"logprobs from rank 0 [B, {cols}] int64 (ids, ranks, value bits)", "broadcast",
                                rows * cols * WORD, tp))
    return _step(forward.first + calls, forward.steady + calls)


def _embedding_table(table: object, name: str) -> None:
    """Refuse an embedding table dtype that is not one of :data:`EMBEDDING_TABLE_BYTES` (``name``: the argument
    as the caller names it)."""
    if table not in EMBEDDING_TABLE_BYTES:
        raise ConfigError(f"{name} must be one of {', '.join(EMBEDDING_TABLE_BYTES)}, got {table!r}")


def embedding_collectives(tokens: int, hidden: int, tp: int, table: str = "bf16", *,
                          per_row_scales: bool = False) -> StepCollectives:
    """The embedding lookup's collectives (a split table), every call: the handshake, then the looked-up rows
    ``[T, H]`` summed as integers of their own bytes (FP8: one byte an element) and, for an FP8 table with
    per-row scales, the ``[T, 1]`` float32 scales beside them. Once per forward, not per layer."""
    _embedding_table(table, "`table`")
    calls = [collective("embedding handshake", "all_gather", handshake_bytes(LOOKUP_HANDSHAKE), tp),
             collective(f"embedding rows [T, H] {table} as integers", "all_reduce",
                        tokens * hidden * EMBEDDING_TABLE_BYTES[table], tp)]
    if table == "fp8" and per_row_scales:
        calls.append(collective("FP8 per-row scales [T, 1] float32", "all_reduce", tokens * 4, tp))
    return _step(calls, calls)


def kv_pricing(p: Plan, kv_bytes_per_token: int, layers: int = 1) -> KVPricing:
    """Replication and the shards in KV-cache tokens: bytes over ``kv_bytes_per_token x layers``."""
    _positive_int(kv_bytes_per_token, "`kv_bytes_per_token`")
    _positive_int(layers, "`layers`")
    per_token = kv_bytes_per_token * layers
    m = p.matrices
    return KVPricing(kv_bytes_per_token_per_layer=kv_bytes_per_token, kv_layers=layers, kv_bytes_per_token=per_token,
                     kv_tokens_replicated_extra_per_card=m.replicated_extra_bytes_per_card // per_token,
                     kv_tokens_shard_per_rank=m.bytes_per_rank // per_token)


def collective_rows(p: Plan) -> list[tuple[str, str, str]]:
    """``(collective, bytes per rank first / steady, kind)`` rows of every priced call of the plan."""
    out = []
    for name, step in (("decode step", p.decode_step), ("LMHead.forward", p.forward), ("embedding", p.embedding)):
        if step is None:
            continue
        out.append((f"{name}: first call / steady", f"{step.first_bytes:,} B / {step.steady_bytes:,} B", ""))
        for c in step.steady:
            out.append((f"  {c.what}{' + header' if c.header else ''}", f"{c.bytes:,} B", c.kind))
    return out
