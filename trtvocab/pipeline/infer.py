"""Run a built artifact: verify it, pick a backend, compute each rank's logits, gather.

::

    read_manifest (checksums, versions)  ->  pick_backend (tensorrt > onnx > torch)
        -> every rank: open_backend(...).rank_logits(hidden, seq_lens)   [B, V_local] float32
        -> handshake, all-gather of the columns (pad + trim)            [B, V]

Every backend yields the same per-rank logits (within the tolerance the build recorded);
the gather across ranks is the head's own code (:mod:`trtvocab.parallel.distributed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from trtvocab.artifact import store as artifacts
from trtvocab.artifact.manifest import Manifest
from trtvocab.backends import open_backend, pick_backend
from trtvocab.backends.base import RankLogits
from trtvocab.base.dtypes import head_dtype
from trtvocab.base.formats import Runtime
from trtvocab.base.inputs import check_hidden_states, last_token_rows
from trtvocab.errors import ArtifactError, InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.launch import run_ranks

# What the ranks of an inference agree on before the gather (protocol: trtvocab.parallel.distributed.Handshake).
INFER_HANDSHAKE = D.Handshake("infer", (D.Field("vocab_size"), D.Field("rows"),
                                        D.Field("ran_on", tuple(Runtime), per_rank=True)))


class InferResult(NamedTuple):
    """What :func:`infer` returns on the rank that holds the answer."""

    logits: torch.Tensor | None  # float32 [B, V] (None on the other ranks under torchrun)
    ran_on: str  # what computed them: a Runtime value ("torch", "onnxruntime", "onnx.reference", "tensorrt"),
    # or the distinct values of the ranks, sorted and joined by ", "
    manifest: Manifest


def _rank_logits(root: Path, manifest: Manifest, rank: int, backend: str, hidden: torch.Tensor,
                 seq_lens: torch.Tensor | None) -> RankLogits:
    hidden = hidden.to(head_dtype(manifest.head.dtype))
    local = open_backend(backend, root, manifest, rank).rank_logits(hidden, seq_lens)
    # Finite hidden states times finite weights can still overflow float32 (rows of 1e37): one check
    # after the product, so that no logit printed or saved is inf or NaN (docs/threat_model.md).
    bad = (~torch.isfinite(local.logits)).nonzero()
    if bad.numel():
        row, col = (int(v) for v in bad[0])
        raise InputError(f"infer: rank {rank}'s logits hold {float(local.logits[row, col])} at output row {row}, "
                         f"column {manifest.ranks[rank].start + col} (token id): the hidden states (max |x| = "
                         f"{float(hidden.float().abs().max()):.3g}) overflow float32 in x @ W.T")
    return local


def _infer_rank(rank: int, world: int, root: str, backend: str, hidden: torch.Tensor,
                seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, str] | None:
    """One rank of a split artifact: its columns, the handshake, the gather; rank 0 returns the result."""
    manifest = artifacts.read_manifest(Path(root), verify=False)  # verified once by the caller
    error: Exception | None = None
    local = RankLogits(torch.empty(0, 0), Runtime.TORCH)
    try:
        local = _rank_logits(Path(root), manifest, rank, backend, hidden, seq_lens)
    except Exception as exc:  # every rank hears of it in the handshake instead of waiting
        error = exc
    values = {"vocab_size": manifest.head.vocab_size, "rows": local.logits.shape[0], "ran_on": local.ran_on}
    ran_on = INFER_HANDSHAKE.exchange(values, error, None, local.logits.device, world=world)["ran_on"]
    full = D.all_gather_columns(local.logits, [e.end - e.start for e in manifest.ranks], None)
    return (full, ", ".join(sorted(set(ran_on)))) if rank == 0 else None


def infer(root: str | Path, hidden: torch.Tensor, seq_lens: torch.Tensor | None = None,
          backend: str = "auto") -> InferResult:
    """Gathered float32 logits ``[B, V]`` of every rank of the artifact at ``root``.

    Everything is validated here, before any rank starts: the artifact (checksums,
    versions, all ranks present, manifest consistency), the backend, the hidden states
    (shape, dtype, finite: NaN / inf refused naming the first bad row) and ``seq_lens``.
    Under ``torchrun`` this process is one rank and only rank 0 gets the logits.
    """
    root = Path(root)
    manifest = artifacts.read_manifest(root)
    manifest.require_complete(str(root), "inference")
    chosen, _ = pick_backend(manifest, backend)
    check_hidden_states(hidden, hidden_size=manifest.head.hidden_size, finite=True)
    if seq_lens is not None:
        last_token_rows(seq_lens, hidden.shape[0])
    tp = manifest.mapping.tp_size
    if not manifest.mapping.lm_head_is_split:
        # Replicated head (tp 1, or attention DP without LM-head TP): every rank holds all of
        # it and serves its own requests, so one rank computes the answer; nothing to gather.
        if D.is_initialized() and D.group_rank() != 0:
            return InferResult(None, chosen, manifest)
        local = _rank_logits(root, manifest, 0, chosen, hidden, seq_lens)
        return InferResult(local.logits, local.ran_on, manifest)
    if D.is_initialized():  # under torchrun: this process is one rank
        if D.group_size() != tp:
            raise ArtifactError(f"{root}: built for tp {tp}, but torchrun started {D.group_size()} processes")
        out = _infer_rank(D.group_rank(), tp, str(root), chosen, hidden, seq_lens)
        return InferResult(None, chosen, manifest) if out is None else InferResult(out[0], out[1], manifest)
    logits, ran_on = run_ranks(_infer_rank, tp, str(root), chosen, hidden, seq_lens)[0]
    return InferResult(logits, ran_on, manifest)
