"""A head GEMM whose every logit is computed the same way whatever the batch, tp size or layout.

A CPU BLAS picks its kernel (and so the summation order of each dot product) by the shape
of the call: a GEMV for one row, other blockings for a few rows, and the column count of a
shard differs with the tp size. Measured here (MKL, float32): a row's logits differ
between a batch of 1 and a batch of 4, and between a shard of 1365 columns and the full
vocab. So the deterministic path calls the GEMM with one fixed shape only::

    rows     in blocks of ROW_BLOCK (the last block padded with zero rows)
    columns  in global vocab tiles [t * TILE, (t + 1) * TILE): a tile keeps its place in the
             vocabulary at every tp size; where a shard boundary cuts a tile, the rank's part
             sits at its place in a zero-padded tile
    each call: [ROW_BLOCK, H] x [H, TILE]  ->  the same kernel, the same order, for every logit

A logit then depends only on its row and its token's column, never on the neighbours.
Full tiles are views of the stored weight (no copy); at most two tiles per shard are padded.
"""

from __future__ import annotations

import torch

ROW_BLOCK = 8
TILE = 512


def tiled_logits(x: torch.Tensor, weight: torch.Tensor, start: int, size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [N, H] @ weight[:size].T`` as ``[N, size]`` in ``out_dtype``, with the fixed call shape above.

    ``weight`` holds the shard's rows (token ids ``start .. start + size``) in the compute
    dtype of ``x``; ``out_dtype`` float32 over a half-precision ``x`` upcasts both operands
    (the float32 accumulation, not rounded to the head dtype).
    """
    rows, hidden = x.shape
    compute = torch.float32 if out_dtype == torch.float32 else x.dtype
    xb = torch.zeros(-(-rows // ROW_BLOCK) * ROW_BLOCK, hidden, dtype=compute, device=x.device)
    xb[:rows] = x.to(compute)
    out = torch.empty(rows, size, dtype=out_dtype, device=x.device)
    first, last = start // TILE, (start + size - 1) // TILE
    for tile in range(first, last + 1):
        lo, hi = max(tile * TILE, start), min((tile + 1) * TILE, start + size)  # ids this rank owns in the tile
        if lo - tile * TILE == 0 and hi - lo == TILE:
            w = weight[lo - start : hi - start].to(compute)
        else:
            w = torch.zeros(TILE, hidden, dtype=compute, device=x.device)
            w[lo - tile * TILE : hi - tile * TILE] = weight[lo - start : hi - start]
        wt = w.t()
        cols = slice(lo - tile * TILE, hi - tile * TILE)
        for r in range(0, xb.shape[0], ROW_BLOCK):
            block = torch.mm(xb[r : r + ROW_BLOCK], wt)
            n = min(ROW_BLOCK, rows - r)
            if n > 0:
                out[r : r + n, lo - start : hi - start] = block[:n, cols].to(out_dtype)
    return out
