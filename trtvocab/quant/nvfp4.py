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
from trtvocab.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8_bits

BLOCK = 16
E2M1_MAX = 6.0
SCALE_MIN = 2.0**-9  # smallest e4m3 subnormal: a block scale never underflows to 0
# Code -> value; code 8 ("-0") is 0.0, as ModelOpt decodes it.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# A code ``s ee m`` in bits 12..9 of an int16 (sign also in 15..13) becomes, after masking
# bits 15 and 11..9, the fp16 number value * 2**-14: exponent ``000ee``, mantissa MSB ``m``
# (``ee == 0`` -> the fp16 subnormal m * 2**-15, exactly). fp16 -> fp32 is a hardware
# conversion to normal fp32 numbers: the scale multiply never sees a subnormal operand.
_MASK16 = 0x8E00 - (1 << 16)  # as a signed int16
_BIAS16 = 2.0**14


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
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, name: str = "weight",
    scale_search: str = "max", column_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> ``(packed uint8 [..., H/2], block scales e4m3 [..., H/16], global scale fp32)``.

    ``scale_search="mse"`` picks each block scale with :func:`block_scales_mse` instead of
    ``amax / 6`` (ModelOpt's, the default), its squared error weighted per column by
    ``column_weights [H]`` when given; everything else is unchanged.
    """
    if scale_search not in SCALE_SEARCHES:
        raise QuantizationError(f"{name}: scale search must be one of {', '.join(SCALE_SEARCHES)}, "
                                f"got {scale_search!r}")
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
    bs = block_scales(xf, g) if scale_search == "max" else block_scales_mse(xf, g, column_weights=column_weights)
    scaled, _ = _scaled_blocks(xf, bs, g)
    # 0 / 0 can only come from an absurdly small explicit global scale underflowing bs * g.
    mag = torch.nan_to_num(round_e2m1(scaled), nan=0.0)
    # Grid value -> 3-bit index: 0, .5, 1, 1.5 -> 2v; 2, 3 -> v + 2; 4, 6 -> v / 2 + 4.
    index = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    codes = (index | (scaled < 0).to(torch.uint8) << 3).reshape(xf.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, bs, g


# ---- MSE block-scale search -----------------------------------------------------------------------
SCALE_SEARCHES = ("max", "mse")
# Candidate block scales: the e4m3 codes this many steps from the amax / 6 scale's code. An e4m3
# octave holds 8 codes, so -8..+8 sweeps the scale over 0.5x..2x of amax / 6: smaller scales clip
# the block's largest values to 6 and give the rest a finer grid; larger ones move the block onto
# the evenly spaced part of the E2M1 grid (0.5 steps up to 2), which suits evenly spread values.
MSE_CODE_STEPS = tuple(range(-8, 9))
_E4M3_MAX_CODE = 0x7E  # 448; code 0x7F is NaN
# A candidate replaces the incumbent only when its error is smaller by more than float64
# summation noise, so a block's error is never above the amax / 6 scale's, whoever recomputes it.
_MSE_MARGIN = 1e-12


def block_squared_error(x: torch.Tensor, bs: torch.Tensor, global_scale: torch.Tensor,
                        column_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block ``sum_j c_j (x_j - dequant(quant(x))_j)^2`` in float64 for block scales ``bs`` (e4m3
    ``[..., H/16]``), through the same float32 steps as :func:`quantize_nvfp4` and
    :func:`dequantize_nvfp4`; ``c = column_weights [H]`` (default 1: the plain squared error)."""
    scaled, scale = _scaled_blocks(x, bs, global_scale)
    mag = torch.nan_to_num(round_e2m1(scaled), nan=0.0)
    deq = torch.where(scaled < 0, -mag, mag) * scale.unsqueeze(-1)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    sq = (blocks.double() - deq.double()).square()
    if column_weights is not None:
        sq = sq * column_weights.double().reshape(-1, BLOCK)
    return sq.sum(-1)


def block_scales_mse(x: torch.Tensor, global_scale: torch.Tensor, steps: tuple[int, ...] = MSE_CODE_STEPS,
                     column_weights: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 block scales of ``x [..., H]`` (float32) minimizing each 16-block's squared error after FP4
    rounding, among the codes ``steps`` away from :func:`block_scales`'s (which is always a candidate
    and wins ties: no block gets a larger error than with the plain scale).

    ``column_weights [H]`` (>= 0) weights each column's squared error: with the calibration
    activations' mean square ``E[h_j^2]`` it is the block's share of the logit error
    ``E[(h . dw)^2]`` when activation channels are uncorrelated (the diagonal of the Hessian).
    """
    g = torch.as_tensor(global_scale).float().reshape(())
    if column_weights is not None:
        column_weights = torch.as_tensor(column_weights).double().reshape(-1)
        if column_weights.shape[0] != x.shape[-1] or not bool(torch.isfinite(column_weights).all()) \
                or bool((column_weights < 0).any()):
            raise QuantizationError(f"column weights: expected {x.shape[-1]} finite values >= 0, got "
                                    f"{list(column_weights.shape)}")
    best = block_scales(x, g)
    best_err = block_squared_error(x, best, g, column_weights)
    base_code = best.view(torch.uint8).to(torch.int16)
    for step in steps:
        if step == 0:
            continue
        code = (base_code + step).clamp(1, _E4M3_MAX_CODE)
        cand = code.to(torch.uint8).view(FP8_DTYPE)
        err = block_squared_error(x, cand, g, column_weights)
        better = err < best_err * (1.0 - _MSE_MARGIN)
        best = torch.where(better, cand.view(torch.uint8), best.view(torch.uint8)).view(FP8_DTYPE)
        best_err = torch.where(better, err, best_err)
    return best


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
    """Whether the bit-move dequantization is exact here (IEEE fp16 subnormals; a few µs)."""
    packed = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16)
    bs = torch.full((16, 2), 1.5, device=device).to(FP8_DTYPE)
    g = torch.tensor(0.3, device=device)
    fast = dequantize_nvfp4_bits(packed, bs, g) + 0.0  # + 0.0: -0.0 -> +0.0
    return torch.equal(fast.view(torch.int32), dequantize_nvfp4(packed, bs, g).view(torch.int32))


def fast_path_ok(global_scale: torch.Tensor) -> bool:
    """Whether the bit-move path is exact for this global scale: ``bs * g * 2**14`` stays finite."""
    return bool(global_scale < 2.0**100) and fast_dequant_exact(global_scale.device)


# Block-major order: within each row, byte k of 16-block b (``packed[8 * b + k]``) moves to
# ``k * (H / 16) + b``. Decoding it yields columns ordered (nibble h, byte k, block b), so a
# block's scale is broadcast along the contiguous block axis (fast) instead of along runs of
# 8 values. Any column order works for the GEMM as long as x is permuted alike.
def to_block_major(packed: torch.Tensor) -> torch.Tensor:
    """Packed ``[rows, H/2]`` in checkpoint order -> block-major order (a per-row byte permutation)."""
    rows, half = packed.shape
    return packed.view(rows, half // 8, 8).transpose(1, 2).reshape(rows, half)


def from_block_major(packed_bm: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_block_major`."""
    rows, half = packed_bm.shape
    return packed_bm.view(rows, 8, half // 8).transpose(1, 2).reshape(rows, half)


def block_major_columns(x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` in the column order of :func:`decode_block_major`: element ``16b + 2k + h`` -> (h, k, b)."""
    *lead, hidden = x.shape
    blocks = x.reshape(*lead, hidden // BLOCK, BLOCK // 2, 2)
    return blocks.permute(*range(len(lead)), -1, -2, -3).reshape(*lead, hidden)


def decode_block_major(
    packed_bm: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize block-major packed rows into float32 ``[rows, H]`` in (h, k, b) column order.

    Every value equals :func:`dequantize_nvfp4`'s (exact, given :func:`fast_path_ok`),
    except that code 8 decodes to -0.0 instead of +0.0. ``out`` float32 and ``work``
    int16 ``[rows, H]`` buffers are optional.
    """
    rows, half = packed_bm.shape
    hidden = 2 * half
    bits = torch.empty(rows, hidden, dtype=torch.int16, device=packed_bm.device) if work is None else work
    low, high = bits[:, :half], bits[:, half:]
    high.copy_(packed_bm.view(torch.int8))  # sign-extends: the high nibble's sign fills bits 15..8
    torch.bitwise_left_shift(high, 12, out=low)  # low nibble -> bits 15..12
    low.bitwise_right_shift_(3)  # arithmetic: -> bits 12..9, its sign copied into 15..13
    high.bitwise_left_shift_(5)  # high nibble (bits 7..4) -> bits 12..9
    bits.bitwise_and_(_MASK16)
    w = torch.empty(rows, hidden, dtype=torch.float32, device=packed_bm.device) if out is None else out
    w.copy_(bits.view(torch.float16))  # value * 2**-14
    # Per-block scale fl(bs * g), exactly, then * 2**14 (exact): one rounding of value * scale.
    scale = dequantize_fp8_bits(block_scales, global_scale).mul_(_BIAS16)
    w.view(rows, BLOCK, hidden // BLOCK).mul_(scale.view(rows, 1, hidden // BLOCK))
    return w


def dequantize_nvfp4_bits(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`dequantize_nvfp4` through :func:`decode_block_major`, back in element order."""
    decoded = decode_block_major(to_block_major(packed), block_scales, global_scale)
    return block_major_to_elements(decoded, out)


def block_major_to_elements(decoded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Columns in (h, k, b) order (:func:`decode_block_major`) -> element order, ``[rows, H]``."""
    rows, hidden = decoded.shape
    w = torch.empty_like(decoded) if out is None else out
    w.view(rows, hidden // BLOCK, BLOCK // 2, 2).copy_(
        decoded.view(rows, 2, BLOCK // 2, hidden // BLOCK).permute(0, 3, 2, 1))
    return w


def dequantize_nvfp4_fast(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Bit-identical to :func:`dequantize_nvfp4` up to the sign of zero, faster on CPU."""
    if fast_path_ok(global_scale):
        return dequantize_nvfp4_bits(packed, block_scales, global_scale, out)
    result = dequantize_nvfp4(packed, block_scales, global_scale)
    return result if out is None else out.copy_(result)
