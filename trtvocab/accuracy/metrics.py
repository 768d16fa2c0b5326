"""The metrics ``trtvocab compare`` reports: one variant's logits against the baseline's, row by row.

Every row is compared in float64 with the **global** softmax over the full vocabulary
(:class:`LogitMetrics`: top-1 agreement, top-5 overlap, KL mean / p99 / max, logit and log-prob
errors). Where the rows have next tokens, the teacher-forced per-row numbers
(:class:`~trtvocab.accuracy.stats.TokenRows`) ride along for llama.cpp's statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trtvocab.accuracy.stats import TokenRows, token_rows
from trtvocab.errors import InputError

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
# Variants name their toolchain: the ``variant_specs`` ``modelopt:NVFP4=DIR`` and
# ``compressed-tensors:NVFP4=DIR`` compare the heads two toolchains made of the same model side by
# side; the declared toolchain is checked against the checkpoint (ModelOpt or compressed-tensors,
# checkpoint_toolchain), and every variant's toolchain and resident bytes are reported with it, in
# the table and in each llama.cpp block.
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
                  max_err_samples: int = MAX_ERR_SAMPLES, next_ids: torch.Tensor | None = None,
                  shared_vocab: int | None = None) -> LogitMetrics:
    """Compare two ``[N, V]`` logit tensors (each metric: the section "what compare reports").

    ``next_ids [N]`` (int, -1 = no next token) adds the teacher-forced per-row numbers
    (:class:`~trtvocab.accuracy.stats.TokenRows`) of the rows that have one. ``shared_vocab``: the
    columns both heads have (a variant whose adapter adds tokens, against a baseline whose added columns
    are ``-inf``): the logit errors are measured over those; the distributions over every column.
    """
    _check_logits(base, var)
    n, vocab = base.shape
    shared = vocab if shared_vocab is None else shared_vocab
    if isinstance(shared, bool) or not isinstance(shared, int) or not 1 <= shared <= vocab:
        raise InputError(f"shared_vocab must be an int in [1, {vocab}], got {shared_vocab!r}")
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
    stride = max(1, math.ceil(n * shared / max_err_samples))
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
        delta = v[:, :shared] - b[:, :shared]
        max_err = max(max_err, float(delta.abs().max()))
        flat = delta.reshape(-1).float()
        offset = (-(start * shared)) % stride
        errs.append(flat[offset::stride])
    kl = torch.cat(kls)
    return LogitMetrics(rows=n, top1_agreement=top1 / n, top5_overlap=overlap / n, kl_mean=float(kl.mean()),
                        kl_p99=float(torch.quantile(kl, 0.99)), kl_max=float(kl.max()),
                        max_abs_logit_err=max_err, mean_abs_logprob_err=logprob_err / n,
                        kl_per_row=kl, logit_err_sample=torch.cat(errs),
                        tokens=None if next_ids is None else TokenRows.concat(parts))



__all__ = ["CHUNK_ELEMENTS", "MAX_ERR_SAMPLES", "TOP_K", "LogitMetrics", "logit_metrics"]
