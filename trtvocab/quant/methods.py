"""The quantized LM-head weight formats: FP8 and NVFP4, kept quantized in memory.

Each rank holds its ``[width, H]`` shard as stored in a ModelOpt checkpoint
(DESIGN §4) and, per call, dequantizes it chunk by chunk (``CHUNK_ELEMENTS``
float32 values at a time, so the temporary stays a few MiB) into the GEMM::

    FP8    W = w_fp8.float() * weight_scale                     ([width, 1] per row)
    NVFP4  W = e2m1(w) * (weight_scale.float() * weight_scale_2) per 16-wide block
    x_dq   FP8: "static"  e4m3(clamp(x / input_scale)) * input_scale
                "dynamic" the same with amax(|x|) / 448 over the whole [N, H] input
           NVFP4: "static" (W4A4) dynamic 16-wide blocks under input_scale
           "none" (W8A16 / W4A16): x.float()
    logits = x_dq @ W.T   float32 [N, width]

The ONNX export implements the same contract from :meth:`export_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trtvocab.checkpoint import ST_DTYPES
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.quant import fp8, nvfp4
from trtvocab.quant.config import QuantAlgo, QuantConfig
from trtvocab.sharding import VocabShard
from trtvocab.weights.base import WeightMethod, read_all, read_rows, read_scalar, register, source_shape

# float32 values dequantized per GEMM chunk (4 MiB + a 2 MiB int16 scratch): large enough that
# the ~10 torch calls per chunk cost little, small enough to stay in cache.
CHUNK_ELEMENTS = 1 << 20
Dequantizer = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
PREFIX = "lm_head."  # quantized heads are never the tied embedding, so errors can name lm_head.*


def _dtype_of(value: Any) -> torch.dtype | str:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if hasattr(value, "info"):  # trtvocab.checkpoint.LazyRows
        return value.info.torch_dtype
    if hasattr(value, "get_dtype"):  # a safetensors slice: its dtype tag
        tag = str(value.get_dtype())
        return ST_DTYPES.get(tag, tag)
    raise CheckpointError(f"expected a torch.Tensor or a safetensors slice, got {type(value).__name__}")


def _fp32_scalar(tensors: dict[str, Any], key: str) -> torch.Tensor:
    name = PREFIX + key
    value = tensors[key]
    tensor = read_all(value)
    if tensor.dtype != torch.float32:
        raise QuantizationError(f"{name}: expected a float32 scale, got {tensor.dtype}")
    return read_scalar(tensor, name)


def _require(tensors: dict[str, Any], key: str, why: str) -> Any:
    if key not in tensors:
        raise QuantizationError(f"{PREFIX}{key} is missing ({why}); got {sorted(PREFIX + k for k in tensors)}")
    return tensors[key]


class _QuantizedWeight(WeightMethod):
    """Chunked ``x_dq @ W.T`` shared by the formats; subclasses dequantize rows and quantize inputs."""

    algo: QuantAlgo
    activations: tuple[str, ...]

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        if not isinstance(quant_config, QuantConfig) or quant_config.quant_algo is not self.algo:
            raise QuantizationError(f"{type(self).__name__} needs a QuantConfig with quant_algo {self.algo.value}, "
                                    f"got {quant_config!r}")
        if quant_config.activation not in self.activations:
            raise QuantizationError(f"{self.algo.value} LM head: activation must be one of {self.activations}, "
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

    # -- shared -------------------------------------------------------------------------------
    @property
    def rows_per_chunk(self) -> int:
        return max(1, CHUNK_ELEMENTS // self.hidden_size)

    def _device(self) -> torch.device:
        return next(self.buffers()).device

    def _scratch(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(0, min(self.rows_per_chunk, rows))
        return (torch.empty(rows, self.hidden_size, dtype=torch.float32, device=device),
                torch.empty(rows, self.hidden_size, dtype=torch.int16, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.shard.width, dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        gemm_x, dequant = self._plan(self.quantize_input(x))
        size, step = self.shard.size, self.rows_per_chunk
        buffer, work = self._scratch(size, x.device)
        for start in range(0, size, step):
            end = min(start + step, size)
            w = dequant(start, end, buffer[: end - start], work[: end - start])
            torch.matmul(gemm_x, w.t(), out=out[:, start:end])
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
        if self.activation == "static":
            _require(tensors, "input_scale", "static activation quantization needs it")
            self.input_scale.copy_(_fp32_scalar(tensors, "input_scale"))


@register("FP8")
class FP8Weight(_QuantizedWeight):
    """``float8_e4m3fn [width, H]`` + fp32 ``weight_scale`` (scalar, or ``[width, 1]`` per row)."""

    format_name = "FP8"
    algo = QuantAlgo.FP8
    activations = ("static", "dynamic", "none")

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        super().__init__(shard, hidden_size, dtype, quant_config)
        self.per_row = quant_config.granularity == "per_row"
        self.register_buffer("weight", torch.zeros(shard.width, hidden_size, dtype=fp8.FP8_DTYPE))
        self.register_buffer("weight_scale", torch.ones(shard.width, 1) if self.per_row else torch.ones(()))
        self.register_buffer("input_scale", torch.ones(()) if self.activation == "static" else None)

    def load(self, tensors: dict[str, Any]) -> None:
        if "weight_scale_2" in tensors:
            raise CheckpointError(f"{PREFIX}weight_scale_2 belongs to NVFP4, but the head is configured as FP8")
        weight = read_rows(_require(tensors, "weight", "the head's matrix"), PREFIX + "weight", self.shard,
                           (self.hidden_size,))
        if weight.dtype != fp8.FP8_DTYPE:
            raise CheckpointError(f"{PREFIX}weight: an FP8 head needs float8_e4m3fn, got {weight.dtype}")
        if fp8.has_nan_codes(weight):
            raise QuantizationError(f"{PREFIX}weight: holds FP8 NaN codes")
        scale = self._read_scale(_require(tensors, "weight_scale", "FP8 weights need their scale"))
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
            return _fp32_scalar({"weight_scale": value}, "weight_scale")
        shape = source_shape(value)
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise QuantizationError(f"{name}: per-row FP8 expects shape [V] or [V, 1], got {list(shape)}")
        if _dtype_of(value) != torch.float32:
            raise QuantizationError(f"{name}: expected float32 scales, got {_dtype_of(value)}")
        rows = read_rows(value, name, self.shard, tuple(shape[1:])).reshape(-1, 1)
        if not bool(torch.isfinite(rows).all()) or not bool((rows > 0).all()):
            raise QuantizationError(f"{name}: per-row scales must be finite and > 0")
        return rows

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.activation == "none":
            return xf
        scale = self.input_scale if self.activation == "static" else fp8.dynamic_scale(xf)
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

    def export_tensors(self) -> dict[str, torch.Tensor]:
        size = self.shard.size
        out = {
            "weight": self.weight[:size],
            "weight_scale": self.weight_scale[:size].reshape(size) if self.per_row else self.weight_scale,
        }
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out


@register("NVFP4")
class NVFP4Weight(_QuantizedWeight):
    """Packed ``uint8 [width, H/2]`` + e4m3 block scales ``[width, H/16]`` + fp32 ``weight_scale_2``.

    The packed bytes live in ``packed_block_major`` (a per-row byte permutation, see
    :func:`~trtvocab.quant.nvfp4.to_block_major`); :meth:`export_tensors` returns them in
    checkpoint order.
    """

    format_name = "NVFP4"
    algo = QuantAlgo.NVFP4
    activations = ("static", "none")

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
        self.register_buffer("input_scale", torch.ones(()) if self.activation == "static" else None)

    def load(self, tensors: dict[str, Any]) -> None:
        hidden = self.hidden_size
        packed_src = _require(tensors, "weight", "the head's matrix")
        shape = source_shape(packed_src)
        if len(shape) != 2 or shape[1] != hidden // 2:
            raise CheckpointError(f"{PREFIX}weight: packed FP4 must be [V, H/2] = [*, {hidden // 2}] "
                                  f"for hidden size {hidden}, got {list(shape)}")
        packed = read_rows(packed_src, PREFIX + "weight", self.shard, (hidden // 2,))
        if packed.dtype != torch.uint8:
            raise CheckpointError(f"{PREFIX}weight: an NVFP4 head needs packed uint8, got {packed.dtype}")
        # Rows of the packed weight and of its block scales are sliced together.
        scales_src = _require(tensors, "weight_scale", "NVFP4 needs its per-block scales")
        if _dtype_of(scales_src) != fp8.FP8_DTYPE:
            raise QuantizationError(f"{PREFIX}weight_scale: NVFP4 block scales must be float8_e4m3fn, "
                                    f"got {_dtype_of(scales_src)}")
        blocks = hidden // nvfp4.BLOCK
        if len(source_shape(scales_src)) != 2 or source_shape(scales_src)[1] != blocks:
            raise QuantizationError(f"{PREFIX}weight_scale: expected block scales [V, H/16] = [*, {blocks}], "
                                    f"got {list(source_shape(scales_src))}")
        scales = read_rows(scales_src, PREFIX + "weight_scale", self.shard, (blocks,))
        bits = scales.view(torch.uint8)
        if bool(((bits & 0x7F) == 0x7F).any()) or bool((scales.float() <= 0).any()):
            raise QuantizationError(f"{PREFIX}weight_scale: block scales must be finite and > 0 "
                                    "(found NaN, zero or negative)")
        global_scale = _fp32_scalar({"weight_scale_2": _require(tensors, "weight_scale_2", "NVFP4 global scale")},
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
        if self.activation == "none":
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


# ---- helpers for the loader and for writing quantized heads -----------------------------------------
def dequantize_stored(algo: QuantAlgo, tensors: dict[str, Any], shard: VocabShard, hidden: int) -> torch.Tensor:
    """Exact float32 ``[shard.size, H]`` of this shard's rows of a head stored as ``algo``.

    Used when a quantized head must run dense (DESIGN §1.5): the stored scales are
    applied, never dropped, and the same validation as a quantized load runs.
    """
    if algo is QuantAlgo.FP8:
        scale = tensors.get("weight_scale")
        per_row = scale is not None and len(source_shape(scale)) > 0 and max(source_shape(scale)) > 1
        config = QuantConfig(quant_algo=algo, activation="none",
                             granularity="per_row" if per_row else "per_tensor")
        method: _QuantizedWeight = FP8Weight(shard, hidden, torch.float32, config)
    elif algo is QuantAlgo.NVFP4:
        method = NVFP4Weight(shard, hidden, torch.float32, QuantConfig(quant_algo=algo, activation="none"))
    else:
        raise QuantizationError(f"cannot dequantize a head stored as {algo.value}; supported: FP8, NVFP4")
    method.load({k: v for k, v in tensors.items() if k != "input_scale"})
    return method.dense_weight()[: shard.size]


def quantize_head_tensors(
    weight: torch.Tensor,
    quant_config: QuantConfig,
    input_amax: float | torch.Tensor | None = None,
    chunk_rows: int = 4096,
) -> dict[str, torch.Tensor]:
    """A dense ``[V, H]`` head -> checkpoint tensors (``weight``, scales) in the ModelOpt layout.

    Works through ``chunk_rows`` rows at a time so a large head needs no full float32
    copy. ``input_amax`` (calibrated ``amax(|x|)``) gives ``input_scale`` for static
    activations: ``amax / 448`` (FP8) or ``amax / (6 * 448)`` (NVFP4).
    """
    if weight.dim() != 2:
        raise QuantizationError(f"weight: expected [V, H], got {list(weight.shape)}")
    static = quant_config.activation == "static"
    if static and input_amax is None:
        raise QuantizationError("static activation quantization needs input_amax (the calibrated amax of inputs)")
    amax = weight.abs().amax().float()
    chunks = range(0, weight.shape[0], chunk_rows)
    out: dict[str, torch.Tensor] = {}
    if quant_config.quant_algo is QuantAlgo.FP8:
        per_row = quant_config.granularity == "per_row"
        pieces = [fp8.quantize_fp8(weight[s : s + chunk_rows], None if per_row else fp8.fp8_scale_from_amax(amax),
                                   per_row=per_row) for s in chunks]
        out["weight"] = torch.cat([q for q, _ in pieces])
        out["weight_scale"] = torch.cat([s.reshape(-1) for _, s in pieces]) if per_row else pieces[0][1]
        if static:
            out["input_scale"] = fp8.fp8_scale_from_amax(torch.as_tensor(input_amax))
    elif quant_config.quant_algo is QuantAlgo.NVFP4:
        g = nvfp4.global_scale_from_amax(amax)
        pieces4 = [nvfp4.quantize_nvfp4(weight[s : s + chunk_rows], g) for s in chunks]
        out["weight"] = torch.cat([p for p, _, _ in pieces4])
        out["weight_scale"] = torch.cat([b for _, b, _ in pieces4])
        out["weight_scale_2"] = g
        if static:
            out["input_scale"] = nvfp4.global_scale_from_amax(torch.as_tensor(input_amax))
    else:
        raise QuantizationError(f"cannot quantize the LM head to {quant_config.quant_algo.value}")
    return out
