"""A built artifact's head on one rank of its group: a backend's columns, gathered as ``LMHead`` gathers them.

A :class:`~trtvocab.backends.base.RankBackend` (tensorrt, onnx, torch) computes one rank's float32
``[B, V_local]`` logits and moves nothing. :class:`GatheredBackend` is that backend plus the head's gather
mode, the same values and the same code as ``LMHead(..., gather_output=..., gather_chunk_rows=...)``:

    ``gather_output``    every rank gets
    ``True``             ``[B, V]`` (one all-gather, or ``gather_chunk_rows`` rows a collective into one output)
    ``False``            its own ``[B, V_local]`` columns
    ``"rank0"``          rank 0 of the group ``[B, V]``, the others None (gathered the same two ways)

validated by ``trtvocab.lm_head.gather_error`` (a ``ConfigError`` naming the choices) and moved by
``trtvocab.parallel.distributed.gather_by_mode`` -- the one home of the gather, which ``LMHead.forward`` runs
too -- after one handshake (:data:`HANDSHAKE`: a rank whose backend failed makes every rank raise; the
ranks agree on the vocab, the rows and the mode, and learn what computed each rank's columns). A replicated
artifact (tp 1, attention DP without LM-head TP) gathers nothing: every mode returns the whole ``[B, V]``.
``trtvocab.pipeline.infer.infer`` runs one per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtvocab.artifact.manifest import Manifest
from trtvocab.backends import open_backend
from trtvocab.backends.base import RankBackend, RankLogits
from trtvocab.base.dtypes import head_dtype
from trtvocab.base.formats import Runtime
from trtvocab.errors import InputError
from trtvocab.lm_head import GATHER_MODES, gather_error
from trtvocab.parallel import distributed as D

# What the ranks of an artifact's head agree on before its gather (protocol: trtvocab.parallel.distributed.Handshake).
HANDSHAKE = D.Handshake("artifact head", (
    D.Field("vocab_size"), D.Field("rows"), D.Field("gather_output", GATHER_MODES), D.Field("gather chunk rows"),
    D.Field("ran_on", tuple(Runtime), per_rank=True),
))


def checked_rank_logits(backend: RankBackend, manifest: Manifest, rank: int, hidden: torch.Tensor,
                        seq_lens: torch.Tensor | None) -> RankLogits:
    """``backend.rank_logits`` of ``hidden`` (cast to the head dtype), refused when a logit is not finite:
    finite hidden states times finite weights can still overflow float32 (rows of 1e37), and no logit
    returned, printed or saved is inf or NaN (docs/threat_model.md)."""
    hidden = hidden.to(head_dtype(manifest.head.dtype))
    local = backend.rank_logits(hidden, seq_lens)
    bad = (~torch.isfinite(local.logits)).nonzero()
    if bad.numel():
        row, col = (int(v) for v in bad[0])
        raise InputError(f"infer: rank {rank}'s logits hold {float(local.logits[row, col])} at output row {row}, "
                         f"column {manifest.entry(rank).start + col} (token id): the hidden states (max |x| = "
                         f"{float(hidden.float().abs().max()):.3g}) overflow float32 in x @ W.T")
    return local


class GatheredBackend:
    """One rank of a built artifact's head: ``backend``'s columns gathered by ``gather_output`` /
    ``gather_chunk_rows`` (the module docstring).

    Args:
        backend: this rank's runner (:func:`trtvocab.backends.open_backend`), or None when opening it failed
            (then pass the error to :meth:`fail`, so that the peers hear of it instead of waiting).
        manifest: the artifact's manifest; ``rank``: this rank's index in its group.
        gather_output: ``True`` | ``False`` | ``"rank0"``; gather_chunk_rows: None, or rows per collective.
        process_group: the artifact's TP group (None: the default group).
    """

    def __init__(self, backend: RankBackend | None, manifest: Manifest, rank: int, *, gather_output: bool | str = True,
                 gather_chunk_rows: int | None = None, process_group: Any = None) -> None:
        error = gather_error(gather_output, gather_chunk_rows, what="artifact head")
        if error is not None:
            raise error
        self.backend, self.manifest, self.rank = backend, manifest, rank
        self.gather_output, self.gather_chunk_rows = gather_output, gather_chunk_rows
        self.process_group = process_group
        self.is_split = manifest.mapping.lm_head_is_split
        self.tp_size = manifest.mapping.tp_size if self.is_split else 1
        self.widths = [e.end - e.start for e in manifest.ranks]
        self.ran_on: list[Runtime] = []  # what computed each rank's columns in the last call

    def _values(self, rows: int, ran_on: Runtime) -> dict[str, Any]:
        return {"vocab_size": self.manifest.head.vocab_size, "rows": rows, "gather_output": self.gather_output,
                "gather chunk rows": self.gather_chunk_rows or 0, "ran_on": ran_on}

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` after telling the group (a rank that failed before :meth:`logits`): the peers,
        inside their :meth:`logits`, raise :class:`~trtvocab.errors.PeerRankError`."""
        if self.is_split:
            HANDSHAKE.exchange(None, error, self.process_group, world=self.tp_size)
        raise error

    def logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The float32 logits of the rows the LogitsProcessor would select from ``hidden [T, H]`` (each
        sequence's last row; all rows for a context-logits artifact), by the gather mode."""
        if not self.is_split:
            assert self.backend is not None, "a replicated artifact's head needs its backend"
            local = checked_rank_logits(self.backend, self.manifest, self.rank, hidden, seq_lens)
            self.ran_on = [local.ran_on]
            return local.logits
        D.require_initialized(self.tp_size)
        error: BaseException | None = None
        local: RankLogits | None = None
        try:
            if self.backend is None:
                raise InputError(f"artifact head: rank {self.rank} has no backend")
            local = checked_rank_logits(self.backend, self.manifest, self.rank, hidden, seq_lens)
        except Exception as exc:  # every rank hears of it in the handshake instead of waiting in the gather
            error = exc
        values = None if local is None else self._values(local.logits.shape[0], local.ran_on)
        device = local.logits.device if local is not None else "cpu"
        out = HANDSHAKE.exchange(values, error, self.process_group, device, world=self.tp_size)
        assert local is not None
        self.ran_on = out["ran_on"]
        return D.gather_by_mode(local.logits, self.widths, self.process_group, gather_output=self.gather_output,
                                chunk_rows=self.gather_chunk_rows)


def open_gathered(name: str, root: Path, manifest: Manifest, rank: int, *, gather_output: bool | str = True,
                  gather_chunk_rows: int | None = None, process_group: Any = None) -> GatheredBackend:
    """:class:`GatheredBackend` of backend ``name`` (canonical, not ``auto``) for ``rank``. The gather mode is
    checked first (a ``ConfigError`` before anything opens). A backend that fails to open raises here after
    telling the group (:meth:`GatheredBackend.fail`): the peers' first :meth:`~GatheredBackend.logits` raises
    :class:`~trtvocab.errors.PeerRankError` instead of waiting for this rank."""
    head = GatheredBackend(None, manifest, rank, gather_output=gather_output, gather_chunk_rows=gather_chunk_rows,
                           process_group=process_group)
    try:
        head.backend = open_backend(name, Path(root), manifest, rank)
    except Exception as exc:
        head.fail(exc)
    return head


__all__ = ["HANDSHAKE", "GatheredBackend", "checked_rank_logits", "open_gathered"]
