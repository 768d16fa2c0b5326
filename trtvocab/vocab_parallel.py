"""What the two ends of the vocabulary share: one rank's shard of a ``[V, H]`` matrix.

:class:`~trtvocab.lm_head.LMHead` and :class:`~trtvocab.embedding.VocabParallelEmbedding`
are both a shard of the same matrix, placed by the same mapping rule and the same layout
(:mod:`trtvocab.parallel.sharding`), stored by the same weight formats (:mod:`trtvocab.weights`).
This base class holds that placement once: validation, the split decision, the shard and
the questions asked about it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from trtvocab.base.dtypes import DTYPES
from trtvocab.base.formats import WeightFormat
from trtvocab.errors import AdapterError, ConfigError, RankMismatchError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.added_vocab import AddedVocabShard, added_vocab_shards, sharded_to_full_mapping
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import LAYOUT_FIELD, VocabLayout, VocabPlacement, VocabShard, all_shards
from trtvocab.weights import WeightMethod
from trtvocab.weights.base import normalize_keys
from trtvocab.weights.lora import added_tokens, open_adapter, shard_adapter

# What the ranks agree on once after loading a shard from a checkpoint (trtvocab.parallel.distributed.Handshake).
# "mapping" is there so that a rank built replicated (attention DP without LM-head TP) next to a
# peer built split fails at load on both ranks: a replicated head makes no per-call collective,
# so without it the split peer would wait in its first forward until the collective timeout.
MAPPINGS = ("replicated", "tensor parallel", "attention DP + LM-head TP")
LOAD_HANDSHAKE = D.Handshake("from_checkpoint", (
    D.Field("vocab_size"), D.Field("hidden_size"), D.Field("weight format", WeightFormat),
    D.Field("tp_size"), D.Field("mapping", MAPPINGS), D.Field("head groups"),
))
M = TypeVar("M", bound="VocabParallelModule")


class VocabParallelModule(nn.Module):
    """One rank's shard of a ``[V, H]`` vocabulary matrix (base of the head and the embedding).

    Args:
        vocab_size: V (a positive int; bools are refused).
        hidden_size: H.
        dtype: one of the head dtypes (:data:`trtvocab.base.dtypes.HEAD_DTYPES`).
        mapping: where this rank sits; ``None`` is replicated. The mapping decides whether the
            matrix is split (:attr:`Mapping.lm_head_is_split`).
        vocab_layout: ``"uneven"`` or ``"padded"``; pad_to: the padded layout's multiple.
        process_group: the TP group when ``world_size > tp_size`` (a head group of its own,
            ``Mapping.lm_head_tp_size != tp_size``: made by :func:`trtvocab.parallel.distributed.lm_head_group`
            when not given).

    Subclasses create ``self.weights`` (a :class:`~trtvocab.weights.base.WeightMethod`).
    ``handshake_state`` (:class:`~trtvocab.parallel.distributed.HandshakeState`) keeps the
    cross-rank agreements of the module's calls.
    """

    weights: WeightMethod
    handshake_state: D.HandshakeState

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, mapping: Mapping | None,
                 vocab_layout: VocabLayout, pad_to: int, process_group: Any) -> None:
        super().__init__()
        what = type(self).__name__
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{what} {name} must be a positive int, got {value!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"{what} dtype must be one of {list(DTYPES)}, got {dtype}")
        self.mapping = mapping or Mapping()
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, hidden_size, dtype
        self.pad_to = pad_to
        self.is_split = self.mapping.lm_head_is_split
        # The vocabulary is split over the head's group (Mapping.lm_head_tp_size, default tp_size).
        tp_size = self.mapping.lm_head_tp_size if self.is_split else 1
        tp_rank = self.mapping.lm_head_tp_rank if self.is_split else 0
        if self.is_split and vocab_size < tp_size:
            raise ConfigError(f"{what} vocab_size ({vocab_size}) is smaller than tp_size ({tp_size})")
        if self.is_split and process_group is None and self.mapping.world_size != tp_size:
            if self.mapping.lm_head_tp_size == self.mapping.tp_size or not D.is_initialized():
                raise ConfigError(f"{what}: world_size > tp_size needs the TP process_group "
                                  "(trtvocab.parallel.distributed.new_tp_group)")
            # A head group of its own (lm_head_tp_size != tp_size): made here, once per world.
            process_group = D.lm_head_group(self.mapping)
        self.process_group = process_group
        self.shards: list[VocabShard] = all_shards(vocab_size, tp_size, vocab_layout, pad_to)
        self.shard: VocabShard = self.shards[tp_rank]
        # This rank's place in the split without its runtime parts (group, device, handshake state): what the
        # shard properties below read, so that the shard math has one home (VocabPlacement).
        self._split = VocabPlacement(self.shard, tuple(self.shards), pad_to, self.is_split)
        self.handshake_state = D.HandshakeState()
        # LoRA adapters (trtvocab.weights.lora), this rank's part of each; a row picks one by index.
        self.adapters: list[Any] = []
        # The added segment (adapters that add tokens; trtvocab.parallel.added_vocab): its size A, every
        # rank's (base, added) pieces, and the gathered columns in token order. A = 0: none.
        self.added_vocab = 0
        self.added_shards: list[AddedVocabShard] = added_vocab_shards(vocab_size, 0, self.tp_size, vocab_layout,
                                                                      pad_to)
        self._token_order: torch.Tensor | None = None

    # ---- where this rank's columns are (VocabPlacement's properties) -------------------------------
    @property
    def tp_size(self) -> int:
        """The ranks the vocabulary is split over (1: replicated)."""
        return self._split.tp_size

    @property
    def tp_rank(self) -> int:
        """This rank's shard (0: replicated)."""
        return self._split.tp_rank

    @property
    def vocab_layout(self) -> VocabLayout:
        return self._split.vocab_layout

    @property
    def vocab_start(self) -> int:
        return self._split.vocab_start

    @property
    def vocab_end(self) -> int:
        return self._split.vocab_end

    @property
    def local_vocab_size(self) -> int:
        return self.shard.size

    @property
    def device(self) -> torch.device:
        return next(self.weights.buffers()).device

    @property
    def placement(self) -> VocabPlacement:
        """This rank's :class:`~trtvocab.parallel.sharding.VocabPlacement` (what ``trtvocab.sampling``
        reads): the shards, the process group, the device, and this module's own handshake state
        (shared, so calls with the module or its placement keep one agreement)."""
        return dataclasses.replace(self._split, process_group=self.process_group, device=self.device,
                                   handshake_state=self.handshake_state,
                                   handshake_every_call=bool(getattr(self, "handshake_every_call", False)))

    @property
    def weight_format(self) -> WeightFormat:
        return self.weights.weight_format

    @property
    def layout_code(self) -> int:
        """The layout as one handshake integer: 0 = uneven, else the padded layout's pad_to."""
        return self._split.layout_code

    def handshake_identity(self) -> dict[str, Any]:
        """What this rank's module is, as its handshakes compare it (the one place these values are read):
        the matrix, the split, the dtype, the weight format and the placement. A subclass adds its own
        (``super()`` first), a caller its per-call values; each handshake reads the fields it declares
        (:data:`LOAD_HANDSHAKE`, ``lm_head.FORWARD_HANDSHAKE``, ``embedding.LOOKUP_HANDSHAKE``, and the
        chunked head's argument digest, ``sampling.chunked.STREAM_IDENTITY``)."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "tp_size": self.tp_size,
                LAYOUT_FIELD: self.layout_code, "dtype": self.dtype, "weight format": self.weight_format,
                "mapping": self.mapping_kind, "head groups": self.head_groups}

    def resident_bytes(self) -> int:
        return self.weights.resident_bytes()

    # ---- the added segment (adapters that add tokens) ------------------------------------------------------
    @property
    def added_shard(self) -> VocabShard | None:
        """This rank's piece of the added segment (None: no adapter adds tokens)."""
        return self.added_shards[self.tp_rank].added

    @property
    def full_vocab_size(self) -> int:
        """``vocab_size + added_vocab``: the ids some row may hold (the added ones only with their adapter)."""
        return self.vocab_size + self.added_vocab

    def set_added_vocab(self, added: int) -> None:
        """Give the module an added segment of ``added`` ids ``[V, V + added)``, split over the ranks on
        its own (:mod:`trtvocab.parallel.added_vocab`: the base shards never move). :meth:`load_adapter` does
        this by itself for the first adapter that adds tokens; a later one that adds more needs the larger
        segment set before any adapter that adds tokens is loaded (its rows are split by the segment)."""
        if any(getattr(a, "added", 0) for a in self.adapters) and added != self.added_vocab:
            raise ConfigError(f"{type(self).__name__}.set_added_vocab({added}): adapters that add tokens are loaded "
                              f"with an added segment of {self.added_vocab}; set the largest segment first")
        shards = added_vocab_shards(self.vocab_size, added, self.tp_size, self.vocab_layout, self.pad_to)
        if added and self.is_split and self.mapping.enable_attention_dp:
            raise ConfigError(f"{type(self).__name__}: added tokens with attention DP are not supported")
        self.added_vocab, self.added_shards, self._token_order = added, shards, None

    def token_order(self) -> torch.Tensor:
        """``sharded_to_full_mapping`` of the ranks' pieces (int64, on the module's device): gathered
        two-segment logits ``g [N, sum of widths]`` in token order are ``g[:, order[:V + A]]``."""
        if self._token_order is None or self._token_order.device != self.device:
            self._token_order = torch.tensor(sharded_to_full_mapping(self.added_shards), dtype=torch.int64,
                                             device=self.device)
        return self._token_order

    # ---- LoRA adapters -----------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        """The loaded adapters' names; a row's adapter index is a position in this list."""
        return [a.name for a in self.adapters]

    def adapter_bytes(self) -> int:
        """Bytes this rank holds for its adapters (LoRA rows, copies, trainable tokens)."""
        return sum(a.nbytes() for a in self.adapters)

    def _adapter_target(self) -> str:
        return "head"

    def _adapter_base(self) -> torch.Tensor | None:
        """This rank's dense ``[V_local, H]`` rows (None when quantized): what a saved base_layer is compared with."""
        if self.weight_format is not WeightFormat.DENSE or not self.weights.loaded:
            return None
        return self.weights.weight[: self.shard.size]

    def _check_adapter(self, part: Any) -> None:
        """Refuse an adapter part the module cannot apply (subclasses)."""

    def load_adapter(self, path: Any, *, name: str | None = None, other_modules: str = "refuse",
                     tied: bool | None = None) -> int:
        """Load a PEFT LoRA adapter folder's part for this module and shard; return its index.

        Only this rank's rows are read (:mod:`trtvocab.weights.lora`). An adapter with nothing for this
        module still takes an index (it is the identity here), so the head and the embedding can share one
        numbering. ``other_modules``: see :func:`~trtvocab.weights.lora.open_adapter`; ``tied``: whether the
        head shares the embedding's table (default: what the checkpoint said). Split modules meet once after
        reading, so a rank that refuses the adapter makes every rank raise.
        """
        if getattr(self, "deterministic", False):
            raise ConfigError(f"{type(self).__name__}.load_adapter: adapters on a deterministic head are not supported")
        parts: list[Any] = []
        if tied is None:
            decision = getattr(self, "quant_decision", None)
            tied = bool(decision is not None and decision.tied)

        def build() -> VocabParallelModule:
            adapter = open_adapter(path, name=name, other_modules=other_modules)  # type: ignore[arg-type]
            if adapter.name in self.adapter_names:
                raise AdapterError(f"{path}: an adapter named {adapter.name!r} is loaded already (name= another)")
            added = added_tokens(adapter, self.vocab_size, self.hidden_size, tied=bool(tied))
            previous = self.added_vocab
            if added > self.added_vocab:
                if any(a.added for a in self.adapters):
                    raise AdapterError(f"{path}: adds {added} tokens, more than the added segment of "
                                       f"{self.added_vocab} the loaded adapters were split by (set_added_vocab("
                                       f"{added}) before loading any adapter that adds tokens)")
                self.set_added_vocab(added)
            try:
                part = shard_adapter(adapter, self._adapter_target(), self.shard,  # type: ignore[arg-type]
                                     self.hidden_size, self.dtype, base=self._adapter_base(), tied=bool(tied),
                                     added_shard=self.added_shard)
                self._check_adapter(part)
            except Exception:
                if self.added_vocab != previous:
                    self.set_added_vocab(previous)
                raise
            parts.append(part.to(self.device))
            return self

        before = self.added_vocab
        try:
            load_collectively(build, mapping=self.mapping if self.is_split else None, group=self.process_group,
                              what=f"{type(self).__name__}.load_adapter({path})")
        except Exception:
            if self.added_vocab != before:  # a peer refused the adapter: no segment for it here either
                self.set_added_vocab(before)
            raise
        self.adapters.append(parts[0])
        return len(self.adapters) - 1

    def load_weights(self, tensors: dict[str, Any]) -> None:
        """Load from tensors (or lazy safetensors / GGUF slices) holding all V rows or this shard's rows."""
        self.weights.load(normalize_keys(tensors))
        self.weights.loaded = True

    def _meet(self, handshake: D.Handshake, values: dict[str, Any], error: BaseException | None, field: str,
              noun: str) -> dict[str, Any]:
        """Run ``handshake`` before any data moves; return what the ranks agreed on (``field``: every
        rank's count).

        Without attention DP every rank must bring the same input, so the ``field`` counts must agree.
        """
        D.require_initialized(self.tp_size)
        agreed = handshake.exchange(values, error, self.process_group, self.device, world=self.tp_size)
        self._same_counts(agreed[field], noun)
        return agreed

    def _same_counts(self, counts: list[int], noun: str) -> None:
        if not self.mapping.enable_attention_dp and len(set(counts)) > 1:
            raise RankMismatchError(f"{type(self).__name__}: ranks hold different numbers of {noun} {counts}; "
                                    f"without attention DP every rank must bring the same {noun}")

    @property
    def head_groups(self) -> int:
        """How many groups the world's ranks form for this module's split (``world_size / lm_head_tp_size``; 1 when
        replicated): ranks that agree on the tp size but not on this were built for different arrangements."""
        if not self.is_split:
            return 1
        return self.mapping.world_size // self.mapping.lm_head_tp_size

    @property
    def mapping_kind(self) -> str:
        """One of :data:`MAPPINGS`: how this rank's module is placed, as the handshakes compare it."""
        if not self.is_split:
            return MAPPINGS[0]
        return MAPPINGS[2] if self.mapping.enable_attention_dp else MAPPINGS[1]

    def _placement(self) -> str:
        split = f"tp={self.tp_size} rank={self.tp_rank} [{self.vocab_start}, {self.vocab_end})"
        return (f"vocab={self.vocab_size}, hidden={self.hidden_size}, dtype={self.dtype}, "
                f"format={self.weight_format}, {split if self.is_split else 'replicated'}, layout={self.vocab_layout}")


def meets_peers_at_load(mapping: Mapping | None) -> bool:
    """Whether loading with ``mapping`` meets the TP group once (see :func:`load_collectively`).

    Every rank of a TP group of size > 1 takes part -- split heads and the replicated heads of
    attention DP alike -- so a rank built replicated next to a split peer is caught. A rank given
    no mapping (or tp_size 1) stands alone by definition and meets nobody.
    """
    return mapping is not None and max(mapping.tp_size, mapping.lm_head_tp_size) > 1 and D.is_initialized()


def load_collectively(build: Callable[[], M], *, mapping: Mapping | None, group: Any, what: str) -> M:
    """``build()`` a shard from a checkpoint; meet the TP group once afterwards (when
    :func:`meets_peers_at_load`).

    A rank whose load failed (a truncated file only it reads, a missing shard) raises its own
    error and every peer raises :class:`~trtvocab.errors.PeerRankError` now, instead of the
    peers waiting in the first forward's handshake until the collective timeout; ranks that
    disagree on the vocab, hidden size, format, tp size or placement (replicated vs split)
    raise :class:`~trtvocab.errors.RankMismatchError` on every rank.
    """
    meet = meets_peers_at_load(mapping)
    module: M | None = None
    error: Exception | None = None
    try:
        module = build()
    except Exception as exc:
        if not meet:
            raise
        error = exc
    if meet:
        assert mapping is not None
        # tp_size: the group's size, which a rank built replicated next to split peers reports too.
        values = None if module is None else module.handshake_identity() | {"tp_size": mapping.lm_head_tp_size}
        LOAD_HANDSHAKE.exchange(values, error, group, what=what)
    assert module is not None
    return module
