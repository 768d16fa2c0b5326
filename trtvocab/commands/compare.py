"""Quantization accuracy of the LM head: a baseline head against quantized variants.

Every head (baseline, checkpoint variants, in-memory ``--simulate`` variants; each a
:class:`~trtvocab.weights.loader.HeadSource`) runs through the real
:class:`~trtvocab.lm_head.LMHead` and :class:`~trtvocab.logits.LogitsProcessor`, replicated or
column-split over ``tp`` gloo ranks, on the same hidden states. The gathered float32 logits are
compared row by row in float64 with the **global** softmax over the full vocabulary
(:class:`LogitMetrics`: top-1 agreement, top-5 overlap, KL mean / p99 / max, logit and
log-prob errors, resident head bytes). Rows: every token by default (``all_tokens``), or each
sequence's last. ``--variant [TOOLCHAIN:]NAME=DIR`` (:func:`parse_variant`) names the toolchain
that made a variant, checked against the checkpoint. Where the hidden file carries
``next_token_ids``, the teacher-forced rows also get llama.cpp's ``perplexity --kl-divergence``
statistics (:mod:`trtvocab.accuracy.stats`). The details: the section "what compare reports" below.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from trtvocab.accuracy.stats import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_SEED,
    LlamaCppStats,
    TokenRows,
    check_bootstrap,
    token_rows,
)
from trtvocab.base.dtypes import DTYPES, head_dtype, short_name
from trtvocab.base.formats import Activation, Granularity
from trtvocab.base.inputs import check_hidden_states
from trtvocab.base.units import human_bytes
from trtvocab.errors import ConfigError, InputError
from trtvocab.quant.config import QuantAlgo, QuantConfig
from trtvocab.weights.loader import HeadSource  # what a compared head is made from (re-exported)

# ---- what compare reports -------------------------------------------------------------------------
# =====================  ==============================================================
# top1_agreement         fraction of rows whose argmax token is the baseline's
# top5_overlap           mean ``|top5(base) ∩ top5(var)| / 5``
# kl_mean / p99 / max    ``KL(P_base || P_var)`` per row, nats (p99: linear interpolation)
# max_abs_logit_err      ``max |logit_var - logit_base|`` over all rows and tokens
# mean_abs_logprob_err   mean ``|logp_var - logp_base|`` of the baseline's top token
# head_bytes_per_rank    resident bytes of one rank's head (max over ranks)
# =====================  ==============================================================
#
# Rows: by default every token of the hidden states (``all_tokens``): a KL p99 needs many rows,
# and a context position is as good a probe of the head as a last one. ``all_tokens=False`` keeps
# only each sequence's last token, through the LogitsProcessor and the file's ``seq_lens``: what
# generation actually samples from.
#
# Variants name their toolchain: ``--variant modelopt:NVFP4=DIR --variant compressed-tensors:NVFP4=DIR``
# compares the heads two toolchains made of the same model side by side; the declared toolchain is
# checked against the checkpoint (ModelOpt or compressed-tensors, checkpoint_toolchain), and every
# variant's toolchain and resident bytes are reported with it, in the table and in each llama.cpp block.
#
# Teacher-forced block: the rows with a next token get PPL(Q), PPL(base), KLD, Δp, Same top p, and
# EAR, KL both ways, JS, bootstrap intervals. Only the baseline's and one variant's ``[T, V]``
# float32 logits are held at a time; the float64 work runs in row chunks.


TOP_K = 5
CHUNK_ELEMENTS = 1 << 22  # float64 softmax over [rows, V] runs in chunks of ~32 MiB per temporary
MAX_ERR_SAMPLES = 1_000_000  # logit errors kept per variant for the histogram


# ---- metrics on logits -----------------------------------------------------------------------
@dataclass
class LogitMetrics:
    """One variant against the baseline over the same rows (the metrics of the section "what compare reports")."""

    rows: int
    top1_agreement: float
    top5_overlap: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    max_abs_logit_err: float
    mean_abs_logprob_err: float
    kl_per_row: torch.Tensor = field(repr=False)  # float64 [rows]
    logit_err_sample: torch.Tensor = field(repr=False)  # float32, variant - baseline
    tokens: TokenRows | None = field(default=None, repr=False)  # rows with a next token (teacher-forced)


def _check_logits(base: torch.Tensor, var: torch.Tensor) -> None:
    for name, t in (("baseline", base), ("variant", var)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name} logits: expected a non-empty [N, V] tensor, got {shape}")
    if base.shape != var.shape:
        raise InputError(f"baseline logits {list(base.shape)} and variant logits {list(var.shape)} differ in shape")


def logit_metrics(base: torch.Tensor, var: torch.Tensor, *, k: int = TOP_K, chunk_rows: int | None = None,
                  max_err_samples: int = MAX_ERR_SAMPLES, next_ids: torch.Tensor | None = None) -> LogitMetrics:
    """Compare two ``[N, V]`` logit tensors (each metric: the section "what compare reports").

    ``next_ids [N]`` (int, -1 = no next token) adds the teacher-forced per-row numbers
    (:class:`~trtvocab.accuracy.stats.TokenRows`) of the rows that have one.
    """
    _check_logits(base, var)
    n, vocab = base.shape
    if next_ids is not None:
        next_ids = torch.as_tensor(next_ids).reshape(-1).long()
        if next_ids.shape[0] != n:
            raise InputError(f"next_token_ids: {next_ids.shape[0]} entries for {n} rows of logits")
        if next_ids.numel() and (int(next_ids.min()) < -1 or int(next_ids.max()) >= vocab):
            raise InputError(f"next_token_ids: ids must be in [-1, {vocab}) (the vocabulary), got "
                             f"[{int(next_ids.min())}, {int(next_ids.max())}]")
    parts: list[TokenRows] = []
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    k = min(k, vocab)
    top1 = overlap = logprob_err = 0.0
    max_err = 0.0
    kls: list[torch.Tensor] = []
    errs: list[torch.Tensor] = []
    # Keep a deterministic, evenly spread subsample of the errors for the histogram.
    stride = max(1, math.ceil(n * vocab / max_err_samples))
    for start in range(0, n, chunk_rows):
        b = base[start:start + chunk_rows].double()
        v = var[start:start + chunk_rows].double()
        lb, lv = torch.log_softmax(b, dim=-1), torch.log_softmax(v, dim=-1)
        # KL(P || Q) = sum_i p_i (log p_i - log q_i); terms with p_i = 0 contribute 0.
        pb = lb.exp()
        kls.append(torch.where(pb > 0, pb * (lb - lv), torch.zeros_like(pb)).sum(-1).clamp_min(0.0))
        arg_b, arg_v = b.argmax(-1), v.argmax(-1)
        if next_ids is not None:
            parts.append(token_rows(lb, lv, next_ids[start:start + chunk_rows], arg_b, arg_v))
        top1 += float((arg_b == arg_v).sum())
        tb, tv = b.topk(k, dim=-1).indices, v.topk(k, dim=-1).indices
        overlap += float((tb.unsqueeze(-1) == tv.unsqueeze(-2)).any(-1).sum()) / k
        idx = arg_b.unsqueeze(-1)
        logprob_err += float((lv.gather(-1, idx) - lb.gather(-1, idx)).abs().sum())
        delta = v - b
        max_err = max(max_err, float(delta.abs().max()))
        flat = delta.reshape(-1).float()
        offset = (-(start * vocab)) % stride
        errs.append(flat[offset::stride])
    kl = torch.cat(kls)
    return LogitMetrics(rows=n, top1_agreement=top1 / n, top5_overlap=overlap / n, kl_mean=float(kl.mean()),
                        kl_p99=float(torch.quantile(kl, 0.99)), kl_max=float(kl.max()),
                        max_abs_logit_err=max_err, mean_abs_logprob_err=logprob_err / n,
                        kl_per_row=kl, logit_err_sample=torch.cat(errs),
                        tokens=None if next_ids is None else TokenRows.concat(parts))


# ---- what to run -----------------------------------------------------------------------------
# ---- toolchain-named variants ------------------------------------------------------------------
TOOLCHAINS = ("modelopt", "compressed-tensors")
SIMULATED = "trtvocab (simulated)"
_VARIANT_RE = re.compile(r"^(?:(?P<tool>[A-Za-z][A-Za-z0-9_-]*):)?(?P<name>[A-Za-z0-9][A-Za-z0-9._+-]*)=(?P<path>.+)$")


def checkpoint_toolchain(path: str | Path, tensor_name: str | None = None) -> str:
    """Whose quantized head ``path`` stores: ``"modelopt"``, ``"compressed-tensors"`` or ``"dense"``
    (the gating rule's verdict, from headers and config only)."""
    from trtvocab.quant.config import resolve_lm_head_quant

    decision = resolve_lm_head_quant(path, tensor_name=tensor_name)
    return decision.checkpoint_format if decision.stored is not None else "dense"


def parse_variant(text: str) -> HeadSource:
    """``[TOOLCHAIN:]NAME=DIR`` -> a checkpoint :class:`HeadSource` named ``TOOLCHAIN:NAME`` (or ``NAME``).

    ``TOOLCHAIN`` (``modelopt`` | ``compressed-tensors``) must be the format ``DIR`` stores its
    quantized head in; without it the toolchain is read from the checkpoint. A ConfigError names
    the option otherwise (unknown toolchain, a dense head, the other toolchain's checkpoint).
    """
    if not isinstance(text, str):
        raise ConfigError(f"--variant: expected [TOOLCHAIN:]NAME=DIR, got {type(text).__name__}")
    m = _VARIANT_RE.match(text.strip())
    if m is None:
        raise ConfigError(f"--variant {text!r:.120}: expected [TOOLCHAIN:]NAME=DIR (TOOLCHAIN one of "
                          f"{', '.join(TOOLCHAINS)}; NAME letters, digits, '._+-'), e.g. modelopt:NVFP4=nvfp4/")
    tool, name, path = m.group("tool"), m.group("name"), m.group("path")
    if tool is not None and tool.lower() not in TOOLCHAINS:
        raise ConfigError(f"--variant {text!r:.120}: unknown toolchain {tool!r}; use one of {', '.join(TOOLCHAINS)}")
    actual = checkpoint_toolchain(path)
    if actual == "dense":
        raise ConfigError(f"--variant {text!r:.120}: {path} stores its head dense (not quantized by "
                          f"{tool or 'any toolchain'}); compare it as a plain VARIANT path")
    if tool is not None and tool.lower() != actual:
        raise ConfigError(f"--variant {text!r:.120}: {path} is a {actual} checkpoint, not {tool.lower()}")
    label = f"{tool.lower()}:{name}" if tool is not None else name
    return HeadSource(name=label, path=path, toolchain=actual)


def _detected_toolchain(path: str) -> str:
    from trtvocab.errors import TrtVocabError

    try:
        return checkpoint_toolchain(path)
    except (TrtVocabError, OSError):
        return ""  # the head's own loading reports it


@dataclass(frozen=True)
class SimSpec:
    """``fp8[-row][-dyn|-w8a8|-w8a16]`` or ``nvfp4[-mse|-mse-act][-w4a16|-w4a4]``.

    ``-mse``: block scales by MSE search; ``-mse-act``: the search's squared error weighted
    per column by the calibration activations' mean square.
    """

    text: str
    algo: QuantAlgo
    per_row: bool
    activation: Activation
    scale_search: str = "max"

    @property
    def config(self) -> QuantConfig:
        return QuantConfig(quant_algo=self.algo, activation=self.activation,
                           granularity=Granularity.PER_ROW if self.per_row else Granularity.PER_TENSOR)


_SIM_RE = re.compile(r"^(fp8|nvfp4)(-mse(?:-act)?)?(-row)?(?:-(dyn|w8a8|w8a16|w4a4|w4a16))?$")
_SIM_ACT = {"dyn": Activation.DYNAMIC, "w8a8": Activation.STATIC, "w8a16": Activation.NONE,
            "w4a4": Activation.STATIC, "w4a16": Activation.NONE}


def parse_sim_spec(text: str) -> SimSpec:
    m = _SIM_RE.match(text.strip().lower())
    if m is None:
        raise ConfigError(f"--simulate: unknown variant {text!r}; use fp8[-row][-dyn|-w8a8|-w8a16] "
                          "or nvfp4[-mse|-mse-act][-w4a16|-w4a4], comma-separated")
    algo_s, mse, row, act = m.groups()
    algo = QuantAlgo.FP8 if algo_s == "fp8" else QuantAlgo.NVFP4
    if algo is QuantAlgo.FP8 and mse:
        raise ConfigError(f"--simulate {text!r}: -mse (block-scale search) is for NVFP4 only")
    if algo is QuantAlgo.NVFP4 and (row or act in ("dyn", "w8a8", "w8a16")):
        raise ConfigError(f"--simulate {text!r}: NVFP4 takes -w4a16 or -w4a4 (its scales are per 16-block)")
    if algo is QuantAlgo.FP8 and act in ("w4a4", "w4a16"):
        raise ConfigError(f"--simulate {text!r}: FP8 takes -dyn, -w8a8 or -w8a16")
    # Defaults match `trtvocab quantize` without --calib: FP8 dynamic activations, NVFP4 W4A16.
    activation = _SIM_ACT[act] if act else (Activation.DYNAMIC if algo is QuantAlgo.FP8 else Activation.NONE)
    return SimSpec(text=text.strip().lower(), algo=algo, per_row=bool(row), activation=activation,
                   scale_search=mse[1:] if mse else "max")


def simulate_tensors(weight: torch.Tensor, spec: SimSpec,
                     calib: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], str]:
    """The checkpoint tensors (``weight``, scales) ``spec`` would store, from trtvocab's own numerics.

    ``trtvocab.quant`` is bit-identical to ModelOpt's ``FP8QTensor`` / ``NVFP4QTensor``
    and so to what ``trtvocab quantize`` writes (tested); per-row FP8 stores a ``[V]``
    scale. A static activation scale comes from ``amax(|calib|)`` taken in the weight's
    dtype, as ModelOpt's max calibrator sees the model's activations.
    """
    from trtvocab.quant.writer import quantize_head_tensors

    amax = None
    weights = None
    if spec.activation is Activation.STATIC or spec.scale_search == "mse-act":
        if calib is None:
            raise InputError(f"--simulate {spec.text}: a static activation scale or an activation-weighted "
                             "scale search needs calibration rows")
        rows = calib.to(weight.dtype).float()
        amax = rows.abs().amax() if spec.activation is Activation.STATIC else None
        weights = rows.double().square().mean(0) if spec.scale_search == "mse-act" else None
    search = "mse" if spec.scale_search == "mse-act" else spec.scale_search
    return quantize_head_tensors(weight, spec.config, input_amax=amax, scale_search=search,
                                 column_weights=weights), ""


def simulate_source(weight: torch.Tensor, spec: SimSpec, calib: torch.Tensor | None, *, family: Any = None,
                    bias: torch.Tensor | None = None) -> HeadSource:
    """Quantize a dense ``[V, H]`` head in memory (no checkpoint written); ``family`` / ``bias``: the
    baseline's, so the simulated head computes the same ops after its GEMM."""
    tensors, note = simulate_tensors(weight, spec, calib)
    if bias is not None:
        tensors = {**tensors, "lm_head.bias": bias}
    return HeadSource(name=f"sim:{spec.text}", tensors=tensors, quant_config=spec.config,
                      shape=(int(weight.shape[0]), int(weight.shape[1])), note=note, toolchain=SIMULATED,
                      family=family)


# ---- running heads ---------------------------------------------------------------------------
def build_head(source: HeadSource, mapping: Any, dtype: torch.dtype) -> Any:
    from trtvocab.lm_head import LMHead

    if source.path is not None:
        return LMHead.from_checkpoint(source.path, mapping=mapping, dtype=dtype, tensor_name=source.tensor_name)
    if source.tensors is None or source.shape is None:
        raise ConfigError(f"{source.name}: a HeadSource needs a path or tensors with a shape")
    vocab, hidden = source.shape
    head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping, quant_config=source.quant_config,
                  head_ops=source.family.head if source.family is not None else None)
    head.load_weights(source.tensors)
    return head


def _apply_adapter(head: Any, source: HeadSource) -> Any:
    """``head`` with ``source.adapter`` loaded (its head part: LoRA, a copy, trainable tokens), or as it is."""
    if source.adapter is not None:
        head.load_adapter(source.adapter)
        if head.added_vocab:  # every rank loads the same adapter: all refuse here, before any forward
            raise ConfigError(f"--lora {source.name}: {source.adapter} adds {head.added_vocab} tokens past the "
                              "baseline's vocabulary; compare measures heads over one vocabulary (refused)")
    return head


def _adapter_ids(source: HeadSource, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor | None:
    """Adapter 0 for every sequence of a LoRA variant (None otherwise)."""
    if source.adapter is None:
        return None
    return torch.zeros(1 if seq_lens is None else len(seq_lens), dtype=torch.int64)


def parse_lora(text: str, baseline: str | Path, tensor_name: str | None = None) -> HeadSource:
    """``NAME=DIR`` -> the baseline's head with the PEFT adapter ``DIR`` on every row, named ``lora:NAME``.

    The adapter is read (config and header) here; one that targets modules other than the head and the
    input embedding is refused, and its input-embedding part does not apply (the hidden states are given)."""
    from trtvocab.weights.lora import module_of, open_adapter

    name, sep, folder = str(text).partition("=")
    if not sep or not name or not folder:
        raise ConfigError(f"--lora {text!r:.120}: expected NAME=DIR (a PEFT adapter folder)")
    adapter = open_adapter(folder, name=name)
    note = "adapter on the head only (the hidden states come from the file)" \
        if module_of(adapter, "embedding") is not None else ""
    return HeadSource(name=f"lora:{name}", path=str(baseline), tensor_name=tensor_name, adapter=folder,
                      toolchain="lora", note=note)


def _to_wire(m: LogitMetrics) -> LogitMetrics:
    """Tensors -> numpy for the trip from a rank process (torch's queue would hand back shared-memory
    handles that die with the rank)."""
    return replace(m, kl_per_row=m.kl_per_row.numpy(), logit_err_sample=m.logit_err_sample.numpy())


def _from_wire(m: LogitMetrics) -> LogitMetrics:
    return replace(m, kl_per_row=torch.as_tensor(m.kl_per_row), logit_err_sample=torch.as_tensor(m.logit_err_sample))


def _rank_compare(rank: int, world: int, sources: list[HeadSource], hidden: torch.Tensor,
                  seq_lens: torch.Tensor | None, all_tokens: bool, dtype: torch.dtype,
                  next_ids: torch.Tensor | None) -> tuple[list[LogitMetrics] | None, list[int], list[str], int]:
    """One rank: run every head on the same rows; rank 0 compares each variant with the baseline
    (``sources[0]``) as soon as its logits are gathered, so only two ``[N, V]`` float32 logit
    tensors exist at a time. Returns (rank 0's metrics, resident bytes, labels, vocab size)."""
    from trtvocab.logits import LogitsProcessor
    from trtvocab.parallel.mapping import Mapping

    mapping = None if world == 1 else Mapping(world_size=world, rank=rank, tp_size=world)
    proc = LogitsProcessor()
    metrics: list[LogitMetrics] = []
    sizes: list[int] = []
    labels: list[str] = []
    base: torch.Tensor | None = None
    with torch.no_grad():
        for i, source in enumerate(sources):
            head = _apply_adapter(build_head(source, mapping, dtype), source)
            out = proc(hidden.to(dtype), head, seq_lens, return_context_logits=all_tokens,
                       adapter_ids=_adapter_ids(source, hidden, seq_lens))
            sizes.append(head.resident_bytes())
            labels.append(head.label)
            del head
            if rank != 0:
                continue
            if i == 0:
                base = out
                continue
            assert base is not None
            if out.shape != base.shape:
                raise InputError(f"{source.name}: logits {list(out.shape)} differ from the baseline's "
                                 f"{list(base.shape)} (different vocabulary?)")
            metrics.append(_to_wire(logit_metrics(base, out, next_ids=next_ids)))
            del out
    vocab = int(base.shape[1]) if base is not None else 0
    return (metrics if rank == 0 else None), sizes, labels, vocab


def compare_heads(sources: list[HeadSource], hidden: torch.Tensor, seq_lens: torch.Tensor | None, *,
                  tp: int = 1, all_tokens: bool = True, dtype: torch.dtype = torch.float32,
                  next_ids: torch.Tensor | None = None) -> tuple[list[LogitMetrics], list[int], list[str], int]:
    """:class:`LogitMetrics` of ``sources[1:]`` against ``sources[0]``, max resident bytes per rank and
    label of every source, and the vocabulary size. ``next_ids`` align with the compared rows."""
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    args = (sources, hidden, seq_lens, all_tokens, dtype, next_ids)
    if tp == 1:
        results = [_rank_compare(0, 1, *args)]
    else:
        from trtvocab.parallel.launch import run_ranks

        results = run_ranks(_rank_compare, tp, *args, backend="gloo")
    metrics = results[0][0]
    assert metrics is not None
    sizes = [max(r[1][i] for r in results) for i in range(len(sources))]
    return [_from_wire(m) for m in metrics], sizes, results[0][2], results[0][3]


def _rank_logits(rank: int, world: int, sources: list[HeadSource], hidden: torch.Tensor,
                 seq_lens: torch.Tensor | None, all_tokens: bool,
                 dtype: torch.dtype) -> tuple[list[Any] | None, list[int], list[str]]:
    """One rank: run every head on the same rows; rank 0 returns the gathered logits (as numpy)."""
    from trtvocab.logits import LogitsProcessor
    from trtvocab.parallel.mapping import Mapping

    mapping = None if world == 1 else Mapping(world_size=world, rank=rank, tp_size=world)
    proc = LogitsProcessor()
    logits: list[Any] = []
    sizes: list[int] = []
    labels: list[str] = []
    with torch.no_grad():
        for source in sources:
            head = _apply_adapter(build_head(source, mapping, dtype), source)
            out = proc(hidden.to(dtype), head, seq_lens, return_context_logits=all_tokens,
                       adapter_ids=_adapter_ids(source, hidden, seq_lens))
            if rank == 0:
                logits.append(out.numpy())
            sizes.append(head.resident_bytes())
            labels.append(head.label)
            del head
    return (logits if rank == 0 else None), sizes, labels


def run_heads(sources: list[HeadSource], hidden: torch.Tensor, seq_lens: torch.Tensor | None, *,
              tp: int = 1, all_tokens: bool = True,
              dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[int], list[str]]:
    """Gathered float32 logits of every source (all held at once), max resident bytes per rank and labels.

    :func:`compare` uses :func:`compare_heads` instead, which holds two sources' logits at a time.
    """
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        results = [_rank_logits(0, 1, sources, hidden, seq_lens, all_tokens, dtype)]
    else:
        from trtvocab.parallel.launch import run_ranks

        results = run_ranks(_rank_logits, tp, sources, hidden, seq_lens, all_tokens, dtype, backend="gloo")
    arrays = results[0][0]
    assert arrays is not None
    logits = [torch.from_numpy(a) for a in arrays]
    sizes = [max(r[1][i] for r in results) for i in range(len(sources))]
    return logits, sizes, results[0][2]


# ---- the report ------------------------------------------------------------------------------
@dataclass
class VariantResult:
    """A compared head: its name, label, resident bytes per rank, :class:`LogitMetrics` and, where the
    rows have next tokens, its llama.cpp statistics (:class:`~trtvocab.accuracy.stats.LlamaCppStats`)."""

    name: str
    label: str
    head_bytes_per_rank: int
    metrics: LogitMetrics
    note: str = ""
    llamacpp: LlamaCppStats | None = None
    toolchain: str = ""
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {"name": self.name, "label": self.label, "toolchain": self.toolchain, "path": self.path,
                "rows": m.rows, "top1_agreement": m.top1_agreement,
                "top5_overlap": m.top5_overlap, "kl_mean": m.kl_mean, "kl_p99": m.kl_p99, "kl_max": m.kl_max,
                "max_abs_logit_err": m.max_abs_logit_err, "mean_abs_logprob_err": m.mean_abs_logprob_err,
                "head_bytes_per_rank": self.head_bytes_per_rank, "note": self.note,
                "llamacpp": None if self.llamacpp is None else self.llamacpp.as_dict()}


TEACHER_FORCED_NOTE = ("teacher-forced statistics left out: the hidden file has no next_token_ids "
                       "(write it with `trtvocab hidden` on a causal LM)")


@dataclass
class CompareReport:
    """Everything ``trtvocab compare`` prints: the baseline, the rows compared and each variant."""

    baseline: str
    baseline_label: str
    baseline_bytes_per_rank: int
    rows: int
    rows_mode: str  # "all tokens" | "last tokens"
    tp: int
    dtype: str
    vocab_size: int
    variants: list[VariantResult]
    teacher_forced_rows: int = 0  # rows with a next token (0: no llama.cpp block)
    teacher_forced_note: str = ""  # why there is no llama.cpp block

    def as_dict(self) -> dict[str, Any]:
        return {"baseline": {"name": self.baseline, "label": self.baseline_label,
                             "head_bytes_per_rank": self.baseline_bytes_per_rank},
                "rows": self.rows, "rows_mode": self.rows_mode, "tp": self.tp, "dtype": self.dtype,
                "vocab_size": self.vocab_size, "kl": "KL(baseline || variant), nats, global softmax in float64",
                "teacher_forced_rows": self.teacher_forced_rows,
                "llamacpp": ("llama.cpp perplexity --kl-divergence statistics of the rows with a next token, "
                             "full vocabulary in float64; probabilities as fractions; *_pm = llama.cpp's ±; "
                             "ci95 = bootstrap 95% interval"),
                "teacher_forced_note": self.teacher_forced_note,
                "variants": [v.as_dict() for v in self.variants]}

    def rich_table(self, title: str | None = None) -> Any:
        """The report as a ``rich`` table (title: :meth:`title` by default); every cell escaped, so names
        and paths print as themselves."""
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=escape(self.title() if title is None else title))
        for i, col in enumerate(COLUMNS):
            table.add_column(escape(col), justify="left" if i < 2 else "right")
        for row in self.table_rows():
            table.add_row(*(escape(str(cell)) for cell in row))
        return table

    def table_rows(self) -> list[list[str]]:
        """Rows for a text table (rich or markdown), baseline first."""
        out = [[self.baseline_label, _short(self.baseline), "—", "—", "—", "—", "—", "—", "—",
                human_bytes(self.baseline_bytes_per_rank, digits=2)]]
        for v in self.variants:
            m = v.metrics
            out.append([v.label, _short(v.name), f"{m.top1_agreement:.2%}", f"{m.top5_overlap:.3f}",
                        f"{m.kl_mean:.2e}", f"{m.kl_p99:.2e}", f"{m.kl_max:.2e}", f"{m.max_abs_logit_err:.3f}",
                        f"{m.mean_abs_logprob_err:.2e}", human_bytes(v.head_bytes_per_rank, digits=2)])
        return out

    def title(self) -> str:
        return (f"{self.rows} rows ({self.rows_mode}), V={self.vocab_size:,}, tp={self.tp}, head dtype {self.dtype}; "
                "KL(baseline || variant) in nats")

    def llamacpp_named(self) -> list[tuple[str, LlamaCppStats]]:
        """``(name, stats)`` per variant with a llama.cpp block; the name carries the variant's toolchain
        (where its name does not already) and its resident head bytes."""
        per = " / rank" if self.tp > 1 else ""
        out = []
        for v in self.variants:
            if v.llamacpp is None:
                continue
            short = _short(v.name)
            parts = [short] + ([v.toolchain] if v.toolchain and not short.startswith(v.toolchain + ":") else [])
            parts.append(human_bytes(v.head_bytes_per_rank, digits=2) + per)
            out.append((f"{v.label} ({', '.join(parts)})", v.llamacpp))
        return out

    def llamacpp_text(self) -> str:
        """Every variant's llama.cpp block, as ``llama-perplexity --kl-divergence`` prints it."""
        from trtvocab.accuracy.stats import format_block

        parts = []
        for name, stats in self.llamacpp_named():
            parts.append(f"###### {name} vs {self.baseline_label} ({_short(self.baseline)}): {stats.n} "
                         "teacher-forced rows ######\n" + format_block(stats))
        return "\n".join(parts)

    def to_markdown(self) -> str:
        lines = [f"_{self.title()}_", "", "| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |",
                 "|" + "|".join(["---"] * 2 + ["---:"] * (len(COLUMNS) - 2)) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.table_rows()]
        text = "\n".join(lines) + "\n"
        named = self.llamacpp_named()
        if named:
            from trtvocab.accuracy.stats import markdown_table

            text += (f"\n_llama.cpp statistics vs {self.baseline_label}, {self.teacher_forced_rows} teacher-forced "
                     "rows (full vocabulary, float64); ± = standard error, [ ] = bootstrap 95% interval_\n\n"
                     + markdown_table(named))
        return text


COLUMNS = ["format", "head", "top-1 agree", "top-5 overlap", "KL mean", "KL p99", "KL max", "max |Δlogit|",
           "mean |Δlogp| top-1", "bytes / rank"]


def _short(name: str) -> str:
    return name if name.startswith(("sim:", "quantized:")) else Path(name).name or name


def resolve_dtype(name: str, baseline: HeadSource) -> torch.dtype:
    """``auto``: the baseline head's stored dtype (a bf16 model is compared in bf16), else bf16."""
    if name != "auto":
        return head_dtype(name, "--dtype (or auto)")
    if baseline.path is None:
        return torch.float32
    from trtvocab.checkpoints.checkpoint import open_checkpoint

    ckpt = open_checkpoint(baseline.path)
    tensor, _ = ckpt.lm_head_name(baseline.tensor_name)
    stored = ckpt.info(tensor).torch_dtype
    return stored if stored in DTYPES else torch.bfloat16


def _compared_next_ids(next_token_ids: torch.Tensor | None, rows: int, seq_lens: torch.Tensor | None,
                       all_tokens: bool) -> torch.Tensor | None:
    """The next token of each compared row (all rows, or each sequence's last), or None."""
    if next_token_ids is None:
        return None
    ids = torch.as_tensor(next_token_ids)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise InputError(f"next_token_ids: expected a 1-D integer tensor [T], got {ids.dtype} {list(ids.shape)}")
    if ids.shape[0] != rows:
        raise InputError(f"next_token_ids: {ids.shape[0]} entries for {rows} rows of hidden_states")
    ids = ids.long()
    if all_tokens:
        return ids
    assert seq_lens is not None
    ends = torch.cumsum(torch.as_tensor(seq_lens).long(), 0) - 1
    if ends.numel() and int(ends[-1]) != rows - 1:
        return None  # the LogitsProcessor refuses such seq_lens with its own error
    return ids[ends]


def compare(
    baseline: str | Path,
    variants: list[str | Path] | None = None,
    hidden: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    simulate: list[str] | None = None,
    calib: torch.Tensor | None = None,
    tp: int = 1,
    all_tokens: bool = True,
    dtype: str = "auto",
    tensor_name: str | None = None,
    next_token_ids: torch.Tensor | None = None,
    heads: list[HeadSource] | None = None,
    bootstrap: int = DEFAULT_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    variant_specs: list[str] | None = None,
    loras: list[str] | None = None,
) -> CompareReport:
    """Compare checkpoint ``variants``, ``simulate`` specs and in-memory ``heads`` against ``baseline``.

    ``simulate`` static variants (``fp8-w8a8``, ``nvfp4-w4a4``) take their activation
    scale from ``calib`` or, without it, from ``hidden`` itself (optimistic, and noted).
    ``next_token_ids [T]`` (-1 = none) adds llama.cpp's teacher-forced statistics of the
    compared rows that have a next token (``bootstrap`` resamples, ``seed``).
    ``variant_specs`` are ``[TOOLCHAIN:]NAME=DIR`` (:func:`parse_variant`), checked before any head runs;
    ``loras`` are ``NAME=DIR``: the baseline's head with a PEFT LoRA adapter (:func:`parse_lora`).
    """
    if hidden is None:
        raise InputError("compare needs hidden_states [T, H]")
    check_hidden_states(hidden)
    if not all_tokens and seq_lens is None:
        raise InputError("last-token comparison needs seq_lens (in the hidden-states file); or compare all tokens")
    check_bootstrap(bootstrap, seed)
    variants = list(variants or [])
    named = [parse_variant(v) for v in (variant_specs or [])] + [parse_lora(x, baseline, tensor_name)
                                                                  for x in (loras or [])]
    specs = [parse_sim_spec(s) for s in (simulate or [])]
    if not variants and not named and not specs and not heads:
        raise ConfigError("nothing to compare: give VARIANT checkpoints, --variant, --lora and/or --simulate specs")
    seen: set[str] = set()
    for src in named:
        if src.name in seen:
            raise ConfigError(f"--variant: the name {src.name!r} is given twice")
        seen.add(src.name)
    next_ids = _compared_next_ids(next_token_ids, int(hidden.shape[0]), seq_lens, all_tokens)
    base_src = HeadSource(name=str(baseline), path=str(baseline), tensor_name=tensor_name)
    sources = [base_src] + [HeadSource(name=str(v), path=str(v), toolchain=_detected_toolchain(str(v)))
                            for v in variants] + named
    if specs:
        from trtvocab.checkpoints.checkpoint import open_checkpoint
        from trtvocab.checkpoints.families import family_of
        from trtvocab.commands.quantize import read_head

        base_ckpt = open_checkpoint(baseline)
        name, _, weight = read_head(base_ckpt, tensor_name)
        family = family_of(base_ckpt, head_tensor=name, hidden_size=int(weight.shape[1]), need_embedding=False)
        bias = base_ckpt.read(family.bias_tensor).float() if family is not None and family.bias_tensor else None
        for spec in specs:
            src = simulate_source(weight, spec, calib if calib is not None else hidden, family=family, bias=bias)
            if spec.activation is Activation.STATIC and calib is None:
                src.note = (src.note + "; " if src.note else "") + "input_scale calibrated on the compared rows"
            if spec.scale_search == "mse-act" and calib is None:
                src.note = (src.note + "; " if src.note else "") + ("scale search weighted by the compared rows "
                                                                    "(optimistic: give --calib)")
            sources.append(src)
    sources += list(heads or [])
    dtype_ = resolve_dtype(dtype, base_src)
    if next_ids is not None and next_ids.numel():
        from trtvocab.checkpoints.checkpoint import open_checkpoint

        ckpt = open_checkpoint(baseline)
        vocab = int(ckpt.info(ckpt.lm_head_name(tensor_name)[0]).shape[0])
        if int(next_ids.max()) >= vocab or int(next_ids.min()) < -1:
            raise InputError(f"next_token_ids: ids must be in [-1, {vocab}) (the baseline's vocabulary), got "
                             f"[{int(next_ids.min())}, {int(next_ids.max())}]")
    metrics, sizes, labels, vocab = compare_heads(sources, hidden, seq_lens, tp=tp, all_tokens=all_tokens,
                                                  dtype=dtype_, next_ids=next_ids)
    tf_rows = int((next_ids >= 0).sum()) if next_ids is not None else 0
    if next_token_ids is None:
        tf_note = TEACHER_FORCED_NOTE
    elif tf_rows == 0:
        tf_note = ("teacher-forced statistics left out: no compared row has a next token"
                   + (" (each sequence's last token has none; compare --all-tokens)" if not all_tokens else ""))
    else:
        tf_note = ""
    results = []
    for src, m, size, label in zip(sources[1:], metrics, sizes[1:], labels[1:], strict=True):
        stats = None
        if m.tokens is not None and m.tokens.n:
            from trtvocab.accuracy.stats import llamacpp_stats

            stats = llamacpp_stats(m.tokens, bootstrap=bootstrap, seed=seed)
        results.append(VariantResult(name=src.name, label=label, head_bytes_per_rank=size, metrics=m,
                                     note=src.note, llamacpp=stats, toolchain=src.toolchain, path=src.path))
    return CompareReport(baseline=str(baseline), baseline_label=labels[0], baseline_bytes_per_rank=sizes[0],
                         rows=metrics[0].rows, rows_mode="all tokens" if all_tokens else "last tokens", tp=tp,
                         dtype=short_name(dtype_), vocab_size=vocab, variants=results,
                         teacher_forced_rows=tf_rows, teacher_forced_note=tf_note)


def plot_report(report: CompareReport, path: str | Path) -> Path:
    """The report as a PNG: :func:`trtvocab.accuracy.plot.plot_report`."""
    from trtvocab.accuracy.plot import plot_report as _plot

    return _plot(report, path)


__all__ = ["COLUMNS", "TOOLCHAINS", "CompareReport", "HeadSource", "LogitMetrics", "SimSpec", "VariantResult",
           "checkpoint_toolchain", "compare", "compare_heads", "logit_metrics", "parse_sim_spec", "parse_variant",
           "plot_report", "run_heads", "simulate_source"]
