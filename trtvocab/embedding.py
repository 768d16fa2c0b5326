"""The input end of the vocabulary: ``input_ids [...] -> rows [..., H]``, split like the head.

Each rank holds the same shard of the ``[V, H]`` table that its :class:`~trtvocab.lm_head.LMHead`
holds of the head (:mod:`trtvocab.parallel.sharding`), so a tied model keeps one buffer for both
ends (:func:`tie_weights`, :func:`load_tied`). A lookup is masked, then summed over the TP group;
ids outside ``[0, V)`` (``-1`` sentinels, ``V + k`` placeholders, padding columns) have no owner
and give zero rows at every tp size. The sum runs over the rows' **bit patterns** as integers,
so it is exact for every value (``-0.0`` and NaN payloads included), and an FP8 table moves one
byte per element (dequantized once, after the reduce). Attention DP without LM-head TP
replicates the table; with LM-head TP each rank's ids are all-gathered, looked up, summed, and
each rank keeps its own rows. The lookup, step by step: the section "the masked lookup" below.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trtvocab.base.dtypes import DTYPES
from trtvocab.base.family import EmbeddingOps
from trtvocab.base.formats import Activation, WeightFormat
from trtvocab.errors import ConfigError, InputError, RankMismatchError
from trtvocab.lm_head import LMHead
from trtvocab.parallel import distributed as D
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import LAYOUT_FIELD, VocabLayout
from trtvocab.quant import fp8, gguf_blocks
from trtvocab.quant.config import QuantAlgo, QuantConfig
from trtvocab.quant.gguf_blocks import GGUFConfig
from trtvocab.vocab_parallel import VocabParallelModule, load_collectively
from trtvocab.weights import DenseWeight, FP8Weight, GGUFWeight, WeightMethod
from trtvocab.weights.loader import open_embedding  # ModelOpt and compressed-tensors tables (headers only)
from trtvocab.weights.lora import check_adapter_ids, groups, lora_partial, lora_rows, replace_rows_

# ---- the masked lookup ----------------------------------------------------------------------------
#     ids      [  5,  -1,  9, 12 ]          V = 10, tp = 2: rank 0 owns [0, 5), rank 1 [5, 10)
#     rank 0   [  0,   0,  0,  0 ]          (no id of rank 0's, -1 and 12 are nobody's)
#     rank 1   [ w5,   0, w9,  0 ]
#     all-reduce (SUM) -> [w5, 0, w9, 0]    exact: one owner per id, everybody else adds zeros
#
# Ids outside ``[0, V)`` (``-1`` sentinels of speculative decoding, ``V + k`` placeholders of
# multimodal inputs, padding columns) have no owner and give zero rows at every tp size,
# replicated included. The sum runs over the rows' bit patterns viewed as integers (int32 where a
# row's bytes divide by 4, else uint8): with one non-zero term per element it is exact for every
# value, ``-0.0`` and NaN payloads included, and for an FP8 table it moves 1 byte per element (the
# scales, one fp32 per looked-up row when per-row, travel beside); dequantization happens once,
# after the reduce.


TIEABLE = (WeightFormat.DENSE, *gguf_blocks.FORMATS)  # what a tied pair can share (VocabParallelEmbedding.from_head)
# What the ranks of a split embedding agree on before every lookup (protocol: trtvocab.parallel.distributed.Handshake).
LOOKUP_HANDSHAKE = D.Handshake("VocabParallelEmbedding", (
    D.Field("vocab_size"), D.Field("hidden_size"), D.Field("tp_size"), D.Field(LAYOUT_FIELD),
    D.Field("dtype", DTYPES), D.Field("weight format", WeightFormat), D.Field("reduce_output"),
    D.Field("ids", per_rank=True), D.Field("ids digest", per_rank=True),
))


class VocabParallelEmbedding(VocabParallelModule):
    """Token-id lookup into a ``[V, H]`` table, replicated or split over the vocab like :class:`LMHead`.

    Args:
        vocab_size: V.
        hidden_size: H.
        dtype: the dtype of the returned rows (and of a dense table).
        mapping: where this rank sits; ``None`` is a replicated table. Attention DP without
            ``enable_lm_head_tp_in_adp`` also replicates (the mapping decides, as for the head).
        vocab_layout: ``"uneven"`` or ``"padded"`` (:mod:`trtvocab.parallel.sharding`); ids in padding
            columns are outside the vocabulary.
        pad_to: the padding multiple of the padded layout.
        process_group: the TP group when ``world_size > tp_size``.
        quant_config: an FP8 :class:`~trtvocab.quant.config.QuantConfig` for a
            ``float8_e4m3fn`` table (per-tensor or per-row scale), a
            :class:`~trtvocab.quant.gguf_blocks.GGUFConfig` for GGUF blocks; ``None`` is dense.
        reduce_output: all-reduce the partial rows (default); ``False`` returns this rank's
            partial rows (zero where it owns no id), for callers that reduce themselves.
        device: where the table lives.
        embedding_ops: what the family's embedding module does to the rows
            (:class:`~trtvocab.base.family.EmbeddingOps`: Gemma's ``sqrt(H)`` scale); default none.
            ``from_checkpoint`` reads it from the checkpoint (:mod:`trtvocab.checkpoints.families`).

    ``forward(input_ids)``: an integer tensor of any shape ``[...]`` -> ``[..., H]`` in ``dtype``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype = torch.bfloat16,
                 mapping: Mapping | None = None, vocab_layout: VocabLayout = "uneven", pad_to: int = 64,
                 process_group: Any = None, quant_config: QuantConfig | None = None, reduce_output: bool = True,
                 device: torch.device | str | None = None, embedding_ops: EmbeddingOps | None = None) -> None:
        blocks = isinstance(quant_config, GGUFConfig)
        if quant_config is not None and not blocks and quant_config.quant_algo is not QuantAlgo.FP8:
            raise ConfigError(f"VocabParallelEmbedding: only FP8 tables are supported, got {quant_config.quant_algo}")
        super().__init__(vocab_size, hidden_size, dtype=dtype, mapping=mapping, vocab_layout=vocab_layout,
                         pad_to=pad_to, process_group=process_group)
        self.reduce_output = bool(reduce_output)
        self.quant_config = quant_config
        if embedding_ops is not None and not isinstance(embedding_ops, EmbeddingOps):
            raise ConfigError("VocabParallelEmbedding embedding_ops must be a trtvocab.base.family.EmbeddingOps, "
                              f"got {type(embedding_ops).__name__}")
        self.embedding_ops: EmbeddingOps = embedding_ops or EmbeddingOps()
        if quant_config is None:
            self.weights: WeightMethod = DenseWeight(self.shard, hidden_size, dtype)
        elif blocks:  # a GGUF table in its stored blocks: looked-up rows dequantized exactly
            self.weights = GGUFWeight(self.shard, hidden_size, dtype, quant_config)
        else:
            # The table is only read row by row: no activation quantization applies to it.
            config = quant_config.model_copy(update={"activation": Activation.NONE})
            self.weights = FP8Weight(self.shard, hidden_size, dtype, config)
        if device is not None:
            self.to(device)

    # ---- weights -------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | Any,
        *,
        mapping: Mapping | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tensor_name: str | None = None,
        vocab_layout: VocabLayout = "uneven",
        pad_to: int = 64,
        process_group: Any = None,
        reduce_output: bool = True,
        gguf_blocks: bool = True,
    ) -> VocabParallelEmbedding:
        """This rank's shard of a checkpoint's input embedding, reading only its rows (``path``: a
        path, or a checkpoint already opened by ``trtvocab.checkpoints.checkpoint.open_checkpoint``).

        ``tensor_name``: the ``[V, H]`` tensor when it is none of ``model.embed_tokens.weight``,
        ``embeddings.word_embeddings.weight``, ``transformer.wte.weight`` (or GGUF's
        ``token_embd.weight``). A ``float8_e4m3fn`` table with its ``weight_scale`` loads as
        FP8; a GGUF table of a stored block type (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K) stays in its
        blocks (``gguf_blocks=False``: float32-dequantized).
        Split tables meet once after loading, like the head
        (:func:`~trtvocab.vocab_parallel.load_collectively`).
        """

        def build() -> VocabParallelEmbedding:
            source = open_embedding(path, tensor_name, gguf_blocks)
            if source.notice:
                warnings.warn(source.notice, stacklevel=4)
            emb = cls(source.vocab_size, source.hidden_size, dtype=dtype, mapping=mapping, vocab_layout=vocab_layout,
                      pad_to=pad_to, process_group=process_group, quant_config=source.quant_config,
                      reduce_output=reduce_output, embedding_ops=source.embedding_ops)
            emb.load_weights(source.tensors)
            return emb

        return load_collectively(build, mapping=mapping, group=process_group,
                                 what=f"VocabParallelEmbedding.from_checkpoint({path})")

    @classmethod
    def from_head(cls, lm_head: Any, *, reduce_output: bool = True,
                  embedding_ops: EmbeddingOps | None = None) -> VocabParallelEmbedding:
        """An embedding that shares a loaded dense head's shard (the checkpoint's one table was
        read into the head): same vocab, hidden size, dtype, mapping, layout, process group and
        device; ``embedding.weights is lm_head.weights`` afterwards. A head that holds no loaded
        table, or a quantized one, is refused (:class:`ConfigError` naming the head).
        ``embedding_ops``: the family's (default: that of the family the head was loaded as)."""
        if lm_head.weight_format not in TIEABLE:
            raise ConfigError(f"VocabParallelEmbedding.from_head: the head is {lm_head.weight_format}; "
                              "only dense tables and GGUF blocks can be tied (the gating rule keeps tied heads "
                              "dense)")
        if not lm_head.weights.loaded:
            raise ConfigError("VocabParallelEmbedding.from_head: the head holds no loaded table "
                              "(load_weights / from_checkpoint first)")
        family = getattr(lm_head, "family", None)
        if embedding_ops is None and family is not None:
            embedding_ops = family.embedding
        emb = cls(lm_head.vocab_size, lm_head.hidden_size, dtype=lm_head.dtype, mapping=lm_head.mapping,
                  vocab_layout=lm_head.vocab_layout, pad_to=lm_head.pad_to, process_group=lm_head.process_group,
                  reduce_output=reduce_output, device=lm_head.device, embedding_ops=embedding_ops)
        emb.weights = lm_head.weights  # the head's shard: dense rows, or GGUF blocks dequantized at lookup
        _tie_checks(emb, lm_head)
        return emb

    # ---- lookup --------------------------------------------------------------------------------------
    def _check_ids(self, input_ids: Any) -> InputError | None:
        if not isinstance(input_ids, torch.Tensor):
            return InputError(f"input_ids: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.is_complex() or input_ids.dtype == torch.bool:
            return InputError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        if input_ids.device != self.device:
            return InputError(f"input_ids: on {input_ids.device}, the table is on {self.device}")
        return None

    def handshake_identity(self, ids: int = 0, digest: int = 0) -> dict[str, Any]:
        """This rank's values of :data:`LOOKUP_HANDSHAKE` for a lookup of ``ids`` ids whose digest is ``digest``
        (the module's, :meth:`VocabParallelModule.handshake_identity`, then the embedding's own)."""
        return super().handshake_identity() | {"reduce_output": self.reduce_output, "ids": ids, "ids digest": digest}

    def _same_ids(self, digests: list[int], counts: list[int]) -> None:
        """Without attention DP every rank of the TP group must look up the same ids: a rank
        whose ids differ (same count) would get its peers' rows summed into its own."""
        if self.mapping.enable_attention_dp or len(set(digests)) <= 1:
            return
        groups: dict[int, list[int]] = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        raise RankMismatchError(
            f"VocabParallelEmbedding: ranks of the TP group look up different input_ids ({counts[0]} ids each; "
            f"ranks holding equal ids: {sorted(groups.values())}); without attention DP every rank must bring "
            "the same input_ids (with attention DP + LM-head TP each rank brings its own)")

    def local_rows(self, input_ids: torch.Tensor,
                   adapter_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's partial rows of ``input_ids`` (flattened to ``[N]``), as stored.

        Returns ``(rows [N, H], scales [N, 1] or None)``: dense rows in ``dtype``, or FP8 rows
        (``float8_e4m3fn``) with their per-row fp32 scales; zero rows (and zero scales) for ids
        this rank does not own. No collective. ``adapter_ids`` (``[N]``, one per id): the
        adapters' copies and trainable tokens replace rows (their LoRA is added by :meth:`forward`).
        """
        ids = input_ids.reshape(-1).to(torch.int64)
        local = ids - self.shard.start
        mine = (local >= 0) & (local < self.shard.size)  # ids < 0 or >= V fall outside every shard
        index = torch.where(mine, local, torch.zeros_like(local))
        if self.weight_format.is_gguf:  # stored blocks: the looked-up rows dequantized (exact d * q)
            rows = self.weights.lookup(index).to(self.dtype)
            rows.masked_fill_(~mine[:, None], 0.0)
            return rows, None
        stored = self.weights.weight
        rows = stored[index]
        rows.view(torch.uint8).masked_fill_(~mine[:, None], 0)
        if adapter_ids is not None and self.adapters:
            replace_rows_(rows, index, mine, self.adapters, adapter_ids)
            if self.added_vocab:
                self._added_rows_(rows, ids, adapter_ids)
        scales = None
        if self.weight_format is WeightFormat.FP8 and self.weights.per_row:
            scales = self.weights.weight_scale[index].masked_fill_(~mine[:, None], 0.0)
        return rows, scales

    def _added_rows_(self, rows: torch.Tensor, ids: torch.Tensor, adapter_ids: torch.Tensor) -> None:
        """Rows of added ids ``[V, V + A)`` this rank's added piece owns, from each id's adapter, in place. An
        added id whose adapter does not add it (or no adapter) stays a zero row on every rank: outside that
        row's vocabulary, so nobody's (DESIGN invariant 6; vLLM's layout did the same)."""
        piece = self.added_shard
        if piece is None:
            return
        local = ids - self.vocab_size - piece.start
        for k, pos in groups(adapter_ids):
            table = self.adapters[k].added_rows
            if table is None or not table.shape[0]:
                continue
            hit = pos[(local[pos] >= 0) & (local[pos] < table.shape[0])]
            rows[hit] = table[local[hit]].to(rows.dtype)

    def dequantize_rows(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Rows of :meth:`local_rows` (summed over the group, or not) in :attr:`dtype`: dense rows as
        they are, FP8 rows times their per-row ``scales`` (or the table's one scale)."""
        if self.weight_format is WeightFormat.DENSE or self.weight_format.is_gguf:
            return rows
        scale = scales if scales is not None else self.weights.weight_scale
        return fp8.dequantize_fp8(rows, scale).to(self.dtype)

    def _token_adapters(self, input_ids: Any, adapter_ids: Any) -> tuple[torch.Tensor | None, InputError | None]:
        """One adapter index per id (``adapter_ids`` is ``input_ids``' shape or a leading part of it,
        e.g. ``[B]`` for ``[B, T]`` ids), or why not."""
        if adapter_ids is None:
            return None, None
        if self.is_split and (self.mapping.enable_attention_dp or not self.reduce_output):
            return None, InputError("adapter_ids: per-row adapters need a split table without attention DP and "
                                    "with reduce_output=True")
        if not isinstance(adapter_ids, torch.Tensor) or not isinstance(input_ids, torch.Tensor):
            return None, InputError(f"adapter_ids: expected a torch.Tensor, got {type(adapter_ids).__name__}")
        lead = tuple(adapter_ids.shape)
        if adapter_ids.dim() > input_ids.dim() or tuple(input_ids.shape[: len(lead)]) != lead:
            return None, InputError(f"adapter_ids: shape {list(lead)} is not a leading part of input_ids' "
                                    f"{list(input_ids.shape)}")
        view = adapter_ids.reshape(*lead, *([1] * (input_ids.dim() - len(lead))))
        flat = view.expand(input_ids.shape).reshape(-1)
        why = check_adapter_ids(flat, flat.shape[0], len(self.adapters), "adapter_ids")
        return (None, InputError(why)) if why else (flat.to(self.device), None)

    def forward(self, input_ids: torch.Tensor, adapter_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[..., H]`` of ``input_ids``; ``adapter_ids``: each sequence's (or id's) adapter
        (:meth:`load_adapter`; ``-1``: none), the shape of ``input_ids`` or a leading part of it."""
        error = self._check_ids(input_ids)
        per_id, why = self._token_adapters(input_ids, adapter_ids) if error is None else (None, None)
        error = error or why
        if not self.is_split:
            if error is not None:
                raise error
            rows, scales = self.local_rows(input_ids, per_id)
            out = self.embedding_ops.apply(self.dequantize_rows(rows, scales))
            out = self._add_lora(out, input_ids, per_id)
            return out.reshape(*input_ids.shape, self.hidden_size)
        count = input_ids.numel() if isinstance(input_ids, torch.Tensor) else 0
        adp = self.mapping.enable_attention_dp
        # The ids themselves must agree without attention DP: their digest (int64 values and shape),
        # with each id's adapter when adapters are picked (so every rank takes the same collectives).
        digest = 0
        if error is None and not adp:
            digest = D.tensor_digest(input_ids.to(torch.int64))
            if per_id is not None:
                digest = D.tensor_digest(torch.tensor([digest, D.tensor_digest(per_id.to(torch.int64))]))
        agreed = self._meet(LOOKUP_HANDSHAKE, self.handshake_identity(count, digest), error, "ids", "ids")
        counts = agreed["ids"]
        self._same_ids(agreed["ids digest"], counts)
        ids = D.all_gather_rows(input_ids.reshape(-1), counts, self.process_group) if adp else input_ids
        rows, scales = self.local_rows(ids, per_id)
        if self.reduce_output:
            _sum_bits(rows, self.process_group)
            if scales is not None:
                D.all_reduce(scales, dist.ReduceOp.SUM, self.process_group)  # one owner: exact
        out = self.dequantize_rows(rows, scales)
        out = self.embedding_ops.apply(out)  # one owner per id: scaling partial rows is scaling their sum
        out = self._add_lora(out, ids, per_id)
        if adp:
            me = self.tp_rank  # this rank's place in the head group the ids were gathered over
            out = out[sum(counts[:me]) : sum(counts[: me + 1])]
        return out.reshape(*input_ids.shape, self.hidden_size)

    def _add_lora(self, out: torch.Tensor, input_ids: torch.Tensor, per_id: torch.Tensor | None) -> torch.Tensor:
        """``out [N, H]`` plus each id's embedding LoRA ``s * A.T[id] @ B.T`` (times the family's scale, as
        PEFT does). A split table sums the ``[N, r]`` looked-up rows of ``A.T`` over the group first (one
        owner per element: exact); every rank then computes the same rows."""
        if per_id is None or not any(a.has_lora for a in self.adapters):
            return out
        ids = input_ids.reshape(-1).to(torch.int64)
        local = ids - self.shard.start
        mine = (local >= 0) & (local < self.shard.size)
        partial = lora_partial(torch.where(mine, local, torch.zeros_like(local)), mine, self.adapters, per_id)
        if self.is_split:
            D.all_reduce(partial, dist.ReduceOp.SUM, self.process_group)
        for pos, delta in lora_rows(partial, self.adapters, per_id):
            out[pos] = out[pos] + self.embedding_ops.apply(delta.to(out.dtype))
        return out

    def _adapter_target(self) -> str:
        return "embedding"

    def _check_adapter(self, part: Any) -> None:
        if self.weight_format is not WeightFormat.DENSE and (part.copy is not None or part.token_index is not None):
            raise ConfigError(f"VocabParallelEmbedding.load_adapter: {part.name} replaces rows of an "
                              f"{self.weight_format} table (modules_to_save / trainable tokens need a dense table)")

    def extra_repr(self) -> str:
        ops = "" if self.embedding_ops.is_identity else f", ops={self.embedding_ops.describe()}"
        return f"{self._placement()}, reduce_output={self.reduce_output}{ops}"


def _sum_bits(rows: torch.Tensor, group: Any) -> None:
    """All-reduce (SUM) ``rows`` in place as integers of the same bytes (the section "the masked lookup").

    FP8 rows go as bytes (one uint8 per element); wider rows as int32 words where a row's
    bytes divide by 4, else as bytes. gloo has no int16 or float8 reductions, and an integer
    sum with one non-zero term is the bit pattern itself.
    """
    flat = rows.view(torch.uint8)
    if rows.element_size() > 1 and flat.shape[-1] % 4 == 0:
        flat = flat.view(torch.int32)
    D.all_reduce(flat, dist.ReduceOp.SUM, group)


def _tie_checks(embedding: VocabParallelEmbedding, lm_head: Any) -> None:
    """Refuse (ConfigError naming the difference) a pair that cannot share one shard buffer."""
    checks = [("vocab_size", embedding.vocab_size, lm_head.vocab_size),
              ("hidden_size", embedding.hidden_size, lm_head.hidden_size),
              ("tp_size", embedding.tp_size, lm_head.tp_size), ("tp_rank", embedding.tp_rank, lm_head.tp_rank),
              ("vocab_layout", embedding.vocab_layout, lm_head.vocab_layout),
              ("dtype", embedding.dtype, lm_head.dtype),
              ("shard", (embedding.shard.start, embedding.shard.end, embedding.shard.width),
               (lm_head.shard.start, lm_head.shard.end, lm_head.shard.width)),
              ("device", embedding.device, lm_head.device)]
    for name, a, b in checks:
        if a != b:
            raise ConfigError(f"tie_weights: the embedding and the head differ in {name}: {a} vs {b}")
    if embedding.weights is lm_head.weights:
        return
    for what, fmt in (("embedding", embedding.weight_format), ("head", lm_head.weight_format)):
        if fmt is not WeightFormat.DENSE:
            raise ConfigError(f"tie_weights: the {what} is {fmt}; only dense tables can be tied "
                              "(the gating rule keeps tied heads dense)")


def tie_weights(embedding: VocabParallelEmbedding, lm_head: Any) -> None:
    """Make ``lm_head`` use ``embedding``'s shard on this rank (a tied model, Hugging Face's
    direction: the output embedding takes the input embedding's weight).

    Both must have the same vocab, hidden size, tp size and rank, layout (and pad_to), dtype
    and device, and both must be dense (the gating rule keeps tied heads dense): otherwise a
    :class:`ConfigError` names the difference. The embedding provides the table, so it must
    hold a loaded one (``embedding.load_weights`` or ``from_checkpoint``): an empty embedding
    is refused naming the embedding (for the other direction, a loaded head and no embedding
    table, use :meth:`VocabParallelEmbedding.from_head`). A head that holds a loaded table
    too is accepted only when that table is bitwise the embedding's; two different loaded
    tables are refused naming both. Afterwards ``embedding.weights is lm_head.weights``: the
    same storage, counted once.
    """
    _tie_checks(embedding, lm_head)
    if embedding.weights is lm_head.weights:
        return
    if not embedding.weights.loaded:
        raise ConfigError(
            "tie_weights: the embedding holds no loaded table, and the head takes the embedding's shard "
            "(Hugging Face's direction); load the embedding first (load_weights / from_checkpoint), or build "
            "the embedding from a loaded head with VocabParallelEmbedding.from_head(head)")
    if lm_head.weights.loaded and not torch.equal(lm_head.weights.weight, embedding.weights.weight):
        raise ConfigError(
            "tie_weights: the embedding and the head both hold loaded tables and they differ "
            f"(shard [{embedding.vocab_start}, {embedding.vocab_end})); a tied model has one table: "
            "load only the embedding, or leave the model untied")
    lm_head.weights = embedding.weights


def load_tied(path: str | Path, *, mapping: Mapping | None = None, dtype: torch.dtype = torch.bfloat16,
              vocab_layout: VocabLayout = "uneven", pad_to: int = 64, process_group: Any = None,
              gather_output: bool = True, deterministic: bool = False,
              output_dtype: torch.dtype | None = None, gguf_blocks: bool = True) -> tuple[VocabParallelEmbedding, Any]:
    """``(embedding, head)`` of a checkpoint. A tied checkpoint's shard is read once and shared
    (:func:`tie_weights`; a GGUF table of a stored block type stays in its blocks, the embedding dequantizes the
    rows it looks up); an untied one loads each matrix. ``deterministic`` / ``output_dtype`` /
    ``gguf_blocks``: the head's (see :meth:`~trtvocab.lm_head.LMHead.from_checkpoint`)."""
    head = LMHead.from_checkpoint(path, mapping=mapping, gather_output=gather_output, dtype=dtype,
                                  vocab_layout=vocab_layout, pad_to=pad_to, process_group=process_group,
                                  deterministic=deterministic, output_dtype=output_dtype, gguf_blocks=gguf_blocks)
    decision = head.quant_decision
    if decision is not None and decision.tied and head.weight_format in TIEABLE:
        return VocabParallelEmbedding.from_head(head), head
    embedding = VocabParallelEmbedding.from_checkpoint(path, mapping=mapping, dtype=dtype, vocab_layout=vocab_layout,
                                                       pad_to=pad_to, process_group=process_group)
    return embedding, head


def resident_bytes(*modules: Any) -> int:
    """Bytes of the distinct storages behind ``modules``' buffers (a tied pair counts once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for buf in module.buffers():
            storage = buf.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
