"""The LM head: ``hidden [N, H] -> logits [N, V]``, replicated or split over the vocab.

Which of the three shapes a head takes is decided once, from the mapping::

    mapping None / tp_size 1            replicated: every rank holds all V rows
    attention DP, no LM-head TP         replicated: ranks hold different requests
    otherwise (incl. ADP + LM-head TP)  COLUMN: rank r holds vocab_shard(V, tp, r)

A COLUMN head computes its ``[N, V_local]`` columns and, with ``gather_output``,
all-gathers them into ``[N, V]`` (uneven pieces padded to the largest and trimmed).
With attention DP every rank brings its own rows, so the rows are gathered first
and, after the GEMM, each rank takes its own rows back with an all-to-all.

The weight format (dense, FP8, NVFP4) is a strategy object from
:mod:`trtvocab.weights`; the forward below never looks at it. Dense heads return
logits in their dtype; quantized heads return float32 (they accumulate dequantized
values in float32, as their engines do). The LogitsProcessor returns float32 always.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trtvocab import distributed as D
from trtvocab.errors import ConfigError, InputError, RankMismatchError
from trtvocab.mapping import Mapping
from trtvocab.sharding import VocabLayout, VocabShard, all_shards, vocab_shard
from trtvocab.weights import WeightMethod, weight_method_for
from trtvocab.weights.base import normalize_keys

if TYPE_CHECKING:
    from trtvocab.quant.config import QuantConfig

# The head dtypes by the names recipes, manifests and graphs use; the order fixes the
# dtype codes ranks exchange in the handshake.
HEAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_CODES = list(HEAD_DTYPES.values())
_FORMAT_CODES = ["dense", "FP8", "NVFP4"]


class TensorParallelMode(str, enum.Enum):
    COLUMN = "column"  # split over the vocab (output features): the only split an LM head uses
    ROW = "row"


class LMHead(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        mapping: Mapping | None = None,
        tensor_parallel_mode: TensorParallelMode = TensorParallelMode.COLUMN,
        gather_output: bool = True,
        quant_config: QuantConfig | None = None,
        vocab_layout: VocabLayout = "uneven",
        pad_to: int = 64,
        process_group: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"LMHead vocab_size must be a positive int, got {vocab_size!r}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ConfigError(f"LMHead hidden_size must be a positive int, got {hidden_size!r}")
        if dtype not in _DTYPE_CODES:
            raise ConfigError(f"LMHead dtype must be one of {_DTYPE_CODES}, got {dtype}")
        if TensorParallelMode(tensor_parallel_mode) is not TensorParallelMode.COLUMN:
            raise ConfigError("LMHead supports only COLUMN tensor parallelism (split over the vocab)")
        self.mapping = mapping or Mapping()
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, hidden_size, dtype
        self.gather_output = gather_output
        self.quant_config = quant_config
        self.vocab_layout, self.pad_to = vocab_layout, pad_to
        self.is_split = self.mapping.lm_head_is_split
        self.tp_size = self.mapping.tp_size if self.is_split else 1
        self.tp_rank = self.mapping.tp_rank if self.is_split else 0
        if self.is_split and vocab_size < self.tp_size:
            raise ConfigError(f"LMHead vocab_size ({vocab_size}) is smaller than tp_size ({self.tp_size})")
        if self.is_split and process_group is None and self.mapping.world_size != self.mapping.tp_size:
            raise ConfigError(
                "LMHead: world_size > tp_size needs the TP process_group "
                "(trtvocab.distributed.new_tp_group)"
            )
        self.process_group = process_group
        self.quant_decision: Any = None  # set by from_checkpoint: the gating verdict, for reports
        self.shards: list[VocabShard] = all_shards(vocab_size, self.tp_size, vocab_layout, pad_to)
        self.shard: VocabShard = vocab_shard(vocab_size, self.tp_size, self.tp_rank, vocab_layout, pad_to)
        method: type[WeightMethod] = weight_method_for(quant_config)
        self.weights: WeightMethod = method(self.shard, hidden_size, dtype, quant_config)
        if device is not None:
            self.to(device)

    # ---- where this rank's columns are -------------------------------------------------
    @property
    def vocab_start(self) -> int:
        return self.shard.start

    @property
    def vocab_end(self) -> int:
        return self.shard.end

    @property
    def local_vocab_size(self) -> int:
        return self.shard.size

    @property
    def device(self) -> torch.device:
        return next(self.weights.buffers()).device

    @property
    def format_name(self) -> str:
        return self.weights.format_name

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, tensors: dict[str, Any]) -> None:
        """Load from tensors (or safetensors slices) holding all vocab rows or this shard's rows."""
        self.weights.load(normalize_keys(tensors))

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        mapping: Mapping | None = None,
        gather_output: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        quant: str = "auto",
        tensor_name: str | None = None,
        vocab_layout: VocabLayout = "uneven",
        pad_to: int = 64,
        process_group: Any = None,
        weight_only: bool = False,
    ) -> LMHead:
        """Build the head of a checkpoint, reading only this rank's rows (see :mod:`trtvocab.loader`)."""
        from trtvocab.loader import load_lm_head

        return load_lm_head(
            path,
            mapping=mapping,
            gather_output=gather_output,
            dtype=dtype,
            quant=quant,
            tensor_name=tensor_name,
            vocab_layout=vocab_layout,
            pad_to=pad_to,
            process_group=process_group,
            weight_only=weight_only,
        )

    # ---- forward --------------------------------------------------------------------------
    def _check_input(self, hidden: Any) -> InputError | None:
        if not isinstance(hidden, torch.Tensor):
            return InputError(f"hidden_states: expected a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            return InputError(f"hidden_states: expected shape [N, {self.hidden_size}], got {list(hidden.shape)}")
        if hidden.shape[0] == 0 and not self.mapping.enable_attention_dp:
            return InputError("hidden_states: empty batch (N = 0)")
        if hidden.dtype != self.dtype:
            return InputError(f"hidden_states: expected dtype {self.dtype} (the head's), got {hidden.dtype}")
        if hidden.device != self.device:
            return InputError(f"hidden_states: on {hidden.device}, the head is on {self.device}")
        return None

    def _signature(self, rows: int) -> list[int]:
        return [
            self.vocab_size,
            self.hidden_size,
            self.tp_size,
            0 if self.vocab_layout == "uneven" else self.pad_to,
            _DTYPE_CODES.index(self.dtype),
            int(self.gather_output),
            _FORMAT_CODES.index(self.format_name) if self.format_name in _FORMAT_CODES else len(_FORMAT_CODES),
            rows,
        ]

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's ``[N, width]`` logits; padding columns (padded layout) are ``-inf``."""
        logits = self.weights(hidden)
        if self.shard.padding:
            logits[:, self.shard.size :] = float("-inf")
        return logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        error = self._check_input(hidden_states)
        if not self.is_split:
            if error is not None:
                raise error
            return self.weights(hidden_states)[:, : self.shard.size]
        D.require_initialized(self.tp_size)
        rows = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else 0
        table = D.agree(self._signature(rows), error, self.process_group, self.device, what="LMHead")
        if table.shape[0] != self.tp_size:
            # Every rank sees the same table, so every rank raises here, before data moves.
            raise RankMismatchError(f"LMHead: built for tp_size {self.tp_size}, but its process group has "
                                    f"{table.shape[0]} ranks")
        names = ["vocab_size", "hidden_size", "tp_size", "vocab layout (0 = uneven, else pad_to)", "dtype",
                 "gather_output", f"weight format (index into {_FORMAT_CODES})"]
        D.check_same(table, range(len(names)), names, "LMHead")
        row_counts = table[:, -1].tolist()
        adp = self.mapping.enable_attention_dp
        if not adp and len(set(row_counts)) > 1:
            raise RankMismatchError(f"LMHead: ranks hold different numbers of rows {row_counts}; "
                                    "without attention DP every rank must see the same hidden states")
        if adp:
            if sum(row_counts) == 0:
                raise InputError("hidden_states: empty batch on every rank")
            hidden_states = D.all_gather_rows(hidden_states, row_counts, self.process_group)
        # Owned columns only: the padding is trimmed, so it needs no -inf fill here (local_logits
        # fills it for callers that reduce over the full width).
        local = self.weights(hidden_states)[:, : self.shard.size]
        if not self.gather_output:
            # With attention DP this is [sum of all ranks' rows, V_local]: the rows of every
            # rank, this rank's columns (what a distributed sampler needs); rank r's rows are
            # the r-th block of the per-rank row counts.
            return local
        sizes = [s.size for s in self.shards]
        if not adp:
            return D.all_gather_columns(local, sizes, self.process_group)
        blocks = list(torch.split(local, row_counts))
        return D.all_to_all_rows(blocks, row_counts, sizes, self.process_group)

    def raise_collectively(self, error: BaseException) -> None:
        """Raise ``error`` after telling the group, for a caller that failed before ``forward``.

        A split head's ranks meet in a handshake at the start of ``forward``; a rank that
        stops before it must still take part, or its peers wait until the collective
        timeout. Here it does, with ``error`` as its verdict: it raises ``error``, the
        peers (inside their ``forward``) raise :class:`PeerRankError`.
        """
        if self.is_split and D.is_initialized():
            D.agree(self._signature(0), error, self.process_group, self.device, what="LMHead")
        raise error

    def resident_bytes(self) -> int:
        return self.weights.resident_bytes()

    def extra_repr(self) -> str:
        split = f"tp={self.tp_size} rank={self.tp_rank} [{self.vocab_start}, {self.vocab_end})"
        return (f"vocab={self.vocab_size}, hidden={self.hidden_size}, dtype={self.dtype}, "
                f"format={self.format_name}, {split if self.is_split else 'replicated'}, "
                f"layout={self.vocab_layout}, gather_output={self.gather_output}")
