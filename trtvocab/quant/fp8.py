"""FP8 E4M3 (``float8_e4m3fn``) numerics of the LM head.

Per-tensor: ``scale = amax / 448`` (fp32), ``q = e4m3(clamp(x / scale, -448, 448))``,
bit-identical to ``modelopt.torch.quantization.qtensor.FP8QTensor.quantize`` on
float32 input (bf16/fp16 input is upcast first: the scale is an fp32 number, so
it is computed in fp32). Per-row (an option beyond the checkpoint format) keeps
one scale per vocab row, ``[V, 1]``.

Dequantization is ``q.float() * scale``. :func:`dequantize_fp8_fast` gives the
same bits through integer moves because torch's fp8 -> fp32 cast is a slow scalar
loop on CPU; the LM head dequantizes per call, chunk by chunk, with it.
"""

from __future__ import annotations

import torch

from trtvocab.errors import QuantizationError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# An e4m3 byte ``s eeee mmm`` sign-extended to int16 and shifted left by 7 puts the sign
# at bit 15 and ``eeee mmm`` at bits 13..7: fp16 exponent ``0eeee`` and mantissa ``mmm``,
# i.e. the fp16 number q * 2**-8 (e4m3 subnormals become fp16 subnormals, exactly). The
# mask clears bit 14, a sign-extension copy. fp16 -> fp32 is a hardware conversion that
# yields normal fp32 numbers, so the scale multiply never sees a (slow) subnormal operand.
_SHIFT16 = 7
_MASK16 = 0xBF80 - (1 << 16)  # as a signed int16
_BIAS16 = 2.0**8
MAX_FAST_SCALE = 2.0**119  # scale * 2**8 stays a finite fp32 below this


def _as_float_scale(scale: torch.Tensor | float, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(scale)
    if not tensor.dtype.is_floating_point or tensor.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise QuantizationError(f"{name}: expected a float32 scale, got {tensor.dtype}")
    tensor = tensor.float()
    if not bool(torch.isfinite(tensor).all()) or not bool((tensor > 0).all()):
        raise QuantizationError(f"{name}: scales must be finite and > 0")
    return tensor


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in fp32; an all-zero tensor (or one whose scale underflows) gets 1.0, not 0."""
    scale = amax.float() / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(
    w: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    per_row: bool = False,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> ``(fp8 tensor, fp32 scale)``; scale is a 0-d tensor, or ``[rows, 1]`` per row."""
    if not w.dtype.is_floating_point:
        raise QuantizationError(f"{name}: cannot FP8-quantize a {w.dtype} tensor")
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"{name}: holds NaN or inf; refusing to quantize it")
    if scale is None:
        if per_row:
            if x.dim() != 2:
                raise QuantizationError(f"{name}: per-row FP8 needs a 2-D tensor, got {list(x.shape)}")
            amax = x.abs().amax(dim=1, keepdim=True)
        else:
            amax = x.abs().amax()
        scale = fp8_scale_from_amax(amax)
    else:
        scale = _as_float_scale(scale, f"{name} scale")
        if per_row:
            scale = scale.reshape(-1, 1)
            if x.dim() != 2 or scale.shape[0] != x.shape[0]:
                raise QuantizationError(f"{name}: per-row scale of {scale.shape[0]} rows for shape {list(x.shape)}")
        elif scale.numel() != 1:
            raise QuantizationError(f"{name}: per-tensor scale must be a scalar, got {list(scale.shape)}")
        else:
            scale = scale.reshape(())
    return fake_cast(x / scale), scale


def fake_cast(x: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x, -448, 448))``: clamped first, whatever the cast would do past 448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` (the reference definition)."""
    return q.float() * scale


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize ``x`` (float32) with a per-tensor scale: the activation path."""
    return fake_cast(x / scale).float() * scale


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor activation scale ``amax(|x|) / 448`` over the whole input (1.0 if all zero)."""
    return fp8_scale_from_amax(x.abs().amax())


def has_nan_codes(q: torch.Tensor) -> bool:
    """Whether an e4m3fn tensor holds a NaN byte (``x1111111``)."""
    return bool(((q.view(torch.uint8) & 0x7F) == 0x7F).any())


def fast_dequant_exact(device: torch.device | str = "cpu") -> bool:
    """Whether :func:`dequantize_fp8_bits` is exact here (a few µs; call once per forward).

    It is on IEEE hardware; the check guards against conversions that flush fp16
    subnormals (e.g. a denormals-are-zero mode).
    """
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8_DTYPE)
    scale = torch.tensor(0.75, device=device)
    return torch.equal(dequantize_fp8_bits(codes, scale), codes.float() * scale)


def dequantize_fp8_bits(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, work: torch.Tensor | None = None
) -> torch.Tensor:
    """``q.float() * scale`` through integer bit moves and an fp16 -> fp32 conversion.

    Exact for NaN-free ``q`` and ``scale < MAX_FAST_SCALE`` (the caller checks, once):
    ``(q * 2**-8) * (scale * 2**8)`` is the real ``q * scale`` rounded once. ``scale``:
    0-d or broadcastable (``[rows, 1]``); ``out`` float32 and ``work`` int16 buffers of
    ``q``'s shape are optional.
    """
    bits = torch.empty(q.shape, dtype=torch.int16, device=q.device) if work is None else work
    bits.copy_(q.view(torch.int8))
    bits.bitwise_left_shift_(_SHIFT16).bitwise_and_(_MASK16)
    w = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out is None else out
    w.copy_(bits.view(torch.float16))
    return w.mul_(scale * _BIAS16)


def fast_path_ok(scale: torch.Tensor) -> bool:
    """Whether :func:`dequantize_fp8_bits` is exact for these scales on their device."""
    return bool((scale < MAX_FAST_SCALE).all()) and fast_dequant_exact(scale.device)


def dequantize_fp8_fast(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bit-identical to :func:`dequantize_fp8` (no NaN codes), several times faster on CPU."""
    if fast_path_ok(scale):
        return dequantize_fp8_bits(q, scale, out)
    result = dequantize_fp8(q, scale)
    return result if out is None else out.copy_(result)
