"""NVFP4 numerics: E2M1 values in 16-wide blocks with an E4M3 scale per block and an fp32 global scale.

For ``x [..., H]`` (``H % 16 == 0``) and global scale ``g`` (``weight_scale_2`` =
``amax / (6 * 448)``)::

    block_scale = e4m3(clamp(S, 2**-9, 448)),  S = block_amax / (6 * g), S == 0 -> 1.0
    code        = e2m1(x / (block_scale.float() * g))   round half to even, saturate at 6
    dequant     = e2m1_value(code) * (block_scale.float() * g)   (fp32 product first)

The sign bit of a code is ``x < 0`` (so a small negative number rounds to code 8,
"-0"). Two codes pack into one byte, element ``2k`` in the low nibble. All of this
is bit-identical to ``modelopt.torch.quantization.qtensor.NVFP4QTensor.quantize``
(and its dequantize), except where ModelOpt produces NaN: an all-zero tensor here
gets global scale 1.0 and non-finite weights are refused.
"""

from __future__ import annotations

import torch

from trtvocab.errors import QuantizationError
from trtvocab.quant.fp8 import FP8_DTYPE, FP8_MAX

BLOCK = 16
E2M1_MAX = 6.0
SCALE_MIN = 2.0**-9  # smallest e4m3 subnormal: a block scale never underflows to 0
# Code -> value; code 8 ("-0") is 0.0, as ModelOpt decodes it.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# A code ``s ee m`` shifted into bits 7..4 of a byte, sign-extended to int32 and shifted
# left by 18 lands as fp32 sign (bit 31), exponent low bits ``ee`` (24..23) and mantissa
# MSB ``m`` (22): the fp32 number value * 2**-126 (``ee == 0`` -> subnormal m * 0.5,
# exactly). The mask drops sign-extension copies and the neighbouring nibble.
_SHIFT = 18
_MASK = 0x81C00000 - (1 << 32)
_BIAS = 2.0**126
_SAFE_SCALE = 2.0  # block_scale * g * 2**126 stays a finite fp32 below this


def check_hidden(hidden: int, name: str = "weight") -> None:
    if hidden % BLOCK:
        raise QuantizationError(f"{name}: NVFP4 needs the hidden size to be a multiple of {BLOCK}, got {hidden}")


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """``amax / (6 * 448)`` in fp32 (``weight_scale_2``); amax 0 (or underflow) -> 1.0."""
    amax = torch.as_tensor(amax).float()
    scale = amax / (E2M1_MAX * FP8_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _global_scale(global_scale: torch.Tensor | float, name: str) -> torch.Tensor:
    g = torch.as_tensor(global_scale)
    if not g.dtype.is_floating_point or g.numel() != 1:
        raise QuantizationError(f"{name}: global scale must be one float, got {g.dtype} {list(g.shape)}")
    g = g.float().reshape(())
    if not bool(torch.isfinite(g)) or not bool(g > 0):
        raise QuantizationError(f"{name}: global scale must be finite and > 0, got {g.item()}")
    return g


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scale of every 16-wide block of ``x [..., H]`` (float32) -> ``[..., H/16]``."""
    amax = x.reshape(*x.shape[:-1], -1, BLOCK).abs().amax(-1)
    s = amax / (E2M1_MAX * global_scale)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero block: scale 1.0
    return s.clamp(SCALE_MIN, FP8_MAX).to(FP8_DTYPE)


def round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes ``|a|`` rounded to the E2M1 grid, half to even, saturating at 6 (NaN stays NaN)."""
    mag = a.abs()
    # The grid spacing is 0.5 below 2, 1 in [2, 4), 2 from 4: divide by the power-of-two
    # step (exact), round half to even (torch.round), multiply back (exact).
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return (torch.round(mag / step) * step).clamp(max=E2M1_MAX)


def _scaled_blocks(x: torch.Tensor, bs: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x / (bs * g)`` per block, and the fp32 per-block scale ``bs * g``."""
    scale = bs.float() * g
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    return blocks / scale.unsqueeze(-1), scale


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> ``(packed uint8 [..., H/2], block scales e4m3 [..., H/16], global scale fp32)``."""
    if not x.dtype.is_floating_point:
        raise QuantizationError(f"{name}: cannot NVFP4-quantize a {x.dtype} tensor")
    check_hidden(x.shape[-1], name)
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise QuantizationError(f"{name}: holds NaN or inf; refusing to quantize it")
    if global_scale is None:
        g = global_scale_from_amax(xf.abs().amax())
    else:
        g = _global_scale(global_scale, name)
    bs = block_scales(xf, g)
    scaled, _ = _scaled_blocks(xf, bs, g)
    # 0 / 0 can only come from an absurdly small explicit global scale underflowing bs * g.
    mag = torch.nan_to_num(round_e2m1(scaled), nan=0.0)
    # Grid value -> 3-bit index: 0, .5, 1, 1.5 -> 2v; 2, 3 -> v + 2; 4, 6 -> v / 2 + 4.
    index = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    codes = (index | (scaled < 0).to(torch.uint8) << 3).reshape(xf.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, bs, g


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., H/2]`` -> 4-bit codes ``uint8 [..., H]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise QuantizationError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., H/2]`` -> E2M1 values ``float32 [..., H]``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return table[unpack_codes(packed).long()]


def dequantize_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``values * (block_scales.float() * global_scale)``, float32 ``[..., H]``."""
    values = unpack_e2m1(packed)
    scale = block_scales.float() * global_scale
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK) * scale.unsqueeze(-1)
    return blocks.reshape(values.shape)


def fake_quant_activation(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize-dequantize activations ``[..., H]`` in dynamic 16-wide blocks under a fixed global scale.

    Equal to ``dequantize_nvfp4(*quantize_nvfp4(x, global_scale))`` for finite input
    (up to the sign of zero); NaN/inf propagate instead of raising.
    """
    check_hidden(x.shape[-1], "activations")
    g = _global_scale(global_scale, "input_scale")
    xf = x.float()
    bs = block_scales(xf, g)
    scaled, scale = _scaled_blocks(xf, bs, g)
    mag = round_e2m1(scaled)
    values = torch.where(scaled < 0, -mag, mag)
    return (values * scale.unsqueeze(-1)).reshape(xf.shape)


# ---- fast exact dequantization (the LM head's per-call path) ---------------------------------------
def fast_dequant_exact(device: torch.device | str = "cpu") -> bool:
    """Whether :func:`dequantize_nvfp4_bits` is exact here (it needs fp32 subnormals; no FTZ/DAZ)."""
    packed = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16)
    bs = torch.full((16, 2), 1.5, device=device).to(FP8_DTYPE)
    g = torch.tensor(0.3, device=device)
    fast = dequantize_nvfp4_bits(packed, bs, g) + 0.0  # + 0.0: -0.0 -> +0.0
    return torch.equal(fast.view(torch.int32), dequantize_nvfp4(packed, bs, g).view(torch.int32))


def dequantize_nvfp4_bits(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`dequantize_nvfp4` of a ``[rows, H/2]`` matrix through integer bit moves.

    Bit-identical (see :func:`fast_dequant_exact`) except that code 8 decodes to -0.0
    instead of +0.0 (equal values; ``+ 0.0`` canonicalizes), and several times faster
    on CPU, where indexing a lookup table is slow. ``out``: optional float32 ``[rows, H]``.
    """
    rows, half = packed.shape
    hidden = 2 * half
    # Each code into the high nibble of its own byte, in element order.
    shifted = torch.empty(rows, half, 2, dtype=torch.uint8, device=packed.device)
    torch.bitwise_left_shift(packed, 4, out=shifted[..., 0])  # uint8: the high nibble falls off
    torch.bitwise_and(packed, 0xF0, out=shifted[..., 1])
    bits = torch.empty(rows, hidden, dtype=torch.int32, device=packed.device) if out is None else out.view(torch.int32)
    bits.copy_(shifted.view(torch.int8).reshape(rows, hidden))
    bits.bitwise_left_shift_(_SHIFT).bitwise_and_(_MASK)
    w = bits.view(torch.float32).view(rows, hidden // BLOCK, BLOCK)
    scale = (block_scales.float() * global_scale).unsqueeze(-1)
    if bool((scale < _SAFE_SCALE).all()):
        # raw * (scale * 2**126) is the exact real value * scale, rounded once.
        w.mul_(scale * _BIAS)
    else:
        w.mul_(_BIAS).mul_(scale)
    return w.view(rows, hidden)


def dequantize_nvfp4_fast(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    if fast_dequant_exact(packed.device):
        return dequantize_nvfp4_bits(packed, block_scales, global_scale, out)
    result = dequantize_nvfp4(packed, block_scales, global_scale)
    return result if out is None else out.copy_(result)
