"""A head GEMM whose every logit is computed the same way whatever the batch, tp size or layout.

A CPU BLAS picks its kernel (and so the summation order of each dot product) by the shape of
the call: a GEMV for one row, other blockings for a few rows, and a shard's column count differs
with the tp size (with MKL, float32: a row's logits differ between a batch of 1 and of 4, and
between a shard of 1365 columns and the full vocab). So the deterministic path calls the GEMM
with one fixed shape only::

    columns   global vocab tiles [t * TILE, (t + 1) * TILE), a cut tile zero-padded in place
    float32   rows in blocks of ROW_BLOCK: each call torch.mm [ROW_BLOCK, H] x [H, TILE]
    bf16/fp16 one row at a time: each call torch.mv [HALF_TILE, H] x [H] (the GEMV kernel)

A logit then depends only on its row and its token's column, never on the neighbours. Full
tiles are views of the stored weight (no copy); at most two tiles per shard are padded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# ---- the fixed shapes, in detail ------------------------------------------------------------------
# columns: a tile keeps its place in the vocabulary at every tp size; where a shard boundary cuts a
# tile, the rank's part sits at its place in a zero-padded tile. float32: the last ROW_BLOCK block is
# padded with zero rows. bf16 / fp16 go one row at a time because CPU half-precision GEMMs of a few
# rows are several times slower than the GEMV. The same kernel, the same order, for every logit.


ROW_BLOCK = 8  # float32: rows go through torch.mm in blocks of this many (the last one zero-padded)
TILE = 2048  # float32 vocab tile
HALF_TILE = 4096  # bf16 / fp16 vocab tile: one torch.mv per row and tile (the GEMV kernel)


def tiles(start: int, size: int, tile: int) -> Iterator[tuple[int, int, int]]:
    """``(tile index, first owned id, end owned id)`` of the global tiles that ``[start, start + size)`` meets."""
    for t in range(start // tile, (start + size - 1) // tile + 1):
        yield t, max(t * tile, start), min((t + 1) * tile, start + size)


def compute_dtype(in_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
    """What the tiles multiply in: float32 for a float32 output (both operands upcast), else the input's."""
    return torch.float32 if out_dtype == torch.float32 else in_dtype


def tile_of(compute: torch.dtype) -> int:
    """The vocab tile of ``compute``: :data:`TILE` for float32, :data:`HALF_TILE` for bf16 / fp16."""
    return TILE if compute == torch.float32 else HALF_TILE


def _tile_weight(weight: torch.Tensor, start: int, t: int, lo: int, hi: int, tile: int,
                 compute: torch.dtype) -> torch.Tensor:
    """The ``[tile, H]`` weight of global tile ``t``: a view where the rank owns all of it, else
    its owned rows at their places in a zero tile."""
    if lo == t * tile and hi - lo == tile:
        return weight[lo - start : hi - start].to(compute)
    w = torch.zeros(tile, weight.shape[1], dtype=compute, device=weight.device)
    w[lo - t * tile : hi - t * tile] = weight[lo - start : hi - start]
    return w


def tiled_logits(x: torch.Tensor, weight: torch.Tensor, start: int, size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [N, H] @ weight[:size].T`` as ``[N, size]`` in ``out_dtype``, with one fixed call shape.

    ``weight`` holds the shard's rows (token ids ``start .. start + size``). float32 compute
    (a float32 head, or ``out_dtype`` float32 over a half-precision one: both operands upcast,
    the float32 accumulation) runs ``torch.mm`` on ``[ROW_BLOCK, H] x [H, TILE]``;
    half-precision compute runs ``torch.mv`` on ``[HALF_TILE, H] x [H]`` per row (at one row
    the GEMV is what the default path uses too, so the mode costs little there).
    """
    rows, hidden = x.shape
    compute = compute_dtype(x.dtype, out_dtype)
    out = torch.empty(rows, size, dtype=out_dtype, device=x.device)
    if compute != torch.float32:
        xc = x.to(compute)
        for t, lo, hi in tiles(start, size, tile_of(compute)):
            w = _tile_weight(weight, start, t, lo, hi, HALF_TILE, compute)
            column = torch.empty(HALF_TILE, dtype=compute, device=x.device)
            for r in range(rows):
                torch.mv(w, xc[r], out=column)
                out[r, lo - start : hi - start] = column[lo - t * HALF_TILE : hi - t * HALF_TILE]
        return out
    xb = torch.zeros(-(-rows // ROW_BLOCK) * ROW_BLOCK, hidden, dtype=compute, device=x.device)
    xb[:rows] = x.to(compute)
    for t, lo, hi in tiles(start, size, tile_of(compute)):
        wt = _tile_weight(weight, start, t, lo, hi, TILE, compute).t()
        cols = slice(lo - t * TILE, hi - t * TILE)
        for r in range(0, rows, ROW_BLOCK):
            n = min(ROW_BLOCK, rows - r)
            out[r : r + n, lo - start : hi - start] = torch.mm(xb[r : r + ROW_BLOCK], wt)[:n, cols]
    return out
