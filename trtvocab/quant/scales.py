"""The rules every stored scale of a quantized head or embedding obeys, on every path.

The quantized path (the FP8 / NVFP4 weight methods) and the dequantize path (a compressed-tensors
module decompressed into a dense head: ``quant='none'``, a tied quantized head, LM-head TP under
attention DP, an NVFP4 embedding) refuse the same files: a scale that is NaN, infinite, zero, negative,
or so large that it times the largest code it multiplies is not finite in float32.
"""

from __future__ import annotations

import torch

from trtvocab.errors import QuantizationError

# The largest code magnitude any scale multiplies (an FP4 value under an FP8 block scale): a
# scale whose product with it is not finite would turn valid codes into inf (and then NaN logits).
MAX_SCALED_CODE = 6.0 * 448.0


def check_scale_range(scale: torch.Tensor, name: str) -> None:
    """Refuse scales that are finite but so large that ``scale * code`` overflows float32."""
    if not bool(torch.isfinite(scale.float() * MAX_SCALED_CODE).all()):
        limit = torch.finfo(torch.float32).max / MAX_SCALED_CODE
        raise QuantizationError(f"{name}: scale {float(scale.max())} is too large (at most {limit:.3e}: "
                                f"times the largest code {MAX_SCALED_CODE:g} it must stay finite in float32)")


def check_row_scales(rows: torch.Tensor, name: str) -> None:
    """Per-row (or per-tensor) float scales: finite, > 0 and in range."""
    values = rows.float()
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise QuantizationError(f"{name}: per-row scales must be finite and > 0")
    check_scale_range(values, name)


def check_block_scales(scales: torch.Tensor, name: str) -> None:
    """NVFP4 E4M3 block scales: no NaN code (``0x7F`` / ``0xFF``), none zero or negative."""
    bits = scales.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()) or bool((scales.float() <= 0).any()):
        raise QuantizationError(f"{name}: block scales must be finite and > 0 (found NaN, zero or negative)")


__all__ = ["MAX_SCALED_CODE", "check_block_scales", "check_row_scales", "check_scale_range"]
