"""Counting the host reads of device values that a block of torch code makes.

On a GPU a read of a device value by the host (``bool(t)``, ``t.item()``, ``int(t)``, ``t.tolist()``,
``t.numpy()``, a ``nonzero`` or a boolean-mask selection, whose size is data) drains the stream and
makes the step uncapturable in a CUDA graph. On a CPU nothing drains, but the same calls are made, so
they are counted here: a :class:`torch.overrides.TorchFunctionMode` that sees every tensor call of the
block and counts those that need a device value on the host. Tests keep a decode step at its count
(tests/sampling/test_prepared_step.py) and ``benchmarks/host_reads.py`` prints the table.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Calls whose result (or its shape) is a device value the host must read.
_READS = {
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.masked_select, torch.masked_select, torch.equal, torch.Tensor.equal, torch.unique,
    torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere, torch.Tensor.nonzero_static,
}


def _is_mask_index(func: Any, args: tuple[Any, ...]) -> bool:
    """``t[mask]`` with a bool tensor: the result's size is the mask's count (a read)."""
    if func is not torch.Tensor.__getitem__ or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


class HostReads(TorchFunctionMode):
    """Counts, by call, the host reads of tensor values made inside ``with HostReads() as reads:``.

    ``reads.total``: the count; ``reads.by_call``: ``Counter`` of the call names; ``reads.where``:
    ``Counter`` of ``file:line`` of the caller (``where=True``, a stack walk per read)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.by_call: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self._where = where

    @property
    def total(self) -> int:
        return sum(self.by_call.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in _READS or _is_mask_index(func, args):
            name = getattr(func, "__name__", str(func))
            self.by_call[name] += 1
            if self._where:
                import traceback  # only when asked: a stack walk per read

                frames = [f for f in traceback.extract_stack()[:-1] if "host_reads.py" not in f.filename
                          and "/torch/" not in f.filename]
                if frames:
                    self.where[f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}"] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["HostReads"]
