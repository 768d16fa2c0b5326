"""Deterministic synthetic head weights that no rank ever has to hold in full.

Rows are generated in blocks of ``BLOCK`` rows, each from its own generator seeded
with ``(seed, block)``: rank r's rows are the same numbers whatever the tp size,
and a rank generates only the blocks that overlap its shard.
"""

from __future__ import annotations

import torch

BLOCK = 1024


class SyntheticRows:
    """A lazy ``[vocab, hidden]`` float32 tensor (``get_shape`` + row slicing), N(0, std)."""

    def __init__(self, vocab_size: int, hidden_size: int, seed: int = 0, std: float = 0.02) -> None:
        self.vocab_size, self.hidden_size, self.seed, self.std = vocab_size, hidden_size, seed, std

    def get_shape(self) -> list[int]:
        return [self.vocab_size, self.hidden_size]

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self.vocab_size)
        if step != 1:
            raise ValueError("synthetic rows support only contiguous slices")
        out = torch.empty(max(0, stop - start), self.hidden_size)
        block = start // BLOCK
        while block * BLOCK < stop:
            lo, hi = block * BLOCK, min((block + 1) * BLOCK, self.vocab_size)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            rows = torch.randn(hi - lo, self.hidden_size, generator=gen) * self.std
            a, b = max(lo, start), min(hi, stop)
            out[a - start : b - start] = rows[a - lo : b - lo]
            block += 1
        return out
