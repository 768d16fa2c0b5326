"""Run a built artifact: verify it, pick a backend, compute each rank's logits, gather.

::

    read_manifest (checksums, versions)  ->  pick_backend (tensorrt > onnx > torch)
        -> every rank: open_gathered(...).logits(hidden, seq_lens)
             backend.rank_logits                                       [B, V_local] float32
             handshake, the gather of the columns by the gather mode   [B, V] (True, "rank0"), or local (False)

Every backend yields the same per-rank logits (within the tolerance the build recorded);
the gather across ranks is the head's own code (:class:`~trtvocab.backends.gathered.GatheredBackend`:
``trtvocab.parallel.distributed.gather_by_mode``, what ``LMHead.forward`` runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from trtvocab.artifact import store as artifacts
from trtvocab.artifact.manifest import Manifest
from trtvocab.backends import open_backend, pick_backend
from trtvocab.backends.gathered import checked_rank_logits, open_gathered
from trtvocab.base.inputs import check_hidden_states, last_token_rows
from trtvocab.errors import ArtifactError
from trtvocab.lm_head import gather_error
from trtvocab.parallel import distributed as D
from trtvocab.parallel.launch import run_ranks


class InferResult(NamedTuple):
    """What :func:`infer` returns on the rank that holds the answer."""

    logits: torch.Tensor | None  # float32 [B, V] (None on the other ranks under torchrun; gather_output=False:
    # rank 0's own [B, V_local] columns)
    ran_on: str  # what computed them: a Runtime value ("torch", "onnxruntime", "onnx.reference", "tensorrt"),
    # or the distinct values of the ranks, sorted and joined by ", "
    manifest: Manifest


def _infer_rank(rank: int, world: int, root: str, backend: str, hidden: torch.Tensor,
                seq_lens: torch.Tensor | None, gather_output: Any = True,
                gather_chunk_rows: int | None = None) -> tuple[torch.Tensor | None, str] | None:
    """One rank of a split artifact: its columns, the handshake, the gather; rank 0 returns the result."""
    manifest = artifacts.read_manifest(Path(root), verify=False)  # verified once by the caller
    head = open_gathered(backend, Path(root), manifest, rank, gather_output=gather_output,
                         gather_chunk_rows=gather_chunk_rows)
    logits = head.logits(hidden, seq_lens)
    return (logits, ", ".join(sorted(set(head.ran_on)))) if rank == 0 else None


def infer(root: str | Path, hidden: torch.Tensor, seq_lens: torch.Tensor | None = None,
          backend: str = "auto", *, gather_output: bool | str = True,
          gather_chunk_rows: int | None = None) -> InferResult:
    """Gathered float32 logits ``[B, V]`` of every rank of the artifact at ``root``.

    Everything is validated here, before any rank starts: the gather mode, the artifact (checksums,
    versions, all ranks present, manifest consistency), the backend, the hidden states
    (shape, dtype, finite: NaN / inf refused naming the first bad row) and ``seq_lens``.
    Under ``torchrun`` this process is one rank and only rank 0 gets the logits.
    ``gather_output`` / ``gather_chunk_rows``: how a split artifact's columns reach rank 0, as for ``LMHead``
    (:class:`~trtvocab.backends.gathered.GatheredBackend`): ``True`` all-gathers, ``"rank0"`` gathers to
    rank 0 only (the same logits, the other ranks receive nothing), ``gather_chunk_rows=R`` moves R rows a
    collective; ``False`` gathers nothing and returns rank 0's own ``[B, V_local]`` columns.
    """
    error = gather_error(gather_output, gather_chunk_rows, what="infer")
    if error is not None:
        raise error
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
        local = checked_rank_logits(open_backend(chosen, root, manifest, 0), manifest, 0, hidden, seq_lens)
        return InferResult(local.logits, local.ran_on, manifest)
    if D.is_initialized():  # under torchrun: this process is one rank
        if D.group_size() != tp:
            raise ArtifactError(f"{root}: built for tp {tp}, but torchrun started {D.group_size()} processes")
        out = _infer_rank(D.group_rank(), tp, str(root), chosen, hidden, seq_lens, gather_output, gather_chunk_rows)
        return InferResult(None, chosen, manifest) if out is None else InferResult(out[0], out[1], manifest)
    logits, ran_on = run_ranks(_infer_rank, tp, str(root), chosen, hidden, seq_lens, gather_output,
                               gather_chunk_rows)[0]
    return InferResult(logits, ran_on, manifest)
