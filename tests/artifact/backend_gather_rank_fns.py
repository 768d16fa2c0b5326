"""Rank functions of tests/artifact/test_backend_gather.py: an artifact's per-rank heads
(:class:`~trtvocab.backends.gathered.GatheredBackend`) in every gather mode against ``LMHead`` at the same tp,
run from the same saved shards.

Spawned ranks unpickle these by module name, as for ``tests.parallel.rank_fns``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.parallel.rank_fns import catch
from trtvocab import LogitsProcessor
from trtvocab.artifact import store as artifacts
from trtvocab.backends.gathered import open_gathered
from trtvocab.backends.torch import head_from_artifact

MODES = [(True, None), (True, 1), (True, 3), ("rank0", None), ("rank0", 2), ("rank0", 100), (False, None)]


def _bits(t: torch.Tensor | None) -> Any:
    return None if t is None else (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).clone())


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def backend_gather_cases(rank: int, world: int, root: str, hidden: torch.Tensor, seq_lens: torch.Tensor,
                         backends: list[str]) -> dict[str, Any]:
    """Per backend and mode: the artifact head's logits and whether they are LMHead's bits (torch) or the
    same backend's all-gather bits (every backend); a NaN row on rank 1 last."""
    manifest = artifacts.read_manifest(Path(root), verify=False)
    processor = LogitsProcessor()
    head = head_from_artifact(Path(root), manifest, rank)  # LMHead over the saved shard, gather_output=True
    out: dict[str, Any] = {"rank": rank, "cases": []}
    first: dict[tuple[str, bool], torch.Tensor | None] = {}
    for backend in backends:
        for mode, chunk in MODES:
            art = open_gathered(backend, Path(root), manifest, rank, gather_output=mode, gather_chunk_rows=chunk)
            got = art.logits(hidden, seq_lens)
            head.gather_output, head.gather_chunk_rows = mode, chunk
            want = processor(hidden, head, seq_lens)  # LMHead's own forward and gather at this tp
            if (backend, True) not in first:
                first[(backend, True)] = got  # the one-collective all-gather of this backend
            all_gather = first[(backend, True)]
            expect = None if mode == "rank0" and rank != 0 else \
                all_gather[:, manifest.entry(rank).start: manifest.entry(rank).end] if mode is False else all_gather
            out["cases"].append({"backend": backend, "mode": mode, "chunk": chunk,
                                 "lmhead": _same(got, want), "own all-gather": _same(got, expect),
                                 "ran_on": [str(r) for r in art.ran_on],
                                 "logits": got if rank == 0 and mode is True and chunk is None else None})
    bad = hidden.clone()
    if rank == 1:
        # row 2 is the first sequence's last: rank 1's backend sees a NaN, its logits are refused, its peer hears
        bad[2, 0] = float("nan")
    art = open_gathered("torch", Path(root), manifest, rank, gather_output="rank0")
    out["failure"] = catch(lambda: art.logits(bad, seq_lens))
    out["after"] = catch(lambda: art.logits(hidden, seq_lens))
    return out
