"""The vocab tree's ``(max, sum exp)`` nodes (:mod:`trtvocab.sampling.treesum`) in the kernels'
library (``csrc/treesum.cpp``), and the check that its exp is torch's, bit for bit."""

from __future__ import annotations

import threading

import torch

from trtvocab.kernels.compile import Loaded, log
from trtvocab.kernels.gemm import check_status
from trtvocab.kernels.library import load

_lock = threading.Lock()
_tree_failure: str | None = None  # why the tree kernel is not used (checked once per process)
_tree_checked = False
TREE_MAX_LOGITS = (1 << 21) - 1  # longer ranges may hold a node of more blocks than the kernel buffers
EXP_SAMPLE = 1 << 22  # non-positive float32 values the load-time exp check compares (plus the edges)


def _tree_exp(d: torch.Tensor) -> torch.Tensor:
    loaded = load()
    assert loaded is not None
    d = d.contiguous()
    out = torch.empty_like(d)
    check_status(loaded.lib.trtvocab_tree_exp(d.data_ptr(), d.numel(), out.data_ptr()), "tree exp")
    return out


def _exp_mismatch(d: torch.Tensor) -> int:
    """How many of ``d`` the kernel's exp and ``torch.exp(nan_to_num(d, nan=0))`` disagree on (bits)."""
    want = torch.exp(torch.nan_to_num(d, nan=0.0, posinf=float("inf"), neginf=float("-inf")))
    return int((_tree_exp(d).view(torch.int32) != want.view(torch.int32)).sum())


def tree_exp_check(exhaustive: bool = False) -> str | None:
    """Compare the tree kernel's exp with torch's, bit for bit, on what the tree feeds it (``min -
    max <= 0``): a spread sample of every binade and the edges, or (``exhaustive``, ~1e9 values, what
    :mod:`trtvocab.kernels.__main__`'s build runs) every float32 in ``[-104, 0]``, below which both give 0.
    None: equal."""
    edges = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), -87.33654, -88.72284, -103.27893, -103.97208,
                          -104.0, -1e-45, -1e-38, -1.0, -0.5, -2.0**-24])
    bad = _exp_mismatch(edges)
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x42D00000, (EXP_SAMPLE,), generator=gen, dtype=torch.int64) | 0x80000000
    bad += _exp_mismatch(bits.to(torch.uint32).view(torch.int32).view(torch.float32))
    if exhaustive:
        step = 1 << 26
        for lo in range(0, 0x42D00001, step):
            bits = torch.arange(lo, min(lo + step, 0x42D00001), dtype=torch.int64) | 0x80000000
            bad += _exp_mismatch(bits.to(torch.uint32).view(torch.int32).view(torch.float32))
    return None if bad == 0 else f"exp differs from torch.exp on {bad} value(s)"


EXP_NAMES = {1: "MKL vmsExp", 0: "Sleef_expf8_u10"}  # tried in this order


def _choose_exp(loaded: Loaded) -> str | None:
    """Set the tree kernel's exp to the first one that matches torch.exp; None, or why none does."""
    if loaded.lib.trtvocab_tree_isa() != 1:
        return "this build has no tree kernel (needs AVX2 + FMA)"
    why = []
    for mode, name in EXP_NAMES.items():
        if loaded.lib.trtvocab_tree_set_exp(mode) != 0:
            why.append(f"{name}: not in this torch build")
            continue
        problem = tree_exp_check()
        if problem is None:
            return None
        why.append(f"{name}: {problem}")
    loaded.lib.trtvocab_tree_set_exp(-1)  # refuses: the kernel stays off
    return "; ".join(why)


def tree_available() -> bool:
    """Whether :func:`tree_nodes` runs here: the library loaded, its build has the tree kernel
    (AVX2 + FMA), and its exp matched torch's (checked once per process; on a mismatch the torch
    path is used, with one log line)."""
    global _tree_failure, _tree_checked
    loaded = load()
    if loaded is None:
        return False
    if not _tree_checked:
        with _lock:
            if not _tree_checked:
                _tree_failure = _choose_exp(loaded)
                if _tree_failure:
                    log.warning("trtvocab tree kernel unavailable, using the torch path (%s)", _tree_failure)
                _tree_checked = True
    return _tree_failure is None


def _tree_nodes(x: torch.Tensor, first_id: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    loaded = load()
    if loaded is None or x.dtype != torch.float32 or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError("tree_nodes: float32 [B, n] logits with unit column stride, kernels loaded")
    rows, n = x.shape
    m = torch.empty(rows, count, dtype=torch.float32)
    s = torch.empty(rows, count, dtype=torch.float32)
    if rows and n:
        check_status(loaded.lib.trtvocab_tree_nodes(x.data_ptr(), rows, x.stride(0), n, first_id, m.data_ptr(),
                                                   s.data_ptr(), count), "tree nodes")
    return m, s


# An op of torch's dispatcher with a fake kernel, as the head kernels (trtvocab.kernels.library): a compiled
# step calls it in its graph.
_OPS = torch.library.Library("trtvocab", "FRAGMENT")
_OPS.define("tree_nodes(Tensor x, int first_id, int count) -> (Tensor, Tensor)")
_OPS.impl("tree_nodes", _tree_nodes, "CPU")
torch.library.register_fake("trtvocab::tree_nodes")(
    lambda x, first_id, count: (x.new_empty((x.shape[0], count), dtype=torch.float32),
                                x.new_empty((x.shape[0], count), dtype=torch.float32)))


def tree_nodes(x: torch.Tensor, first_id: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, s)`` float32 ``[B, count]``: the vocab tree's nodes ``aligned_nodes(first_id, first_id
    + n)`` (``count`` of them) of the float32 logits ``x [B, n]`` (unit column stride)."""
    return torch.ops.trtvocab.tree_nodes(x, first_id, count)
