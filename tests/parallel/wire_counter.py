"""Count the bytes every collective of a block really hands to torch.distributed, on this rank.

A ``TorchDispatchMode`` sees every collective as the dispatcher runs it: the process-group calls
(``c10d.allgather_``, ``c10d.allreduce_``, ``c10d.alltoall_base_``, ``c10d.gather_``, ``c10d.broadcast_``,
...) that ``dist.all_gather`` and friends become, and the functional collectives
(``_c10d_functional.all_gather_into_tensor``, ``all_reduce``, ...) that compiled code uses. So the
count does not depend on which Python API a module calls. Each event is ``(kind, bytes)``: ``kind``
the collective (``all_gather``, ``all_reduce``, ``all_to_all``, ``gather``, ``broadcast``,
``reduce_scatter``), ``bytes`` what this rank puts in (its input tensors' bytes: for an all-gather the
piece it contributes, for an all-reduce the buffer reduced, for an all-to-all the whole send buffer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("all_gather", "all_gather"),
          ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("alltoall", "all_to_all"),
          ("all_to_all", "all_to_all"), ("gather", "gather"), ("broadcast", "broadcast"), ("scatter", "scatter"),
          ("reduce", "reduce"))
_INPUTS = ("input_tensors", "input", "inputs", "tensors", "tensor", "self", "inp")
_SKIP = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")


def _kind(name: str) -> str | None:
    if "c10d" not in name or any(s in name for s in _SKIP):
        return None
    op = name.split(".")[1] if "." in name else name
    for key, kind in _KINDS:
        if key in op:
            return kind
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class _Counter(TorchDispatchMode):
    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind(str(func))
        if kind is not None:
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args, strict=False)) | kwargs
            source = next((n for n in _INPUTS if n in bound), names[0])
            self.events.append((kind, _nbytes(bound[source])))
        return func(*args, **kwargs)


@contextmanager
def count_collectives() -> Iterator[list[tuple[str, int]]]:
    """``with count_collectives() as events:`` -> ``events`` holds ``(kind, bytes)`` per collective, in order."""
    events: list[tuple[str, int]] = []
    with _Counter(events):
        yield events
