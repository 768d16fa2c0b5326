"""The contract every weight format implements, and the readers they share (full or sliced rows)."""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from typing import Any, ClassVar

import torch
from torch import nn

from trtvocab.base.formats import WeightFormat
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.sharding import VocabShard

# Names a weight format may read; any prefix ("lm_head.", "model.embed_tokens.") is dropped.
TENSOR_KEYS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def normalize_keys(tensors: MappingABC[str, Any]) -> dict[str, Any]:
    """Map ``lm_head.weight_scale`` -> ``weight_scale`` etc.; refuse two tensors for one key."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        key = name.rsplit(".", 1)[-1]
        if key not in TENSOR_KEYS:
            continue
        if key in out:
            raise CheckpointError(f"two tensors map to LM-head key {key!r}: {sorted(tensors)}")
        out[key] = value
    return out


def source_shape(value: Any) -> tuple[int, ...]:
    """Shape of a tensor or a safetensors slice (``get_shape``) without reading it."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if hasattr(value, "get_shape"):
        return tuple(value.get_shape())
    raise CheckpointError(f"expected a torch.Tensor or a safetensors slice, got {type(value).__name__}")


def source_label(value: Any, default: str) -> str:
    """How a message names a tensor: ``FILE: NAME`` for a GGUF tensor's lazy rows, else ``default``."""
    info = getattr(value, "info", None)
    file, name = getattr(info, "file", None), getattr(info, "gguf_name", None)
    return f"{file}: {name}" if file is not None and name is not None else default


def read_rows(value: Any, name: str, shard: VocabShard, row_shape: tuple[int, ...]) -> torch.Tensor:
    """This shard's rows of ``value``, which holds either all vocab rows or only this shard's.

    Only the shard's rows are read from a safetensors slice. ``row_shape`` is the
    expected shape of one row (``(H,)`` dense, ``(H // 2,)`` packed FP4, ...).
    """
    shape = source_shape(value)
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise CheckpointError(f"{name}: a meta tensor (a shape without data) cannot be loaded; pass real values")
    if tuple(shape[1:]) != tuple(row_shape) or len(shape) != 1 + len(row_shape):
        raise CheckpointError(
            f"{name}: expected shape [rows, {', '.join(map(str, row_shape))}], got {list(shape)}"
        )
    rows = shape[0]
    if rows == shard.vocab_size:
        start, end = shard.start, shard.end
    elif rows == shard.size:
        start, end = 0, shard.size
    else:
        raise CheckpointError(
            f"{name}: has {rows} rows; expected the full vocab ({shard.vocab_size}) or this "
            f"rank's shard ({shard.size} rows, [{shard.start}, {shard.end}))"
        )
    out = value[start:end]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def row_blocks(size: int, step: int) -> list[tuple[int, int]]:
    """``[(lo, hi)]``: rows ``[0, size)`` in blocks of ``step`` from row 0, the last one shorter."""
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def read_all(value: Any) -> torch.Tensor:
    """All of a tensor, lazy reader or safetensors slice (``[...]`` also works for 0-d slices)."""
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value[...])


def read_scalar(value: Any, name: str) -> torch.Tensor:
    """A per-tensor fp32 scale: a 0-d or one-element tensor, finite and positive."""
    tensor = read_all(value)
    if tensor.numel() != 1:
        raise QuantizationError(f"{name}: expected a scalar scale, got shape {list(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        raise QuantizationError(f"{name}: expected a floating-point scale, got {tensor.dtype}")
    scalar = tensor.reshape(()).float()
    if not torch.isfinite(scalar) or scalar <= 0:
        raise QuantizationError(f"{name}: scale must be finite and > 0, got {scalar.item()}")
    return scalar


class WeightMethod(nn.Module):
    """Stores one rank's ``[width, H]`` shard of the head in some format and multiplies by it.

    ``width`` rows are allocated; rows past ``shard.size`` (padded layout) stay zero.
    Subclasses set ``weight_format`` and implement ``load``, ``forward``, ``block_logits``,
    ``gemm_tiles`` (the GEMM's own row tiles, declared next to it), ``dense_weight`` and
    ``export_tensors``.

    Args:
        shard: the rank's columns (:class:`~trtvocab.parallel.sharding.VocabShard`).
        hidden_size: H.
        dtype: the head dtype (inputs arrive in it; dense heads also store and return it).
        quant_config: the :class:`~trtvocab.quant.config.QuantConfig` (None for dense).
    """

    weight_format: ClassVar[WeightFormat]
    # Set by VocabParallelModule.load_weights once a table has been loaded; a fresh instance holds
    # only its zero-filled initial buffers (what tie_weights refuses to hand out as a table).
    loaded: bool = False

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        super().__init__()
        self.shard = shard
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.quant_config = quant_config

    def load(self, tensors: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``x [N, H]`` in ``self.dtype`` -> logits ``[N, width]`` in ``self.dtype``."""
        raise NotImplementedError

    def prepare(self, x: torch.Tensor) -> Any:
        """``x [N, H]`` as this format's GEMM takes it (activation quantization applied once for
        the whole batch): what :meth:`block_logits` multiplies. Dense formats return ``x``."""
        return x

    def block_logits(self, prepared: Any, start: int, end: int) -> torch.Tensor:  # pragma: no cover - abstract
        """Logits ``[N, end - start]`` of this shard's owned rows ``[start, end)`` (local row
        numbers, ``0 <= start <= end <= shard.size``) for ``prepared = self.prepare(x)``; dense
        formats return their dtype, quantized ones float32. What a vocab-chunked caller streams."""
        raise NotImplementedError

    def gemm_tiles(self, output_dtype: torch.dtype, deterministic: bool) -> list[tuple[int, int]]:
        """``[(lo, hi)]``: the local owned rows of every tile of this format's GEMM (:meth:`gemm`), in
        order, covering ``[0, shard.size)``. :meth:`gemm` over any run of consecutive tiles gives
        bitwise the columns of the whole-shard call, so a vocab-chunked caller (``sampling.chunked``)
        cuts only here: its chunks cannot drift from the GEMM. Each format declares its own."""
        raise NotImplementedError  # pragma: no cover - abstract

    def gemm(self, prepared: Any, start: int, end: int, output_dtype: torch.dtype,
             deterministic: bool) -> torch.Tensor:
        """``x @ W.T`` of owned rows ``[start, end)`` in ``output_dtype`` (``prepared``: from
        :meth:`prepare`): the GEMM whose tiles :meth:`gemm_tiles` declares. Default: :meth:`block_logits`
        (a quantized format's float32 logits; its tiles are its dequantization row blocks)."""
        return self.block_logits(prepared, start, end)

    def resident_bytes(self) -> int:
        """Bytes of every buffer this format keeps resident."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dense_weight(self) -> torch.Tensor:
        """The weight as the GEMM sees it, ``[width, H]`` float32 (for export checks and references)."""
        raise NotImplementedError

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The shard's tensors under checkpoint names (``weight``, scales), trimmed to ``shard.size`` rows."""
        raise NotImplementedError
