"""NVFP4 head weights: packed E2M1 ``uint8 [width, H/2]``, E4M3 block scales, fp32 global scale."""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import kernels
from trtvocab.base.formats import Activation, WeightFormat
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.sharding import VocabShard
from trtvocab.quant import fp8, nvfp4
from trtvocab.quant.config import QuantAlgo
from trtvocab.quant.scales import check_block_scales
from trtvocab.weights.base import read_rows, source_shape
from trtvocab.weights.quantized import PREFIX, Dequantizer, QuantizedWeight, dtype_of, fp32_scalar, require


class NVFP4Weight(QuantizedWeight):
    """Packed ``uint8 [width, H/2]`` + e4m3 block scales ``[width, H/16]`` + fp32 ``weight_scale_2``.

    The packed bytes live in ``packed_block_major`` (a per-row byte permutation, see
    :func:`~trtvocab.quant.nvfp4.to_block_major`); :meth:`export_tensors` returns them in
    checkpoint order.
    """

    weight_format = WeightFormat.NVFP4
    algo = QuantAlgo.NVFP4
    activations = (Activation.STATIC, Activation.NONE)

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        super().__init__(shard, hidden_size, dtype, quant_config)
        nvfp4.check_hidden(hidden_size, PREFIX + "weight")
        if quant_config.group_size != nvfp4.BLOCK:
            raise QuantizationError(f"NVFP4 LM head: group_size must be {nvfp4.BLOCK}, got {quant_config.group_size}")
        # The packed bytes in block-major order (nvfp4.to_block_major: a per-row byte permutation
        # that makes the CPU decode cheaper); export_tensors() gives checkpoint order back.
        self.register_buffer("packed_block_major", torch.zeros(shard.width, hidden_size // 2, dtype=torch.uint8))
        # Padding rows: code 0 (value 0) under a finite scale of 1.0.
        ones = torch.ones(shard.width, hidden_size // nvfp4.BLOCK)
        self.register_buffer("weight_scale", ones.to(fp8.FP8_DTYPE))
        self.register_buffer("weight_scale_2", torch.ones(()))
        self.register_buffer("input_scale", torch.ones(()) if self.activation is Activation.STATIC else None)

    def load(self, tensors: dict[str, Any]) -> None:
        hidden = self.hidden_size
        packed_src = require(tensors, "weight", "the head's matrix")
        shape = source_shape(packed_src)
        if len(shape) != 2 or shape[1] != hidden // 2:
            raise CheckpointError(f"{PREFIX}weight: packed FP4 must be [V, H/2] = [*, {hidden // 2}] "
                                  f"for hidden size {hidden}, got {list(shape)}")
        packed = read_rows(packed_src, PREFIX + "weight", self.shard, (hidden // 2,))
        if packed.dtype != torch.uint8:
            raise CheckpointError(f"{PREFIX}weight: an NVFP4 head needs packed uint8, got {packed.dtype}")
        # Rows of the packed weight and of its block scales are sliced together.
        scales_src = require(tensors, "weight_scale", "NVFP4 needs its per-block scales")
        if dtype_of(scales_src) != fp8.FP8_DTYPE:
            raise QuantizationError(f"{PREFIX}weight_scale: NVFP4 block scales must be float8_e4m3fn, "
                                    f"got {dtype_of(scales_src)}")
        blocks = hidden // nvfp4.BLOCK
        if len(source_shape(scales_src)) != 2 or source_shape(scales_src)[1] != blocks:
            raise QuantizationError(f"{PREFIX}weight_scale: expected block scales [V, H/16] = [*, {blocks}], "
                                    f"got {list(source_shape(scales_src))}")
        scales = read_rows(scales_src, PREFIX + "weight_scale", self.shard, (blocks,))
        check_block_scales(scales, PREFIX + "weight_scale")
        global_scale = fp32_scalar({"weight_scale_2": require(tensors, "weight_scale_2", "NVFP4 global scale")},
                                    "weight_scale_2")
        with torch.no_grad():
            size = self.shard.size
            self.packed_block_major[:size].copy_(nvfp4.to_block_major(packed))
            self.packed_block_major[size:].zero_()
            self.weight_scale[:size].copy_(scales)
            self.weight_scale[size:] = torch.ones(self.shard.padding, blocks).to(fp8.FP8_DTYPE)
            self.weight_scale_2.copy_(global_scale)
            self._static_input_scale(tensors)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.activation is Activation.NONE:
            return xf
        return nvfp4.fake_quant_activation(xf, self.input_scale)

    def _plan(self, x_dq: torch.Tensor | None) -> tuple[torch.Tensor | None, Dequantizer]:
        fast = nvfp4.fast_path_ok(self.weight_scale_2)
        permuted = fast and x_dq is not None  # the GEMM takes both operands' columns permuted alike

        def rows(start: int, end: int, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
            packed_bm, bs = self.packed_block_major[start:end], self.weight_scale[start:end]
            if permuted:
                return nvfp4.decode_block_major(packed_bm, bs, self.weight_scale_2, out=out, work=work)
            if fast:
                decoded = nvfp4.decode_block_major(packed_bm, bs, self.weight_scale_2, work=work)
                return nvfp4.block_major_to_elements(decoded, out)
            packed = nvfp4.from_block_major(packed_bm)
            return out.copy_(nvfp4.dequantize_nvfp4(packed, bs, self.weight_scale_2))

        return (nvfp4.block_major_columns(x_dq) if permuted else x_dq), rows

    def _fused_x(self, x_dq: torch.Tensor) -> torch.Tensor:
        return kernels.nvfp4_x(x_dq)

    def _fused_rows(self, x: torch.Tensor, start: int, end: int, out: torch.Tensor | None) -> torch.Tensor:
        # Block scales are applied once per block sum, weight_scale_2 once per logit (kernels docstring).
        return kernels.nvfp4_logits(x, self.hidden_size, self.packed_block_major[start:end],
                                    self.weight_scale[start:end], float(self.weight_scale_2), out)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        size = self.shard.size
        out = {
            "weight": nvfp4.from_block_major(self.packed_block_major[:size]),
            "weight_scale": self.weight_scale[:size],
            "weight_scale_2": self.weight_scale_2,
        }
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out
