"""A head kept in its GGUF blocks (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K): the shard's raw rows of blocks,
multiplied in place.

A vocab shard is whole rows of blocks (blocks run along H), read with one positioned read
(:meth:`~trtvocab.checkpoints.gguf.GGUFRows.raw_rows`); resident bytes are the stored bytes. The
weight is ``gguf.quants.dequantize``'s value and each logit the float32 chain of
:mod:`trtvocab.quant.gguf_blocks`: the fused kernel where it builds, else the torch chain (the same
bits). docs/architecture.md, "GGUF heads in their stored blocks".
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import kernels
from trtvocab.base.formats import WeightFormat
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.sharding import VocabShard
from trtvocab.quant import gguf_blocks as gb
from trtvocab.weights.base import WeightMethod, read_rows, row_blocks, source_label

DEQUANT_ROWS_ELEMENTS = 1 << 20  # float32 values per dequantized chunk (dense_weight, the torch path)


class GGUFWeight(WeightMethod):
    """``uint8 [width, H / block * type_size]``: the shard's rows of GGUF blocks as stored."""

    weight_format = WeightFormat.GGUF_Q8_0  # per instance: set from the config in __init__

    def __init__(self, shard: VocabShard, hidden_size: int, dtype: torch.dtype, quant_config: Any = None):
        if not isinstance(quant_config, gb.GGUFConfig):
            raise QuantizationError(f"GGUFWeight needs a GGUFConfig, got {quant_config!r}")
        super().__init__(shard, hidden_size, dtype, quant_config)
        self.weight_format = quant_config.weight_format
        self.block_type = quant_config.block_type
        self.row_bytes = quant_config.row_bytes(hidden_size)
        self.register_buffer("blocks", torch.zeros(shard.width, self.row_bytes, dtype=torch.uint8))

    # ---- loading ---------------------------------------------------------------------------------
    def load(self, tensors: dict[str, Any]) -> None:
        value = tensors.get("weight")
        if value is None:
            raise CheckpointError(f"GGUF {self.block_type} head: no 'weight' tensor; got {sorted(tensors)}")
        rows = self._stored_rows(value)
        self._check_scales(rows, value)
        with torch.no_grad():
            self.blocks[: self.shard.size].copy_(rows)
            self.blocks[self.shard.size :].zero_()

    def _check_scales(self, rows: torch.Tensor, value: Any) -> None:
        """Refuse a NaN / inf fp16 block scale (``d``, ``m``, ``dmin``), naming the file, the tensor and the
        token: the kernel and the torch chain would multiply it into every logit of that token (the dense
        path's rule for NaN / inf weights; docs/threat_model.md, "Numbers")."""
        bad = gb.first_nonfinite_scale(rows, self.block_type)
        if bad is None:
            return
        row, block, name, scale = bad
        where = source_label(value, "weight")
        values = self.quant_config.block
        raise CheckpointError(f"{where}: token {self.shard.start + row}, block {block} (values "
                              f"[{block * values}, {(block + 1) * values})): the {self.block_type} fp16 block scale "
                              f"{name} is {scale} (a GGUF head's block scales must be finite)")

    def _stored_rows(self, value: Any) -> torch.Tensor:
        info = getattr(value, "info", None)
        if info is not None and hasattr(value, "raw_rows"):  # a GGUF tensor: this shard's bytes only
            qtype = getattr(info.ggml_type, "name", None)
            if qtype != self.block_type:
                raise CheckpointError(f"{info.gguf_name}: stored as {qtype}, the head is GGUF {self.block_type}")
            if tuple(info.shape) != (self.shard.vocab_size, self.hidden_size):
                raise CheckpointError(f"{info.gguf_name}: shape {list(info.shape)}, expected "
                                      f"[{self.shard.vocab_size}, {self.hidden_size}]")
            return value.raw_rows(self.shard.start, self.shard.end)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise CheckpointError(f"GGUF {self.block_type} head: 'weight' must be a GGUF tensor or uint8 rows of "
                                  f"blocks, got {type(value).__name__}"
                                  + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else ""))
        return read_rows(value, "weight", self.shard, (self.row_bytes,))

    # ---- multiply --------------------------------------------------------------------------------
    @property
    def rows_per_chunk(self) -> int:
        """Rows per torch-path chunk (also the vocab-chunked decode's tile)."""
        return max(1, DEQUANT_ROWS_ELEMENTS // self.hidden_size)

    def gemm_tiles(self, output_dtype: torch.dtype, deterministic: bool) -> list[tuple[int, int]]:
        """The torch path's row blocks (:attr:`rows_per_chunk`); the block chain is tp/batch-invariant."""
        return row_blocks(self.shard.size, self.rows_per_chunk)

    def dequantize(self, start: int, end: int) -> torch.Tensor:
        """float32 ``[end - start, H]`` of local rows (``gguf.quants.dequantize``'s values)."""
        return gb.DEQUANTIZE[self.block_type](self.blocks[start:end])

    def prepare(self, x: torch.Tensor) -> torch.Tensor | kernels.FusedInput:
        xf = x.float().contiguous()
        if kernels.usable(xf, self.blocks):
            return kernels.FusedInput(xf)
        return xf

    def block_logits(self, prepared: torch.Tensor | kernels.FusedInput, start: int, end: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        if not 0 <= start <= end <= self.shard.size:
            raise ValueError(f"block_logits: rows [{start}, {end}) outside this shard's [0, {self.shard.size})")
        if isinstance(prepared, kernels.FusedInput):
            return kernels.gguf_logits(prepared.x, self.hidden_size, self.block_type, self.blocks[start:end], out)
        x = prepared
        if out is None:
            out = torch.empty(x.shape[0], end - start, dtype=torch.float32, device=x.device)
        step = self.rows_per_chunk
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            gb.chain_logits(x, self.dequantize(lo, hi), out[:, lo - start : hi - start])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.shard.width, dtype=torch.float32, device=x.device)
        if x.shape[0]:
            self.block_logits(self.prepare(x), 0, self.shard.size, out=out[:, : self.shard.size])
        return out

    def dense_weight(self) -> torch.Tensor:
        out = torch.empty(self.shard.width, self.hidden_size, dtype=torch.float32)
        step = self.rows_per_chunk
        for a in range(0, self.shard.width, step):
            b = min(a + step, self.shard.width)
            out[a:b] = self.dequantize(a, b)
        return out

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, H]`` of local rows ``index`` (the embedding's lookup: exact ``d * q``)."""
        return gb.DEQUANTIZE[self.block_type](self.blocks[index])

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.blocks[: self.shard.size]}
