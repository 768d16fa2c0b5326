"""FP8 E4M3 head weights: ``float8_e4m3fn [width, H]`` + fp32 ``weight_scale`` (per tensor or per row)."""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import kernels
from trtvocab.base.formats import Activation, Granularity, WeightFormat
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.sharding import VocabShard
from trtvocab.quant import fp8
from trtvocab.quant.config import QuantAlgo
from trtvocab.quant.scales import check_row_scales
from trtvocab.weights.base import read_rows, source_shape
from trtvocab.weights.quantized import (
    PREFIX,
    Dequantizer,
    QuantizedWeight,
    dtype_of,
    fp32_scalar,
    require,
)


class FP8Weight(QuantizedWeight):
    """``float8_e4m3fn [width, H]`` + fp32 ``weight_scale`` (scalar, or ``[width, 1]`` per row)."""

    weight_format = WeightFormat.FP8
    algo = QuantAlgo.FP8
    activations = (Activation.STATIC, Activation.DYNAMIC, Activation.NONE)

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        super().__init__(shard, hidden_size, dtype, quant_config)
        self.per_row = quant_config.granularity is Granularity.PER_ROW
        self.register_buffer("weight", torch.zeros(shard.width, hidden_size, dtype=fp8.FP8_DTYPE))
        self.register_buffer("weight_scale", torch.ones(shard.width, 1) if self.per_row else torch.ones(()))
        self.register_buffer("input_scale", torch.ones(()) if self.activation is Activation.STATIC else None)

    def load(self, tensors: dict[str, Any]) -> None:
        if "weight_scale_2" in tensors:
            raise CheckpointError(f"{PREFIX}weight_scale_2 belongs to NVFP4, but the head is configured as FP8")
        weight = read_rows(require(tensors, "weight", "the head's matrix"), PREFIX + "weight", self.shard,
                           (self.hidden_size,))
        if weight.dtype != fp8.FP8_DTYPE:
            raise CheckpointError(f"{PREFIX}weight: an FP8 head needs float8_e4m3fn, got {weight.dtype}")
        if fp8.has_nan_codes(weight):
            raise QuantizationError(f"{PREFIX}weight: holds FP8 NaN codes")
        scale = self._read_scale(require(tensors, "weight_scale", "FP8 weights need their scale"))
        with torch.no_grad():
            size = self.shard.size
            self.weight[:size].copy_(weight)
            self.weight[size:].zero_()
            if self.per_row:
                self.weight_scale[:size].copy_(scale)
                self.weight_scale[size:].fill_(1.0)
            else:
                self.weight_scale.copy_(scale)
            self._static_input_scale(tensors)

    def _read_scale(self, value: Any) -> torch.Tensor:
        name = PREFIX + "weight_scale"
        if not self.per_row:
            if len(source_shape(value)) > 0 and max(source_shape(value)) > 1:
                raise QuantizationError(f"{name}: per-tensor FP8 expects a scalar scale, got shape "
                                        f"{list(source_shape(value))} (per-row scales need granularity='per_row')")
            return fp32_scalar({"weight_scale": value}, "weight_scale")
        shape = source_shape(value)
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise QuantizationError(f"{name}: per-row FP8 expects shape [V] or [V, 1], got {list(shape)}")
        if dtype_of(value) != torch.float32:
            raise QuantizationError(f"{name}: expected float32 scales, got {dtype_of(value)}")
        rows = read_rows(value, name, self.shard, tuple(shape[1:])).reshape(-1, 1)
        check_row_scales(rows, name)
        return rows

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.activation is Activation.NONE:
            return xf
        scale = self.input_scale if self.activation is Activation.STATIC else fp8.dynamic_scale(xf)
        return fp8.fake_quant_fp8(xf, scale)

    def _plan(self, x_dq: torch.Tensor | None) -> tuple[torch.Tensor | None, Dequantizer]:
        fast = fp8.fast_path_ok(self.weight_scale)

        def rows(start: int, end: int, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
            q = self.weight[start:end]
            scale = self.weight_scale[start:end] if self.per_row else self.weight_scale
            if fast:
                return fp8.dequantize_fp8_bits(q, scale, out, work)
            return out.copy_(fp8.dequantize_fp8(q, scale))

        return x_dq, rows

    def _fused_x(self, x_dq: torch.Tensor) -> torch.Tensor:
        return kernels.fp8_x(x_dq)

    def _fused_rows(self, x: torch.Tensor, start: int, end: int, out: torch.Tensor | None) -> torch.Tensor:
        # weight_scale (scalar or per row) is applied after each row's dot product (kernels docstring).
        scale = self.weight_scale[start:end] if self.per_row else self.weight_scale
        return kernels.fp8_logits(x, self.hidden_size, self.weight[start:end], scale, out)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        size = self.shard.size
        out = {
            "weight": self.weight[:size],
            "weight_scale": self.weight_scale[:size].reshape(size) if self.per_row else self.weight_scale,
        }
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out
