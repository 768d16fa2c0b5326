"""Dense (bf16 / fp16 / fp32) weights: the unquantized head."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from trtvocab import kernels
from trtvocab.base.dtypes import DTYPES
from trtvocab.base.formats import WeightFormat
from trtvocab.errors import CheckpointError
from trtvocab.weights import deterministic as det
from trtvocab.weights.base import WeightMethod, read_rows, row_blocks, source_label

# The float32 GEMM of DenseWeight.gemm multiplies this many weight elements per call (its row blocks)
# and declares the same rows as its tiles, so a streamed caller keeps the bits.
FLOAT32_BLOCK_ELEMENTS = 1 << 20
# Dense heads in their own dtype (one BLAS call, or the fused kernel): no tile narrower than this
# (or than the whole shard); CPU BLAS gives a column the same bits at these widths.
DENSE_TILE = 128


def _untouched_zeros(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages are not resident until written.

    ``torch.zeros`` memsets, so every page is touched at once; numpy's ``zeros`` uses
    calloc, which for large sizes maps fresh zero pages from the kernel. A head whose
    weights are about to be replaced by the checkpoint's rows then never pays for them.
    """
    nbytes = rows * cols * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).reshape(rows, cols)


def first_nonfinite_row(rows: torch.Tensor, chunk_elements: int = 1 << 18) -> int | None:
    """Index of the first row of ``rows [N, H]`` holding NaN or inf (None: all finite), in chunks
    of about ``chunk_elements`` values, so that the check needs no large boolean temporary
    (a loading rank's peak memory stays near its shard)."""
    chunk = max(1, chunk_elements // max(1, rows.shape[-1]))
    for lo in range(0, rows.shape[0], chunk):
        bad = ~torch.isfinite(rows[lo : lo + chunk]).all(dim=1)
        if bool(bad.any()):
            return lo + int(bad.nonzero()[0])
    return None


class DenseWeight(WeightMethod):
    """The unquantized shard: ``weight [width, H]`` in the head dtype; logits in that dtype.

    ``check_finite`` (default True; set it False on an instance whose caller validated the
    weights already): a weight row with NaN or inf is refused at load with a
    :class:`CheckpointError` naming the tensor and the first bad row (its global token id),
    instead of giving NaN logits and arbitrary token ids.
    """

    weight_format = WeightFormat.DENSE
    check_finite: bool = True

    def __init__(self, shard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        super().__init__(shard, hidden_size, dtype, quant_config)
        self.register_buffer("weight", _untouched_zeros(shard.width, hidden_size, dtype))

    def load(self, tensors: dict[str, Any]) -> None:
        if "weight" not in tensors:
            raise CheckpointError(f"dense LM head: no 'weight' tensor among {sorted(tensors)}")
        extra = sorted(k for k in tensors if k != "weight")
        if extra:
            # A scale next to the weight means the bytes are quantized: reading them as
            # dense numbers would be silently wrong.
            raise CheckpointError(
                f"dense LM head was given quantization tensors {extra}; load it through "
                "LMHead.from_checkpoint (which applies or dequantizes them) or pass a quant_config"
            )
        rows = read_rows(tensors["weight"], "weight", self.shard, (self.hidden_size,))
        if rows.dtype not in DTYPES:
            raise CheckpointError(
                f"weight: dense LM head needs one of {[str(d) for d in DTYPES]}, got {rows.dtype} "
                "(quantized bytes are never read as dense values)"
            )
        if self.check_finite:
            # In the head's dtype: a finite float32 row can overflow a float16 head (65504) when cast.
            cast = rows if rows.dtype == self.dtype else rows.to(self.dtype)
            bad = first_nonfinite_row(cast)
            if bad is not None:
                how = "" if cast is rows or first_nonfinite_row(rows[bad : bad + 1]) is not None else \
                    f" once cast from {rows.dtype} to the head's {self.dtype} (out of its range)"
                raise CheckpointError(f"{source_label(tensors['weight'], 'weight')}: row {self.shard.start + bad} "
                                      f"(token id; row {bad} of this rank's shard [{self.shard.start}, "
                                      f"{self.shard.end})) contains NaN or inf{how}")
            rows = cast
        with torch.no_grad():
            if self._can_adopt(tensors["weight"], rows):
                # The lazy reader handed us a fresh, exactly shard-sized tensor: keep it as
                # the buffer instead of copying it, so loading costs one shard of memory,
                # not two (the untouched initial buffer was never resident).
                self.weight = rows
                return
            self.weight[: self.shard.size].copy_(rows.to(self.dtype))
            self.weight[self.shard.size :].zero_()

    def _can_adopt(self, source: Any, rows: torch.Tensor) -> bool:
        return (
            not isinstance(source, torch.Tensor)  # a caller's tensor is never aliased
            and self.shard.padding == 0
            and rows.dtype == self.dtype
            and rows.device == self.weight.device
            and rows.is_contiguous()
            and rows.storage_offset() == 0
            and rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()
            and tuple(rows.shape) == tuple(self.weight.shape)
        )

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether this call multiplies in the fused dense kernel (bf16 / fp16 / float32, a batch it beats
        torch's GEMM at: :func:`kernels.dense_max_batch`): every logit is then one fixed chain of
        float32 FMAs over H, rounded once to the head dtype, bitwise the same at every batch up to
        that limit, every ``[start, end)`` split and every tp size."""
        # CPU tensors first: dense_max_batch loads (builds) the library for a float32 head.
        return (x.dim() == 2 and kernels.library.on_cpu(x, self.weight)
                and x.dtype == self.weight.dtype and 0 < x.shape[0] <= kernels.dense_max_batch(x.dtype)
                and kernels.usable(x, self.weight))

    def _kernel_logits(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return kernels.dense_logits(kernels.fp8_x(x), self.hidden_size, self.weight[start:end]).to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.shard.size
        if self._kernel(x):
            logits = self._kernel_logits(x, 0, size)
            if not self.shard.padding:
                return logits
            out = x.new_zeros((x.shape[0], self.shard.width))
            out[:, :size] = logits
            return out
        if not self.shard.padding:
            return x @ self.weight.t()
        # Multiply by the owned rows only: the GEMM then has the single-device shape, and
        # BLAS blocks it (and so sums it) exactly as it would the unpadded matrix.
        out = x.new_zeros((x.shape[0], self.shard.width))
        out[:, :size] = x @ self.weight[:size].t()
        return out

    def block_logits(self, prepared: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self._kernel(prepared):
            return self._kernel_logits(prepared, start, end)
        return prepared @ self.weight[start:end].t()

    def gemm_tiles(self, output_dtype: torch.dtype, deterministic: bool) -> list[tuple[int, int]]:
        """The deterministic mode's global vocab tiles (cut at the shard's ends), the float32
        accumulation's row blocks (:data:`FLOAT32_BLOCK_ELEMENTS`), or tiles of at least
        :data:`DENSE_TILE` rows (the last one takes the remainder)."""
        size, start = self.shard.size, self.shard.start
        if size == 0:
            return []
        if deterministic:
            tile = det.tile_of(det.compute_dtype(self.dtype, output_dtype))
            return [(lo - start, hi - start) for _, lo, hi in det.tiles(start, size, tile)]
        if output_dtype != self.dtype:
            return row_blocks(size, self.float32_rows)
        bounds = [i * DENSE_TILE for i in range(max(1, size // DENSE_TILE))] + [size]
        return list(itertools.pairwise(bounds))

    @property
    def float32_rows(self) -> int:
        """Weight rows per GEMM of the float32 accumulation (:data:`FLOAT32_BLOCK_ELEMENTS` elements)."""
        return max(1, FLOAT32_BLOCK_ELEMENTS // self.hidden_size)

    def gemm(self, prepared: torch.Tensor, start: int, end: int, output_dtype: torch.dtype,
             deterministic: bool) -> torch.Tensor:
        """The deterministic vocab tiles (:func:`~trtvocab.weights.deterministic.tiled_logits`), the float32
        accumulation over a lower-precision weight (both operands upcast, one declared tile, or the
        part of it inside ``[start, end)``, at a time), or :meth:`block_logits` in the head dtype."""
        if deterministic:
            return det.tiled_logits(prepared, self.weight[start:end], self.shard.start + start, end - start,
                                    output_dtype)
        if output_dtype == self.dtype:
            return self.block_logits(prepared, start, end)
        xf = prepared.float()
        out = torch.empty(prepared.shape[0], end - start, dtype=torch.float32, device=prepared.device)
        for lo, hi in self.gemm_tiles(output_dtype, deterministic):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                torch.matmul(xf, self.weight[a:b].float().t(), out=out[:, a - start : b - start])
        return out

    def dense_weight(self) -> torch.Tensor:
        return self.weight.float()

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight[: self.shard.size].contiguous()}
