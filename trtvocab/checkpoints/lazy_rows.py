"""The lazy row reader both checkpoint formats hand out (``get_slice(name)``).

``reader[a:b]`` reads only rows ``a..b`` of a ``[rows, ...]`` tensor from disk; ``reader[...]``
reads it whole; ``get_shape`` / ``get_dtype`` answer from the header (the safetensors slice
interface, so weight loaders take either one, or a real safetensors slice).
"""

from __future__ import annotations

from typing import Any

from trtvocab.errors import CheckpointError


class RowReader:
    """Base of :class:`trtvocab.checkpoints.checkpoint.LazyRows` and :class:`trtvocab.checkpoints.gguf.GGUFRows`.

    Args:
        info: the tensor's header record (``name``, ``shape`` in torch order, ``dtype`` tag).
    """

    def __init__(self, info: Any) -> None:
        self.info = info

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def get_dtype(self) -> str:
        return self.info.dtype

    def row_range(self, index: Any) -> tuple[int, int]:
        """``(start, stop)`` of a contiguous row slice (``...`` is every row); refuses anything else."""
        if index is Ellipsis:
            index = slice(None)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise CheckpointError(f"{self.info.name}: only contiguous row slices can be read lazily")
        rows = self.info.shape[0] if self.info.shape else 1
        start, stop, _ = index.indices(rows)
        return start, max(start, stop)


def read_span(fh: Any, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``fh`` at byte ``offset`` (positioned reads until full or end of file);
    returns the number of bytes read, which the caller checks against what it needed."""
    fh.seek(offset)
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            break
        got += n
    return got
