"""The quantized weight formats' shared half: shard kept quantized, dequantized per call.

Each rank holds its ``[width, H]`` shard as the checkpoint stores it and, per call, dequantizes it
chunk by chunk (``CHUNK_ELEMENTS`` float32 values at a time) into a float32 GEMM. The formats
(:mod:`trtvocab.weights.fp8`, :mod:`trtvocab.weights.nvfp4`) say how rows are dequantized and
inputs quantized; the ONNX export implements the same contract from
:meth:`~trtvocab.weights.base.WeightMethod.export_tensors`. Where the fused kernels build,
``prepare`` returns a :class:`~trtvocab.kernels.FusedInput` and ``block_logits`` decodes inside the
multiply; the chunked torch path is the fallback.

The formulas: docs/architecture.md, "Weight formats"; the kernels: its "Fused kernels".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from trtvocab import kernels
from trtvocab.base.formats import Activation
from trtvocab.checkpoints.checkpoint import ST_DTYPES
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.sharding import VocabShard
from trtvocab.quant.config import QuantAlgo, QuantConfig
from trtvocab.quant.scales import MAX_SCALED_CODE, check_scale_range  # noqa: F401  (re-exported)
from trtvocab.weights.base import WeightMethod, read_all, read_scalar, row_blocks

CHUNK_ELEMENTS = 1 << 20
Dequantizer = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
PREFIX = "lm_head."  # quantized heads are never the tied embedding, so errors can name lm_head.*


def dtype_of(value: Any) -> torch.dtype | str:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if hasattr(value, "info"):  # trtvocab.checkpoints.checkpoint.LazyRows
        return value.info.torch_dtype
    if hasattr(value, "get_dtype"):  # a safetensors slice: its dtype tag
        tag = str(value.get_dtype())
        return ST_DTYPES.get(tag, tag)
    raise CheckpointError(f"expected a torch.Tensor or a safetensors slice, got {type(value).__name__}")


def fp32_scalar(tensors: dict[str, Any], key: str) -> torch.Tensor:
    name = PREFIX + key
    value = tensors[key]
    tensor = read_all(value)
    if tensor.dtype != torch.float32:
        raise QuantizationError(f"{name}: expected a float32 scale, got {tensor.dtype}")
    scalar = read_scalar(tensor, name)
    check_scale_range(scalar, name)
    return scalar


def require(tensors: dict[str, Any], key: str, why: str) -> Any:
    if key not in tensors:
        raise QuantizationError(f"{PREFIX}{key} is missing ({why}); got {sorted(PREFIX + k for k in tensors)}")
    return tensors[key]


class QuantizedWeight(WeightMethod):
    """Chunked ``x_dq @ W.T`` shared by the formats; subclasses dequantize rows and quantize inputs."""

    algo: ClassVar[QuantAlgo]
    activations: ClassVar[tuple[Activation, ...]]

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        if not isinstance(quant_config, QuantConfig) or quant_config.quant_algo is not self.algo:
            raise QuantizationError(f"{type(self).__name__} needs a QuantConfig with quant_algo {self.algo.value}, "
                                    f"got {quant_config!r}")
        if quant_config.activation not in self.activations:
            raise QuantizationError(f"{self.algo.value} LM head: activation must be one of "
                                    f"{[a.value for a in self.activations]}, "
                                    f"got {quant_config.activation!r}")
        super().__init__(shard, hidden_size, dtype, quant_config)
        self.activation = quant_config.activation

    # -- subclass hooks --------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _plan(self, x_dq: torch.Tensor | None) -> tuple[torch.Tensor | None, Dequantizer]:
        """``(x for the GEMM, f(start, end, out, work) -> float32 rows in the GEMM's column order)``.

        ``x_dq is None``: element order (for :meth:`dense_weight`). A fast path may permute
        the columns of both operands alike; the products summed are the same.
        """
        raise NotImplementedError  # pragma: no cover - abstract

    def _fused_x(self, x_dq: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``x_dq`` in the fused kernel's layout (:mod:`trtvocab.kernels`)."""
        raise NotImplementedError

    def _fused_rows(self, x: torch.Tensor, start: int, end: int, out: torch.Tensor | None) -> torch.Tensor:
        """The fused kernel's logits of owned rows ``[start, end)``."""
        raise NotImplementedError  # pragma: no cover - abstract

    # -- shared -------------------------------------------------------------------------------
    @property
    def rows_per_chunk(self) -> int:
        return max(1, CHUNK_ELEMENTS // self.hidden_size)

    def gemm_tiles(self, output_dtype: torch.dtype, deterministic: bool) -> list[tuple[int, int]]:
        """The dequantization row blocks of :meth:`block_logits` (:attr:`rows_per_chunk`, from row 0)."""
        return row_blocks(self.shard.size, self.rows_per_chunk)

    def _device(self) -> torch.device:
        return next(self.buffers()).device

    def _scratch(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(0, min(self.rows_per_chunk, rows))
        return (torch.empty(rows, self.hidden_size, dtype=torch.float32, device=device),
                torch.empty(rows, self.hidden_size, dtype=torch.int16, device=device))

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, Dequantizer] | kernels.FusedInput:
        x_dq = self.quantize_input(x)
        if kernels.usable(x_dq, *self.buffers()):
            return kernels.FusedInput(self._fused_x(x_dq))
        return self._plan(x_dq)

    def block_logits(self, prepared: tuple[torch.Tensor, Dequantizer] | kernels.FusedInput, start: int, end: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        if not 0 <= start <= end <= self.shard.size:
            raise ValueError(f"block_logits: rows [{start}, {end}) outside this shard's [0, {self.shard.size})")
        if isinstance(prepared, kernels.FusedInput):
            return self._fused_rows(prepared.x, start, end, out)
        gemm_x, dequant = prepared
        if out is None:
            out = torch.empty(gemm_x.shape[0], end - start, dtype=torch.float32, device=gemm_x.device)
        step = self.rows_per_chunk
        buffer, work = self._scratch(end - start, gemm_x.device)
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            w = dequant(lo, hi, buffer[: hi - lo], work[: hi - lo])
            torch.matmul(gemm_x, w.t(), out=out[:, lo - start : hi - start])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.shard.width, dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        self.block_logits(self.prepare(x), 0, self.shard.size, out=out[:, : self.shard.size])
        return out  # padding columns (padded layout) stay 0; the head sets them to -inf

    def dense_weight(self) -> torch.Tensor:
        width, step = self.shard.width, self.rows_per_chunk
        out = torch.empty(width, self.hidden_size, dtype=torch.float32, device=self._device())
        _, dequant = self._plan(None)
        _, work = self._scratch(width, out.device)
        for start in range(0, width, step):
            end = min(start + step, width)
            dequant(start, end, out[start:end], work[: end - start])
        return out.add_(0.0)  # canonical zeros: the NVFP4 fast path decodes "-0" as -0.0

    def _static_input_scale(self, tensors: dict[str, Any]) -> None:
        if self.activation is Activation.STATIC:
            require(tensors, "input_scale", "static activation quantization needs it")
            self.input_scale.copy_(fp32_scalar(tensors, "input_scale"))
