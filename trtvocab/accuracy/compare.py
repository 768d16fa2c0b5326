"""Quantization accuracy of the LM head: a baseline head against quantized variants.

Every head (baseline, checkpoint variants, in-memory ``simulate`` variants; each a :class:`Variant`
of a :class:`CheckpointHead` or a :class:`MemoryHead`) runs through the real
:class:`~trtvocab.lm_head.LMHead` and :class:`~trtvocab.logits.LogitsProcessor`, replicated or
column-split over ``tp`` gloo ranks, on the same hidden states. The gathered float32 logits are
compared row by row in float64 with the **global** softmax over the full vocabulary
(:class:`LogitMetrics`: top-1 agreement, top-5 overlap, KL mean / p99 / max, logit and
log-prob errors, resident head bytes). Rows: every token by default (``all_tokens``), or each
sequence's last. A ``variant_specs`` entry ``[TOOLCHAIN:]NAME=DIR`` (:func:`parse_variant`) names the
toolchain that made a variant, checked against the checkpoint. Where the hidden file carries
``next_token_ids``, the teacher-forced rows also get the KL-divergence statistics of llama.cpp's
``llama-perplexity`` (:mod:`trtvocab.accuracy.stats`). The metrics: :mod:`trtvocab.accuracy.metrics`;
the report: :mod:`trtvocab.accuracy.report`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trtvocab.accuracy.gates import Gates, check_gates
from trtvocab.accuracy.metrics import LogitMetrics, logit_metrics
from trtvocab.accuracy.plot import plot_report
from trtvocab.accuracy.report import COLUMNS, TEACHER_FORCED_NOTE, CompareReport, VariantResult
from trtvocab.accuracy.stats import DEFAULT_BOOTSTRAP, DEFAULT_SEED, check_bootstrap, llamacpp_stats
from trtvocab.base.dtypes import DTYPES, head_dtype, short_name
from trtvocab.base.family import Family
from trtvocab.base.formats import QUANTIZED_FORMATS, Activation, CheckpointFormat, Granularity
from trtvocab.base.inputs import check_hidden_states
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.checkpoints.families import family_of
from trtvocab.checkpoints.hidden_file import load_hidden_file
from trtvocab.errors import ConfigError, InputError, TrtVocabError
from trtvocab.lm_head import LMHead
from trtvocab.logits import LogitsProcessor
from trtvocab.parallel.launch import run_ranks
from trtvocab.parallel.mapping import Mapping
from trtvocab.quant.config import QuantAlgo, QuantConfig, resolve_lm_head_quant
from trtvocab.quant.quantize import read_head
from trtvocab.quant.writer import quantize_head_tensors
from trtvocab.weights.lora import added_tokens, module_of, open_adapter


# ---- what a compared head is made from --------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointHead:
    """A head every rank loads from a checkpoint (``LMHead.from_checkpoint``: the gating rule sees the
    rank's mapping); ``tensor_name``: the head tensor when not the usual one."""

    path: str
    tensor_name: str | None = None


@dataclass(frozen=True)
class MemoryHead:
    """A head in memory: all ``V`` rows under ``load_weights``' keys, their quantization and ``shape``
    ``(V, H)``; ``family``: what it computes beyond ``x @ W.T`` (the baseline's, for a simulated head)."""

    tensors: dict[str, Any]
    quant_config: QuantConfig | None
    shape: tuple[int, int]
    family: Family | None = None


@dataclass
class Variant:
    """A compared head and what the report says of it: ``name``, ``toolchain`` (whose quantization it
    holds: a :class:`~trtvocab.base.formats.CheckpointFormat`, ``"trtvocab (simulated)"``, ``"lora"``, or
    ``""``: unknown), a ``note`` on how it was made, and ``adapter``: a PEFT LoRA adapter folder the head
    applies to every row (``LMHead.load_adapter``)."""

    name: str
    head: CheckpointHead | MemoryHead
    toolchain: str = ""
    note: str = ""
    adapter: str | None = None

    @property
    def path(self) -> str | None:
        """The checkpoint folder or file, for a checkpoint head."""
        return self.head.path if isinstance(self.head, CheckpointHead) else None


# ---- toolchain-named variants ------------------------------------------------------------------
SIMULATED = "trtvocab (simulated)"
_VARIANT_RE = re.compile(r"^(?:(?P<tool>[A-Za-z][A-Za-z0-9_-]*):)?(?P<name>[A-Za-z0-9][A-Za-z0-9._+-]*)=(?P<path>.+)$")


def checkpoint_toolchain(path: str | Path, tensor_name: str | None = None) -> str:
    """Whose quantized head ``path`` stores: ``"modelopt"``, ``"compressed-tensors"`` or ``"dense"``
    (the gating rule's verdict, from headers and config only)."""
    decision = resolve_lm_head_quant(path, tensor_name=tensor_name)
    return decision.checkpoint_format if decision.stored is not None else CheckpointFormat.DENSE


def parse_variant(text: str) -> Variant:
    """``[TOOLCHAIN:]NAME=DIR`` -> a checkpoint :class:`Variant` named ``TOOLCHAIN:NAME`` (or ``NAME``).

    ``TOOLCHAIN`` (``modelopt`` | ``compressed-tensors``) must be the format ``DIR`` stores its
    quantized head in; without it the toolchain is read from the checkpoint. A ConfigError names
    ``variant_specs`` (:func:`compare`'s argument) otherwise (unknown toolchain, a dense head, the other
    toolchain's checkpoint).
    """
    if not isinstance(text, str):
        raise ConfigError(f"`variant_specs`: expected [TOOLCHAIN:]NAME=DIR, got {type(text).__name__}")
    m = _VARIANT_RE.match(text.strip())
    if m is None:
        raise ConfigError(f"`variant_specs` {text!r:.120}: expected [TOOLCHAIN:]NAME=DIR (TOOLCHAIN one of "
                          f"{', '.join(QUANTIZED_FORMATS)}; NAME letters, digits, '._+-'), e.g. modelopt:NVFP4=nvfp4/")
    tool, name, path = m.group("tool"), m.group("name"), m.group("path")
    if tool is not None and tool.lower() not in QUANTIZED_FORMATS:
        raise ConfigError(f"`variant_specs` {text!r:.120}: unknown toolchain {tool!r}; "
                          f"use one of {', '.join(QUANTIZED_FORMATS)}")
    actual = checkpoint_toolchain(path)
    if actual is CheckpointFormat.DENSE:
        raise ConfigError(f"`variant_specs` {text!r:.120}: {path} stores its head dense (not quantized by "
                          f"{tool or 'any toolchain'}); compare it as a plain VARIANT path")
    if tool is not None and tool.lower() != actual:
        raise ConfigError(f"`variant_specs` {text!r:.120}: {path} is a {actual} checkpoint, not {tool.lower()}")
    label = f"{tool.lower()}:{name}" if tool is not None else name
    return Variant(name=label, head=CheckpointHead(path), toolchain=actual)


def _detected_toolchain(path: str) -> str:
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
        raise ConfigError(f"`simulate`: unknown variant {text!r}; use fp8[-row][-dyn|-w8a8|-w8a16] "
                          "or nvfp4[-mse|-mse-act][-w4a16|-w4a4], comma-separated")
    algo_s, mse, row, act = m.groups()
    algo = QuantAlgo.FP8 if algo_s == "fp8" else QuantAlgo.NVFP4
    if algo is QuantAlgo.FP8 and mse:
        raise ConfigError(f"`simulate` {text!r}: -mse (block-scale search) is for NVFP4 only")
    if algo is QuantAlgo.NVFP4 and (row or act in ("dyn", "w8a8", "w8a16")):
        raise ConfigError(f"`simulate` {text!r}: NVFP4 takes -w4a16 or -w4a4 (its scales are per 16-block)")
    if algo is QuantAlgo.FP8 and act in ("w4a4", "w4a16"):
        raise ConfigError(f"`simulate` {text!r}: FP8 takes -dyn, -w8a8 or -w8a16")
    # Defaults match quantize_checkpoint without calibration rows: FP8 dynamic activations, NVFP4 W4A16.
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
    amax = None
    weights = None
    if spec.activation is Activation.STATIC or spec.scale_search == "mse-act":
        if calib is None:
            raise InputError(f"`simulate` {spec.text}: a static activation scale or an activation-weighted "
                             "scale search needs calibration rows")
        rows = calib.to(weight.dtype).float()
        amax = rows.abs().amax() if spec.activation is Activation.STATIC else None
        weights = rows.double().square().mean(0) if spec.scale_search == "mse-act" else None
    search = "mse" if spec.scale_search == "mse-act" else spec.scale_search
    return quantize_head_tensors(weight, spec.config, input_amax=amax, scale_search=search,
                                 column_weights=weights), ""


def simulate_source(weight: torch.Tensor, spec: SimSpec, calib: torch.Tensor | None, *, family: Any = None,
                    bias: torch.Tensor | None = None) -> Variant:
    """Quantize a dense ``[V, H]`` head in memory (no checkpoint written); ``family`` / ``bias``: the
    baseline's, so the simulated head computes the same ops after its GEMM."""
    tensors, note = simulate_tensors(weight, spec, calib)
    if bias is not None:
        tensors = {**tensors, "lm_head.bias": bias}
    return Variant(name=f"sim:{spec.text}", head=MemoryHead(tensors, spec.config, (int(weight.shape[0]),
                   int(weight.shape[1])), family=family), note=note, toolchain=SIMULATED)


# ---- running heads ---------------------------------------------------------------------------
def build_head(source: Variant, mapping: Any, dtype: torch.dtype) -> Any:
    made = source.head
    if isinstance(made, CheckpointHead):
        return LMHead.from_checkpoint(made.path, mapping=mapping, dtype=dtype, tensor_name=made.tensor_name)
    vocab, hidden = made.shape
    head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping, quant_config=made.quant_config,
                  head_ops=made.family.head if made.family is not None else None)
    head.load_weights(made.tensors)
    return head


def _apply_adapter(head: Any, source: Variant) -> Any:
    """``head`` with ``source.adapter`` loaded (its head part: LoRA, a copy, trainable tokens), or as it is.
    An adapter that adds tokens gives logits over ``V + A`` (token order): :func:`_rank_compare` scores them
    against the baseline's with its added columns at probability 0."""
    if source.adapter is not None:
        head.load_adapter(source.adapter)
    return head


def _widened(base: torch.Tensor, out: torch.Tensor, added: int) -> torch.Tensor:
    """The baseline's ``[N, V]`` logits over a variant's ``V + added`` columns: the added ids at ``-inf``
    (probability 0 under the baseline, which has no such tokens)."""
    if not added or out.shape[1] != base.shape[1] + added:
        return base
    return torch.cat([base, base.new_full((base.shape[0], added), float("-inf"))], dim=1)


def _adapter_ids(source: Variant, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor | None:
    """Adapter 0 for every sequence of a LoRA variant (None otherwise)."""
    if source.adapter is None:
        return None
    return torch.zeros(1 if seq_lens is None else len(seq_lens), dtype=torch.int64)


def parse_lora(text: str, baseline: str | Path, tensor_name: str | None = None) -> Variant:
    """``NAME=DIR`` -> the baseline's head with the PEFT adapter ``DIR`` on every row, named ``lora:NAME``.

    The adapter is read (config and header) here; one that targets modules other than the head and the
    input embedding is refused, and its input-embedding part does not apply (the hidden states are given)."""
    name, sep, folder = str(text).partition("=")
    if not sep or not name or not folder:
        raise ConfigError(f"`loras` {text!r:.120}: expected NAME=DIR (a PEFT adapter folder)")
    adapter = open_adapter(folder, name=name)
    note = "adapter on the head only (the hidden states come from the file)" \
        if module_of(adapter, "embedding") is not None else ""
    ckpt = open_checkpoint(baseline)
    vocab, hidden = (int(d) for d in ckpt.info(ckpt.lm_head_name(tensor_name)[0]).shape)
    added = added_tokens(adapter, vocab, hidden)
    if added:
        note = "; ".join(x for x in (note, f"adds {added} tokens: scored over {vocab} + {added} ids, the "
                                           "baseline giving the added ids probability 0 (KLD(Q || base) is "
                                           "infinite where the variant gives them mass)") if x)
    return Variant(name=f"lora:{name}", head=CheckpointHead(str(baseline), tensor_name), adapter=folder,
                   toolchain="lora", note=note)


def _to_wire(m: LogitMetrics) -> LogitMetrics:
    """Tensors -> numpy for the trip from a rank process (torch's queue would hand back shared-memory
    handles that die with the rank)."""
    return replace(m, kl_per_row=m.kl_per_row.numpy(), logit_err_sample=m.logit_err_sample.numpy())


def _from_wire(m: LogitMetrics) -> LogitMetrics:
    return replace(m, kl_per_row=torch.as_tensor(m.kl_per_row), logit_err_sample=torch.as_tensor(m.logit_err_sample))


def _rank_compare(rank: int, world: int, sources: list[Variant], hidden: torch.Tensor,
                  seq_lens: torch.Tensor | None, all_tokens: bool, dtype: torch.dtype,
                  next_ids: torch.Tensor | None) -> tuple[list[LogitMetrics] | None, list[int], list[str], int]:
    """One rank: run every head on the same rows; rank 0 compares each variant with the baseline
    (``sources[0]``) as soon as its logits are gathered, so only two ``[N, V]`` float32 logit
    tensors exist at a time. Returns (rank 0's metrics, resident bytes, labels, vocab size)."""

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
            # Finite hidden states and weights can still overflow float32 in the product (an adapter's delta,
            # rows of 1e37): one check after it, so that no metric is computed from NaN or +inf (-inf is an
            # added token a row's adapter does not have).
            bad = (torch.isnan(out) | (out == float("inf"))).nonzero()
            if bad.numel():
                row, col = (int(v) for v in bad[0])
                raise InputError(f"{source.name}: logit {float(out[row, col])} at row {row}, token {col} (the hidden "
                                 f"states, max |x| = {float(hidden.float().abs().max()):.3g}, overflow float32 "
                                 "in this head); nothing is scored")
            sizes.append(head.resident_bytes())
            labels.append(head.label)
            added = int(head.added_vocab)
            del head
            if rank != 0:
                continue
            if i == 0:
                base = out
                continue
            assert base is not None
            wide = _widened(base, out, added)  # an adapter that adds tokens: the baseline gives them p = 0
            if out.shape != wide.shape:
                raise InputError(f"{source.name}: logits {list(out.shape)} differ from the baseline's "
                                 f"{list(base.shape)} (different vocabulary?)")
            metrics.append(_to_wire(logit_metrics(wide, out, next_ids=next_ids, shared_vocab=base.shape[1])))
            del out
    vocab = int(base.shape[1]) if base is not None else 0
    return (metrics if rank == 0 else None), sizes, labels, vocab


def compare_heads(sources: list[Variant], hidden: torch.Tensor, seq_lens: torch.Tensor | None, *,
                  tp: int = 1, all_tokens: bool = True, dtype: torch.dtype = torch.float32,
                  next_ids: torch.Tensor | None = None) -> tuple[list[LogitMetrics], list[int], list[str], int]:
    """:class:`LogitMetrics` of ``sources[1:]`` against ``sources[0]``, max resident bytes per rank and
    label of every source, and the vocabulary size. ``next_ids`` align with the compared rows."""
    if tp < 1:
        raise ConfigError(f"`tp` must be >= 1, got {tp}")
    args = (sources, hidden, seq_lens, all_tokens, dtype, next_ids)
    if tp == 1:
        results = [_rank_compare(0, 1, *args)]
    else:
        results = run_ranks(_rank_compare, tp, *args, backend="gloo")
    metrics = results[0][0]
    assert metrics is not None
    sizes = [max(r[1][i] for r in results) for i in range(len(sources))]
    return [_from_wire(m) for m in metrics], sizes, results[0][2], results[0][3]


def resolve_dtype(name: str, baseline: Variant) -> torch.dtype:
    """``auto``: the baseline head's stored dtype (a bf16 model is compared in bf16), else bf16."""
    if name != "auto":
        return head_dtype(name, "`dtype` (or auto)")
    if not isinstance(baseline.head, CheckpointHead):
        return torch.float32
    ckpt = open_checkpoint(baseline.head.path)
    tensor, _ = ckpt.lm_head_name(baseline.head.tensor_name)
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
    heads: list[Variant] | None = None,
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
        raise ConfigError("nothing to compare: give `variants` checkpoints, `variant_specs`, `loras` and/or "
                          "`simulate` specs")
    seen: set[str] = set()
    for src in named:
        if src.name in seen:
            raise ConfigError(f"`variant_specs`: the name {src.name!r} is given twice")
        seen.add(src.name)
    next_ids = _compared_next_ids(next_token_ids, int(hidden.shape[0]), seq_lens, all_tokens)
    base_src = Variant(name=str(baseline), head=CheckpointHead(str(baseline), tensor_name))
    sources = [base_src] + [Variant(name=str(v), head=CheckpointHead(str(v)), toolchain=_detected_toolchain(str(v)))
                            for v in variants] + named
    if specs:
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
                                                                    "(optimistic: give `calib`)")
            sources.append(src)
    sources += list(heads or [])
    dtype_ = resolve_dtype(dtype, base_src)
    if next_ids is not None and next_ids.numel():
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
                   + (" (each sequence's last token has none; compare with `all_tokens`)" if not all_tokens else ""))
    else:
        tf_note = ""
    results = []
    for src, m, size, label in zip(sources[1:], metrics, sizes[1:], labels[1:], strict=True):
        stats = None
        if m.tokens is not None and m.tokens.n:
            stats = llamacpp_stats(m.tokens, bootstrap=bootstrap, seed=seed)
        results.append(VariantResult(name=src.name, label=label, head_bytes_per_rank=size, metrics=m,
                                     note=src.note, llamacpp=stats, toolchain=src.toolchain, path=src.path))
    return CompareReport(baseline=str(baseline), baseline_label=labels[0], baseline_bytes_per_rank=sizes[0],
                         rows=metrics[0].rows, rows_mode="all tokens" if all_tokens else "last tokens", tp=tp,
                         dtype=short_name(dtype_), vocab_size=vocab, variants=results,
                         teacher_forced_rows=tf_rows, teacher_forced_note=tf_note)


def quantize_gate(checkpoint: str | Path, gate: str | Path, gates: Gates, tensor_name: str | None,
                  out: Path) -> Callable[[dict[str, torch.Tensor], QuantConfig], list[str]]:
    """A :func:`~trtvocab.quant.quantize.quantize_checkpoint` ``gate`` from the hidden file ``gate``: compare
    the in-memory quantized head with the source head on its rows (loaded now, so a bad file is refused before
    any quantizing)."""
    data = load_hidden_file(gate)
    if data.next_token_ids is None:
        raise InputError(f"`gate` {gate}: has no next_token_ids (write it with `trtvocab hidden` on a causal LM)")

    def check(tensors: dict[str, torch.Tensor], config: QuantConfig) -> list[str]:
        local = {k.removeprefix("lm_head."): v for k, v in tensors.items()}
        vocab, packed = local["weight"].shape
        hidden_size = packed * 2 if config.quant_algo is QuantAlgo.NVFP4 else packed
        src = Variant(name=f"quantized:{out.name}",
                      head=MemoryHead(local, config, (int(vocab), int(hidden_size))))
        report = compare(checkpoint, [], data.states, data.seq_lens, heads=[src], tensor_name=tensor_name,
                         next_token_ids=data.next_token_ids)
        return check_gates(report, gates)

    return check


__all__ = ["COLUMNS", "CheckpointHead", "CompareReport", "LogitMetrics", "MemoryHead", "SimSpec", "Variant",
           "VariantResult",
           "checkpoint_toolchain", "compare", "compare_heads", "logit_metrics", "parse_sim_spec", "parse_variant",
           "plot_report", "quantize_gate", "simulate_source"]
