"""The LM head: ``hidden [N, H] -> logits [N, V]``, replicated or split over the vocab.

Which of the three shapes a head takes is decided once, from the mapping::

    mapping None / tp_size 1            replicated: every rank holds all V rows
    attention DP, no LM-head TP         replicated: ranks hold different requests
    otherwise (incl. ADP + LM-head TP)  COLUMN: rank r holds vocab_shard(V, tp, r)

A COLUMN head computes its ``[N, V_local]`` columns and, with ``gather_output``, all-gathers
them into ``[N, V]`` (uneven pieces padded and trimmed); with attention DP the rows of every
rank are gathered first and each rank takes its own rows back with an all-to-all. The weight
format (dense, FP8, NVFP4) is a strategy object from :mod:`trtvocab.weights`; the forward never
looks at it. Dense heads return logits in their dtype, quantized heads float32.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trtvocab.base.dtypes import DTYPES, short_name
from trtvocab.base.family import Family, HeadOps
from trtvocab.base.formats import WeightFormat
from trtvocab.base.inputs import hidden_states_error
from trtvocab.errors import CheckpointError, ConfigError, InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import LAYOUT_FIELD, VocabLayout
from trtvocab.quant.config import HeadQuantDecision, QuantConfig
from trtvocab.quant.gguf_blocks import GGUFConfig
from trtvocab.vocab_parallel import MAPPINGS as _MAPPINGS
from trtvocab.vocab_parallel import VocabParallelModule, load_collectively
from trtvocab.weights import WeightMethod, weight_class
from trtvocab.weights.base import read_rows
from trtvocab.weights.loader import open_head
from trtvocab.weights.lora import adapt_logits_, check_adapter_ids, groups

# gather_output's values: keep the local columns, all-gather them to every rank, gather them to rank 0 only.
GATHER_MODES: tuple[bool | str, ...] = (False, True, "rank0")
# What the ranks of a split head agree on, at the start of every forward (protocol:
# trtvocab.parallel.distributed.Handshake) and once after loading a checkpoint.
FORWARD_HANDSHAKE = D.Handshake("LMHead", (
    D.Field("vocab_size"), D.Field("hidden_size"), D.Field("tp_size"), D.Field(LAYOUT_FIELD),
    D.Field("dtype", DTYPES), D.Field("gather_output", GATHER_MODES), D.Field("gather chunk rows"),
    D.Field("weight format", WeightFormat),
    D.Field("mapping", _MAPPINGS), D.Field("head groups"), D.Field("overlap chunks"), D.Field("deterministic"),
    D.Field("output dtype", DTYPES),
    D.Field("head ops (digest)"), D.Field("adapters (digest)"), D.Field("rows", per_rank=True),
))


def gather_error(gather_output: Any, gather_chunk_rows: Any, mapping: Mapping | None = None,
                 what: str = "LMHead") -> ConfigError | None:
    """Why ``gather_output`` / ``gather_chunk_rows`` cannot configure a head (None: they can); ``what`` names
    the head in the message (an artifact's per-rank head: ``trtvocab.backends.gathered``)."""
    if not any(gather_output is m or (isinstance(m, str) and gather_output == m) for m in GATHER_MODES):
        return ConfigError(f"{what} gather_output must be one of True (all-gather to every rank), False (keep this "
                           f"rank's columns) or 'rank0' (gather to rank 0 only), got {gather_output!r}")
    rows = gather_chunk_rows
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        return ConfigError(f"{what} gather_chunk_rows must be None or an int >= 1 (rows per gather), got {rows!r}")
    if rows is not None and gather_output is False:
        return ConfigError(f"{what} gather_chunk_rows needs gather_output=True or 'rank0' (False gathers nothing)")
    if gather_output == "rank0" and mapping is not None and mapping.enable_attention_dp and mapping.lm_head_is_split:
        return ConfigError(f"{what} gather_output='rank0' with attention DP: every rank's rows return to it by an "
                           "all-to-all; use gather_output=True or False")
    return None


def overlap_error(overlap_chunks: Any) -> ConfigError | None:
    """Why ``overlap_chunks`` cannot configure a head (None: it can)."""
    k = overlap_chunks
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        return ConfigError(f"LMHead overlap_chunks must be None (the measured default), 1 (no overlap) or an int "
                           f">= 2 (column chunks whose all-gathers overlap the next chunk's GEMM), got {k!r}")
    return None


# Where benchmarks/gather_overlap.py measured the overlap faster than GEMM-then-gather in every run (gloo on CPU,
# SmolLM2's and Gemma 3's heads, tp 2-4, B 1-256, four runs): per tp (2, and 3 or more), the windows
# (lo, hi, k) of each rank's [rows, width] logits piece, in bytes, where k chunks paid. Below 12 MiB every k was
# slower (each chunk's collective costs more than it hides), from 64 MiB on it was not faster (the transfer
# threads compete with the GEMM for the same cores); at tp 2 the 24 MiB cell won in two runs and lost in two, so
# its window starts above it. docs/architecture.md, "Overlapping the GEMM with the gather"; the table:
# docs/kernels.md.
OVERLAP_WINDOWS: dict[int, tuple[tuple[int, int, int], ...]] = {
    2: ((28 << 20, 64 << 20, 4),),
    3: ((12 << 20, 20 << 20, 2), (20 << 20, 64 << 20, 4)),
}


def default_overlap_chunks(tp: int, rows: int, hidden: int, width: int, element_size: int = 4) -> int:
    """The column chunks ``overlap_chunks=None`` uses for a call of ``rows`` rows over ``tp`` ranks whose widest
    shard owns ``width`` columns of ``element_size``-byte logits (1: none): the chunk count of the
    :data:`OVERLAP_WINDOWS` window of ``tp`` (3 for any larger tp) that holds the rank's logits piece, else 1.
    ``hidden`` is accepted for rules that weigh the GEMM."""
    if tp < 2:
        return 1
    piece = rows * width * element_size
    return next((k for lo, hi, k in OVERLAP_WINDOWS[min(tp, 3)] if lo <= piece < hi), 1)


DEFAULT_LOGITS_BUDGET_BYTES = 256 << 20  # float32 [B, V_local] logits above this are streamed (sampling.chunked)


class TensorParallelMode(str, enum.Enum):
    """How a linear layer is split: COLUMN over output features (the vocab, for a head), ROW over inputs."""

    COLUMN = "column"  # split over the vocab (output features): the only split an LM head uses
    ROW = "row"


class LMHead(VocabParallelModule):
    """The LM head, ``hidden [N, H] -> logits [N, V]``, replicated or split over the vocab.

    Args:
        vocab_size: V, the number of token ids (columns of the logits).
        hidden_size: H.
        dtype: the head dtype: inputs must arrive in it; dense heads store the weight and
            return logits in it.
        mapping: where this rank sits (:class:`~trtvocab.parallel.mapping.Mapping`); ``None`` is a
            replicated head. Attention DP without ``enable_lm_head_tp_in_adp`` also replicates.
        tensor_parallel_mode: only ``COLUMN`` (split over the vocab) exists for a head.
        gather_output: ``True``: all-gather the ``[N, V_local]`` pieces into ``[N, V]`` on every rank;
            ``False``: return this rank's columns (what the gather-free samplers take); ``"rank0"``:
            gather them to rank 0 of the head's group only (vLLM's ``_gather_logits`` without all-gather):
            that rank gets ``[N, V]``, the others ``None`` (a replicated head: every rank its logits).
            Not with attention DP (there every rank's rows return to it). Anything else: ``ConfigError``.
        gather_chunk_rows: ``None``: one collective moves all N rows; ``R``: R rows at a time into one
            ``[N, V]`` output allocated once (vLLM's ``LogitsGatherer``): besides the output and the local
            logits, a gather holds ``(tp + 1) * R * max shard width`` elements instead of
            ``(tp + 1) * N * max shard width`` (the pieces and the padded send). Bitwise the same logits.
        overlap_chunks: ``gather_output=True`` (unchunked, no attention DP): the local GEMM in ``k`` column
            chunks, chunk ``j``'s all-gather running (``async_op``) while chunk ``j + 1`` is computed; the
            chunks are cut on the weight format's GEMM tiles (:meth:`gemm_tiles`), so the logits are bitwise
            the unchunked path's. ``None`` (default): :func:`default_overlap_chunks`, on only where
            ``benchmarks/gather_overlap.py`` measured it faster; ``1``: off. Ranks agree on it in the handshake.
        quant_config: FP8 / NVFP4 weights (:class:`~trtvocab.quant.config.QuantConfig`),
            normally from the checkpoint's gating verdict (:meth:`from_checkpoint`), or a GGUF
            head's stored blocks (:class:`~trtvocab.quant.gguf_blocks.GGUFConfig`).
        vocab_layout: ``"uneven"`` (``calc_shard``, no padding) or ``"padded"`` (V rounded up to
            a multiple of ``pad_to * tp``); see :mod:`trtvocab.parallel.sharding`.
        pad_to: the padding multiple of the padded layout.
        process_group: the TP group when ``world_size > tp_size``
            (:func:`trtvocab.parallel.distributed.new_tp_group`); ``None`` is the default group.
        device: where the weights live.
        head_ops: what the family's output layer computes after ``x @ W.T``
            (:class:`~trtvocab.base.family.HeadOps`: bias, scale, divisor, soft-capping); default plain.
            ``from_checkpoint`` reads it from the checkpoint (:mod:`trtvocab.checkpoints.families`).

    Differences from TensorRT-LLM's ``LMHead``: its defaults are
    ``tensor_parallel_mode=None, gather_output=False`` (a replicated head, or un-gathered
    columns); here a head given a TP mapping is COLUMN-split and gathered, so that
    ``head(x)`` is ``[N, V]`` in token-id order at every tp size. Quantized heads return
    **float32** logits (they accumulate dequantized values in float32, as their engines
    do); dense heads return their dtype. Dense heads expose ``head.weight`` (read-only,
    this rank's ``[V_local, H]`` rows), as code ported from TensorRT-LLM or vLLM expects.

    Also: ``deterministic=True`` computes every logit with one fixed GEMM shape
    (:mod:`trtvocab.weights.deterministic`): a row's logits are bitwise the same alone or in
    any batch, at every tp size and layout (dense heads). ``output_dtype=torch.float32``
    returns a dense head's float32 accumulation instead of rounding logits to its dtype
    (TensorRT-LLM's ``lm_head_dtype="float32"``, vLLM's ``head_dtype``).
    ``logits_budget_bytes`` (default :data:`DEFAULT_LOGITS_BUDGET_BYTES`, 256 MiB): when a batch's
    float32 ``[B, V_local]`` logits would exceed it, the functions of :mod:`trtvocab.sampling.chunked`
    stream this rank's weight in vocab chunks of at most that size instead of materializing them.
    ``check_finite=False`` skips the NaN / inf scan of the hidden rows (for a caller that validated
    them already); ``handshake_every_call=True`` runs the full cross-rank handshake on every call of a
    split head instead of letting steady calls' verdicts ride on their data collective. Both stay
    settable as attributes. ``quant_decision``: the gating verdict, recorded for reports.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        mapping: Mapping | None = None,
        tensor_parallel_mode: TensorParallelMode = TensorParallelMode.COLUMN,
        gather_output: bool | str = True,
        quant_config: QuantConfig | GGUFConfig | None = None,
        vocab_layout: VocabLayout = "uneven",
        pad_to: int = 64,
        process_group: Any = None,
        device: torch.device | str | None = None,
        deterministic: bool = False,
        output_dtype: torch.dtype | None = None,
        logits_budget_bytes: int | None = None,
        check_finite: bool = True,
        handshake_every_call: bool = False,
        quant_decision: HeadQuantDecision | None = None,
        head_ops: HeadOps | None = None,
        gather_chunk_rows: int | None = None,
        overlap_chunks: int | None = None,
    ) -> None:
        if TensorParallelMode(tensor_parallel_mode) is not TensorParallelMode.COLUMN:
            raise ConfigError("LMHead supports only COLUMN tensor parallelism (split over the vocab)")
        error = gather_error(gather_output, gather_chunk_rows, mapping) or overlap_error(overlap_chunks)
        if error is not None:
            raise error
        super().__init__(vocab_size, hidden_size, dtype=dtype, mapping=mapping, vocab_layout=vocab_layout,
                         pad_to=pad_to, process_group=process_group)
        if output_dtype not in (None, torch.float32, dtype):
            raise ConfigError(f"LMHead output_dtype must be None, torch.float32 or the head dtype {dtype}, "
                              f"got {output_dtype}")
        if deterministic and quant_config is not None and not isinstance(quant_config, GGUFConfig):
            raise ConfigError("LMHead deterministic=True supports dense heads (a quantized head's dynamic "
                              "activation scale depends on the whole batch)")
        budget = logits_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ConfigError(f"LMHead logits_budget_bytes must be None or an int > 0, got {logits_budget_bytes!r}")
        # Above this many bytes of float32 [B, V_local] logits, trtvocab.sampling.chunked streams the
        # weight in vocab chunks instead of materializing them (None: DEFAULT_LOGITS_BUDGET_BYTES).
        self.logits_budget_bytes = DEFAULT_LOGITS_BUDGET_BYTES if logits_budget_bytes is None else logits_budget_bytes
        self.deterministic = bool(deterministic)
        # Quantized heads always accumulate and return float32; dense heads their dtype unless asked.
        self.output_dtype = torch.float32 if quant_config is not None else (output_dtype or dtype)
        self._gather_output: bool | str = gather_output
        self._gather_chunk_rows: int | None = gather_chunk_rows
        self._overlap_chunks: int | None = overlap_chunks
        self.quant_config = quant_config
        # The gating verdict this head was built under (from_checkpoint passes it), for reports.
        self.quant_decision: HeadQuantDecision | None = quant_decision
        # Refuse NaN / inf hidden rows (False: the caller validated its inputs already).
        self.check_finite = bool(check_finite)
        # True: a full handshake on every split call (no Agreement; see trtvocab.parallel.distributed).
        self.handshake_every_call = bool(handshake_every_call)
        self.weights: WeightMethod = weight_class(quant_config)(self.shard, hidden_size, dtype, quant_config)
        if head_ops is not None and not isinstance(head_ops, HeadOps):
            raise ConfigError(f"LMHead head_ops must be a trtvocab.base.family.HeadOps, got {type(head_ops).__name__}")
        self.head_ops: HeadOps = head_ops or HeadOps()
        # The family the head was loaded as (from_checkpoint), for reports; None when built by hand.
        self.family: Family | None = None
        # How from_checkpoint loaded the weight, for reports (a GGUF head's stored or dequantized blocks).
        self.load_note = ""
        # The owned columns' [V_local] bias, float32 (head_ops.bias); loaded with the weight.
        self.register_buffer("bias", torch.zeros(self.shard.size if self.head_ops.bias else 0, dtype=torch.float32))
        # Each row's adapter index for the calls inside use_adapters() (None: no adapter anywhere).
        self.row_adapters: torch.Tensor | None = None
        if device is not None:
            self.to(device)

    @property
    def gather_output(self) -> bool | str:
        """``True`` | ``False`` | ``"rank0"`` (see the class docstring); settable, validated."""
        return self._gather_output

    @gather_output.setter
    def gather_output(self, value: bool | str) -> None:
        error = gather_error(value, self._gather_chunk_rows if value is not False else None, self.mapping)
        if error is not None:
            raise error
        self._gather_output = value

    @property
    def gather_chunk_rows(self) -> int | None:
        """Rows per gather (None: all of them in one); settable, validated."""
        return self._gather_chunk_rows

    @gather_chunk_rows.setter
    def gather_chunk_rows(self, value: int | None) -> None:
        error = gather_error(self._gather_output, value, self.mapping)
        if error is not None:
            raise error
        self._gather_chunk_rows = value

    @property
    def overlap_chunks(self) -> int | None:
        """Column chunks of an all-gathered forward (None: :func:`default_overlap_chunks`; 1: none); settable."""
        return self._overlap_chunks

    @overlap_chunks.setter
    def overlap_chunks(self, value: int | None) -> None:
        error = overlap_error(value)
        if error is not None:
            raise error
        self._overlap_chunks = value

    def overlap_for(self, rows: int) -> int:
        """The column chunks a forward of ``rows`` rows is gathered in (1: one all-gather after the whole GEMM).
        Only a split head's plain all-gather overlaps (``gather_output=True``, no ``gather_chunk_rows``, no
        attention DP, no added tokens); at most one chunk per owned column of the widest shard."""
        if not self.is_split or self.gather_output is not True or self.gather_chunk_rows is not None \
                or self.mapping.enable_attention_dp or self.added_vocab or rows < 1:
            return 1
        width = max(s.size for s in self.shards)
        k = self._overlap_chunks
        if k is None:
            k = default_overlap_chunks(self.tp_size, rows, self.hidden_size, width, self.output_dtype.itemsize)
        return max(1, min(k, width))

    @property
    def label(self) -> str:
        """What reports call this head: ``"FP8 W8A8"``, ``"NVFP4 W4A16"``, ``"dense bf16"``."""
        return self.quant_config.label if self.quant_config is not None else f"dense {short_name(self.dtype)}"

    @property
    def weight(self) -> torch.Tensor:
        """This rank's ``[V_local, H]`` rows of a dense head: a view of its storage (no copy; padding
        rows excluded). There is no setter: weights are replaced through :meth:`load_weights`."""
        if self.weight_format is not WeightFormat.DENSE:
            raise ConfigError(f"LMHead.weight: a {self.weight_format} head stores no dense weight; use "
                              "head.weights.dense_weight() for its dequantized float32 rows")
        return self.weights.weight[: self.shard.size].detach()

    # ---- weights --------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        mapping: Mapping | None = None,
        gather_output: bool | str = True,
        dtype: torch.dtype = torch.bfloat16,
        quant: str = "auto",
        tensor_name: str | None = None,
        vocab_layout: VocabLayout = "uneven",
        pad_to: int = 64,
        process_group: Any = None,
        weight_only: bool = False,
        deterministic: bool = False,
        output_dtype: torch.dtype | None = None,
        gguf_blocks: bool = True,
        gather_chunk_rows: int | None = None,
        overlap_chunks: int | None = None,
    ) -> LMHead:
        """Build this rank's head from a checkpoint, reading only its rows.

        ``quant``: ``"auto"`` applies the gating rule (:func:`~trtvocab.quant.config.resolve_lm_head_quant`),
        ``"none"`` runs dense (a stored-quantized head is dequantized exactly, with a warning);
        ``weight_only``: FP8 W8A16 / NVFP4 W4A16 even where an ``input_scale`` is stored;
        ``tensor_name``: the ``[V, H]`` tensor when it is neither ``lm_head.weight`` nor a
        known tied embedding. ``gguf_blocks``: a GGUF Q8_0 / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q4_K head stays
        in its stored blocks (False: dequantized to float32, then ``dtype``; other block types always are, said in
        ``head.load_note``). Other arguments (``gather_chunk_rows``, ``overlap_chunks`` too): as for :class:`LMHead`.

        When the head is split and a process group exists, the ranks meet once after
        loading (:func:`~trtvocab.vocab_parallel.load_collectively`): a rank that failed (a truncated file only it
        reads, a missing shard file) makes every rank raise now, instead of leaving its
        peers waiting in the first forward's handshake until the collective timeout.
        """
        def build() -> LMHead:
            source = open_head(path, mapping=mapping, tensor_name=tensor_name, quant=quant, weight_only=weight_only,
                               gguf_blocks=gguf_blocks)
            family = source.family
            head = cls(source.vocab_size, source.hidden_size, dtype=dtype, mapping=mapping,
                       gather_output=gather_output, quant_config=source.quant_config, vocab_layout=vocab_layout,
                       pad_to=pad_to, process_group=process_group, deterministic=deterministic,
                       output_dtype=output_dtype, quant_decision=source.decision,
                       head_ops=family.head if family is not None else None, gather_chunk_rows=gather_chunk_rows,
                       overlap_chunks=overlap_chunks)
            head.family = family
            head.load_note = source.note
            head.load_weights(source.shard_tensors(head.shard))
            return head

        return load_collectively(build, mapping=mapping, group=process_group, what=f"LMHead.from_checkpoint({path})")

    def load_weights(self, tensors: dict[str, Any]) -> None:
        """Load the weight (and scales) from tensors or lazy slices holding all V rows or this shard's
        rows; a head with ``head_ops.bias`` also takes its ``[V]`` (or ``[V_local]``) ``bias`` (any
        ``<module>.bias`` key), read shard-only and kept in float32. A bias given to a head without
        ``head_ops.bias`` is refused (it would be dropped)."""
        biases = {k: v for k, v in tensors.items() if k == "bias" or k.endswith(".bias")}
        if len(biases) > 1:
            raise CheckpointError(f"LMHead.load_weights: two bias tensors {sorted(biases)}")
        if biases and not self.head_ops.bias:
            raise CheckpointError(f"LMHead.load_weights: got {next(iter(biases))!r} but the head has no bias "
                                  "(head_ops=HeadOps(bias=True) to apply it)")
        if self.head_ops.bias:
            if not biases:
                raise CheckpointError("LMHead.load_weights: head_ops.bias is set but no 'bias' tensor was given")
            name, value = next(iter(biases.items()))
            rows = read_rows(value, name, self.shard, ())
            if not rows.dtype.is_floating_point or rows.dtype.itemsize < 2 or rows.dtype.is_complex:
                raise CheckpointError(f"{name}: the head's bias must be float16, bfloat16, float32 or float64, got "
                                      f"{rows.dtype} (not converted: an integer bias is not a logit offset)")
            rows = rows.to(torch.float32)
            if not bool(torch.isfinite(rows).all()):
                raise CheckpointError(f"{name}: the head's bias holds NaN or inf")
            self.bias.copy_(rows.to(self.bias.device))
        super().load_weights({k: v for k, v in tensors.items() if k not in biases})

    # ---- forward --------------------------------------------------------------------------
    def check_input(self, hidden: Any) -> InputError | None:
        """Why ``hidden`` cannot go through this head (None: it can). NaN / inf rows are refused
        (they give NaN logits and arbitrary token ids on every rank) unless :attr:`check_finite`
        is False because the caller validated its inputs already. No collective: a caller that
        meets the group afterwards hands the error to its handshake."""
        error = hidden_states_error(hidden, hidden_size=self.hidden_size, dtype=self.dtype, device=self.device,
                                    allow_empty=self.mapping.enable_attention_dp, rows="N",
                                    finite=bool(self.check_finite))
        if error is None and self.row_adapters is not None:
            if self.is_split and self.mapping.enable_attention_dp:
                return InputError("adapter_ids: per-row adapters with attention DP are not supported")
            why = check_adapter_ids(self.row_adapters, hidden.shape[0], len(self.adapters), "adapter_ids")
            error = InputError(why) if why else None
        return error

    @contextmanager
    def use_adapters(self, adapter_ids: torch.Tensor | None) -> Iterator[LMHead]:
        """Inside the block, row ``i`` of every hidden batch the head sees uses adapter ``adapter_ids[i]``
        (an index into :attr:`adapter_names`; ``-1``: none): ``forward``, ``local_logits`` and the
        samplers (``trtvocab.sampling.decode``, :mod:`trtvocab.sampling.chunked`) alike. ``None``: no adapter."""
        previous = self.row_adapters
        # Anything else than a tensor stays as given: check_input refuses it before any collective.
        self.row_adapters = adapter_ids.to(self.device) if isinstance(adapter_ids, torch.Tensor) else adapter_ids
        try:
            yield self
        finally:
            self.row_adapters = previous

    def handshake_identity(self, rows: int = 0) -> dict[str, Any]:
        """This rank's values of :data:`FORWARD_HANDSHAKE` for a forward of ``rows`` rows (the module's, then
        the head's own), and the logits budget the chunked head's handshake adds
        (:meth:`VocabParallelModule.handshake_identity`)."""
        return super().handshake_identity() | {
            "gather_output": self.gather_output, "gather chunk rows": self.gather_chunk_rows or 0,
            "overlap chunks": self.overlap_for(rows), "deterministic": self.deterministic,
            "output dtype": self.output_dtype, "head ops (digest)": self.head_ops.digest(),
            "adapters (digest)": self._adapters_digest(), "logits budget": int(self.logits_budget_bytes),
            "rows": rows}

    def _adapters_digest(self) -> int:
        """The loaded adapters' names and each row's pick (0: none loaded): ranks must agree on both."""
        if not self.adapters:
            return 0
        names = D.tensor_digest(torch.tensor(list("\0".join(self.adapter_names).encode()), dtype=torch.uint8))
        picks = self.row_adapters if isinstance(self.row_adapters, torch.Tensor) else None
        return D.tensor_digest(torch.tensor([names, D.tensor_digest(picks), self.added_vocab]))

    def _owned_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, V_local]`` logits of the owned columns, in :attr:`output_dtype`."""
        return self.column_logits(hidden)

    def column_logits(self, hidden: torch.Tensor, lo: int = 0, hi: int | None = None, *,
                      prepared: Any = None) -> torch.Tensor:
        """Logits ``[N, hi - lo]`` of this shard's owned columns ``[lo, hi)`` (local numbers,
        ``0 <= lo <= hi <= shard.size``; default: all of them), in :attr:`output_dtype`, no collective.

        The GEMM is the weight format's (``weights.gemm``: a dense head's deterministic vocab tiles,
        its float32 accumulation or its own dtype; a quantized format's ``block_logits``). A column
        has the bits of the whole-shard call whenever ``lo`` and ``hi`` are boundaries of the tiles
        the format declares (:meth:`gemm_tiles`), so a caller may stream the shard in chunks.
        ``prepared``: ``self.weights.prepare(hidden)`` made once for several calls (a quantized
        head's activations quantized once for the batch).
        """
        size = self.shard.size
        hi = size if hi is None else hi
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"column_logits: columns [{lo}, {hi}) outside this shard's [0, {size})")
        logits = self._gemm(hidden, lo, hi, prepared)
        ids = self.row_adapters
        if ids is not None and self.adapters:
            if ids.shape[0] != hidden.shape[0]:
                raise InputError(f"adapter_ids: {ids.shape[0]} indices for {hidden.shape[0]} hidden rows")
            # LoRA is part of the GEMM: the family's ops (bias, scale, soft-capping) follow it.
            logits = adapt_logits_(logits, hidden, self.adapters, ids, lo, hi)
        if self.head_ops.is_identity:
            return logits
        return self.head_ops.apply_(logits, self.bias[lo:hi] if self.head_ops.bias else None)

    def _gemm(self, hidden: torch.Tensor, lo: int, hi: int, prepared: Any) -> torch.Tensor:
        """``x @ W.T`` of the owned columns ``[lo, hi)``: the weight format's GEMM (``weights.gemm``)."""
        if hidden.shape[0] == 0:
            return torch.zeros(0, hi - lo, dtype=self.output_dtype, device=hidden.device)
        w = self.weights
        return w.gemm(w.prepare(hidden) if prepared is None else prepared, lo, hi, self.output_dtype,
                      self._tiled)

    @property
    def _tiled(self) -> bool:
        """Whether the format's GEMM runs in deterministic vocab tiles: a dense deterministic head (a
        GGUF head's block chain is tp- and batch-invariant as it is)."""
        return self.deterministic and self.weight_format is WeightFormat.DENSE

    def gemm_tiles(self) -> list[tuple[int, int]]:
        """``[(lo, hi)]``: the local owned columns of every GEMM tile, as the weight format declares
        them (``weights.gemm_tiles``): :meth:`column_logits` over any run of consecutive tiles gives
        bitwise the columns of the whole-shard call."""
        return self.weights.gemm_tiles(self.output_dtype, self._tiled)

    def local_logits(self, hidden: torch.Tensor, adapter_ids: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's ``[N, width]`` logits; padding columns (padded layout) are ``-inf``.
        ``adapter_ids``: as for :meth:`forward`. With an added segment (:attr:`added_vocab` > 0, adapters
        that add tokens) the width is the base piece's then the added piece's (:mod:`trtvocab.parallel.added_vocab`),
        and an added column is ``-inf`` on every row whose adapter does not add that token."""
        if adapter_ids is not None:
            with self.use_adapters(adapter_ids):
                return self.local_logits(hidden)
        owned = self._owned_logits(hidden)
        if not self.shard.padding and not self.added_vocab:
            return owned
        out = owned.new_full((owned.shape[0], self.shard.width), float("-inf"))
        out[:, : self.shard.size] = owned
        if self.added_vocab:
            out = torch.cat([out, self.added_logits(hidden)], dim=1)
        return out

    def added_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, added piece width]`` logits of this rank's piece of the added segment, in :attr:`output_dtype`:
        ``x @ rows.T`` (float32, rounded, then the family's ops) for the added ids a row's adapter holds, ``-inf``
        for the others -- a row without an adapter that adds tokens never samples an added id (per-request
        vocabulary limits: ids outside a row's vocabulary are nobody's)."""
        piece = self.added_shard
        width = piece.width if piece is not None else 0
        out = torch.full((hidden.shape[0], width), float("-inf"), dtype=self.output_dtype, device=hidden.device)
        ids = self.row_adapters
        if ids is None or not width:
            return out
        for k, rows in groups(ids):
            table = self.adapters[k].added_rows
            if table is None or not table.shape[0]:
                continue
            # As column_logits does for a copy: float32 GEMM, rounded to the output dtype, then the family's ops.
            part = (hidden[rows].float() @ table.float().t()).to(out.dtype)
            if not self.head_ops.is_identity:
                part = self.head_ops.apply_(part)
            out[rows, : table.shape[0]] = part
        return out

    def _token_order_columns(self, pieces: torch.Tensor) -> torch.Tensor:
        """Rank pieces laid end to end (``[N, sum of widths]``) -> ``[N, V + A]`` in token order."""
        return pieces[:, self.token_order()[: self.full_vocab_size]]

    def forward(self, hidden_states: torch.Tensor, adapter_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of ``hidden_states [N, H]``; ``adapter_ids`` (int ``[N]``, ``-1``: none): each row's
        adapter (:meth:`load_adapter`), as inside :meth:`use_adapters`. ``gather_output="rank0"``: None
        on every rank of a split head's group but its rank 0."""
        if adapter_ids is not None:
            with self.use_adapters(adapter_ids):
                return self.forward(hidden_states)
        error = self.check_input(hidden_states)
        if not self.is_split:
            if error is not None:
                raise error
            if self.added_vocab:
                return self._token_order_columns(self.local_logits(hidden_states))
            return self._owned_logits(hidden_states)
        rows = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else 0
        adp = self.mapping.enable_attention_dp
        pending = None
        if not self._verdict_rides_on_gather:
            # Attention DP: the handshake is what tells each rank the others' row counts.
            # gather_output=False: no data moves here that a verdict could ride on (a decode
            # step that wants one collective uses trtvocab.sampling.decode instead); "rank0":
            # only rank 0 would read a verdict riding on its gather.
            row_counts = self._meet(FORWARD_HANDSHAKE, self.handshake_identity(rows), error, "rows", "rows")["rows"]
        else:
            pending = self._open_gathered_call(rows, error)
        if adp:
            if sum(row_counts) == 0:
                raise InputError("hidden_states: empty batch on every rank")
            hidden_states = D.all_gather_rows(hidden_states, row_counts, self.process_group)
        if self.added_vocab:  # two segments: every rank's whole width, reindexed to token order
            local = self.local_logits(hidden_states)
            widths = [s.width for s in self.added_shards]
            return self._gather(local, widths, pending, self.token_order()[: self.full_vocab_size])
        chunks = self.overlap_for(rows)
        if chunks > 1:  # column chunks, each one's all-gather behind the next one's GEMM
            return self._overlapped_gather(hidden_states, chunks, pending)
        # Owned columns only: the padding is trimmed, so it needs no -inf fill here (local_logits
        # fills it for callers that reduce over the full width).
        local = self._owned_logits(hidden_states)
        if self.gather_output is False:
            # With attention DP this is [sum of all ranks' rows, V_local]: the rows of every
            # rank, this rank's columns (what a distributed sampler needs); rank r's rows are
            # the r-th block of the per-rank row counts.
            return local
        sizes = [s.size for s in self.shards]
        if not adp:
            return self._gather(local, sizes, pending)
        if self.gather_chunk_rows is not None:
            return D.all_to_all_rows_chunked(local, row_counts, sizes, self.process_group, self.gather_chunk_rows)
        blocks = list(torch.split(local, row_counts))
        return D.all_to_all_rows(blocks, row_counts, sizes, self.process_group)

    def overlap_bounds(self, chunks: int) -> list[tuple[int, int]]:
        """The column chunks ``[(a, b)]`` of an overlapped gather: ``[0, widest owned width)`` in ``chunks``
        near-equal pieces, the same on every rank (the gather's shapes). Each rank computes its columns
        in runs of its format's GEMM tiles (:meth:`gemm_tiles`) reaching past each chunk's end, so its
        logits keep the bits of the whole-shard GEMM whatever the chunks."""
        width = max(s.size for s in self.shards)
        edges = sorted({width * j // chunks for j in range(chunks + 1)})
        return list(itertools.pairwise(edges))

    def _overlapped_gather(self, hidden: torch.Tensor, chunks: int, pending: D.Pending | None) -> torch.Tensor:
        """``[N, V]``: :func:`~trtvocab.parallel.distributed.all_gather_columns_overlapped` of this shard's
        columns, computed in runs of whole GEMM tiles as the chunks ask for them. A run that is exactly one
        chunk is sent as computed; otherwise runs are copied into the chunks' buffers (past this shard's
        owned columns: zero padding, trimmed by the gather)."""
        size = self.shard.size
        n = hidden.shape[0]
        bounds = self.overlap_bounds(chunks)
        ends = [hi for _, hi in self.gemm_tiles()]
        prepared = self.weights.prepare(hidden)
        pieces: dict[int, torch.Tensor] = {}
        done = 0

        def buffer(j: int) -> torch.Tensor:
            if j not in pieces:
                a, b = bounds[j]
                pieces[j] = hidden.new_empty((n, b - a), dtype=self.output_dtype)
                if b > size:
                    pieces[j][:, max(0, size - a):].zero_()
            return pieces[j]

        def produce(a: int, b: int) -> torch.Tensor:
            nonlocal done
            j = bounds.index((a, b))
            need = min(b, size)
            while done < need:
                hi = next(e for e in ends if e >= need)  # whole tiles only: the whole-shard GEMM's bits
                run = self.column_logits(hidden, done, hi, prepared=prepared)
                if (done, hi) == (a, b) and j not in pieces:
                    pieces[j] = run  # the chunk itself: sent as computed
                else:
                    for i, (lo_j, hi_j) in enumerate(bounds):
                        lo, up = max(lo_j, done), min(hi_j, hi)
                        if lo < up:
                            buffer(i)[:, lo - lo_j: up - lo_j] = run[:, lo - done: up - done]
                done = hi
            piece = buffer(j)  # computed above, or all padding (a shard narrower than a)
            del pieces[j]  # sent once: the gather keeps it alive while in flight
            return piece

        return D.all_gather_columns_overlapped(produce, n, [s.size for s in self.shards], bounds,
                                               self.process_group, pending, dtype=self.output_dtype,
                                               device=hidden.device)

    @property
    def _verdict_rides_on_gather(self) -> bool:
        """Whether a split forward's verdict rides on its all-gather (:class:`~trtvocab.parallel.distributed.Agreement`)
        instead of a handshake first: an all-gather to every rank without attention DP."""
        return self.gather_output is True and not self.mapping.enable_attention_dp

    def _gather(self, local: torch.Tensor, widths: list[int], pending: D.Pending | None,
                order: torch.Tensor | None = None) -> torch.Tensor | None:
        """``local``'s pieces of every rank in token order, by this head's gather mode
        (:func:`~trtvocab.parallel.distributed.gather_by_mode`, what an artifact's per-rank head runs too):
        ``local`` itself (``False``), all-gathered (``True``) or gathered to group rank 0 (``"rank0"``: None on
        the other ranks), in chunks of :attr:`gather_chunk_rows` rows into one preallocated output."""
        return D.gather_by_mode(local, widths, self.process_group, pending, gather_output=self.gather_output,
                                chunk_rows=self.gather_chunk_rows, order=order)

    def _open_gathered_call(self, rows: int, error: BaseException | None) -> D.Pending | None:
        """Start a gathered, non-attention-DP forward: the handshake on the first call and after a
        change, otherwise a verdict that rides on the gather (:class:`~trtvocab.parallel.distributed.Agreement`)."""
        D.require_initialized(self.tp_size)
        _, pending = D.open_call(FORWARD_HANDSHAKE, D.agreement_of(self, "LMHead.forward"),
                                 self.handshake_identity(rows), error, self.process_group, self.device,
                                 world=self.tp_size, key=(rows,),
                                 check=lambda out: self._same_counts(out["rows"], "rows"))
        return pending

    def raise_collectively(self, error: BaseException) -> None:
        """Raise ``error`` after telling the group, for a caller that failed before ``forward``.

        A split head's ranks meet in a handshake at the start of ``forward``; a rank that
        stops before it must still take part, or its peers wait until the collective
        timeout. Here it does, with ``error`` as its verdict: it raises ``error``, the
        peers (inside their ``forward``) raise :class:`PeerRankError`.
        """
        if self.is_split and D.is_initialized():
            if not self._verdict_rides_on_gather:
                FORWARD_HANDSHAKE.exchange(None, error, self.process_group, self.device)  # raises error
            else:
                self._open_gathered_call(0, error)  # raises error (after the peers learn of it)
        raise error

    def _check_adapter(self, part: Any) -> None:
        if part.added and self.head_ops.bias:
            raise ConfigError(f"LMHead.load_adapter: {part.name} adds {part.added} tokens to a head with a bias "
                              "(the checkpoint's bias has no entries for them)")

    def extra_repr(self) -> str:
        ops = "" if self.head_ops.is_identity else f", ops={self.head_ops.describe()}"
        added = f", added_vocab={self.added_vocab}" if self.added_vocab else ""
        chunks = f", gather_chunk_rows={self.gather_chunk_rows}" if self.gather_chunk_rows is not None else ""
        chunks += f", overlap_chunks={self.overlap_chunks}" if self.overlap_chunks is not None else ""
        return f"{self._placement()}, gather_output={self.gather_output!r}{chunks}{ops}{added}"
