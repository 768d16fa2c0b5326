"""Counter-based noise keyed by ``(seed, step, token id)``: the same numbers on every rank and tp size.

A per-rank random stream would give a token a different draw at every tp size. Here the
uniform for token ``i`` of a row is a pure function of the row's seed, the decode step and
the *global* token id, computed with the SplitMix64 finalizer (a bijective 64-bit mix)::

    s = mix(mix(seed + G) ^ mix(step + 2G))          per row (host ints)
    h = mix(s + (i + 1) * G)                         per token, int64 wrap-around arithmetic
    u = ((h >>> 11) + 0.5) * 2**-53                  in (0, 1), float64

so a rank draws the noise of exactly its own columns, and a request gives the same tokens
at tp 1, 2, 3, 5 and in the padded layout. ``>>>`` is a logical shift (torch's ``>>`` on
int64 is arithmetic, so the sign bits are masked off).

See docs/architecture.md, "Seeded sampling without the gather".
"""

from __future__ import annotations

import torch

_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix_int(x: int) -> int:
    """The SplitMix64 finalizer on a Python int (exact, for the per-row keys)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * _M1) & _MASK64
    x ^= x >> 27
    x = (x * _M2) & _MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix_int` elementwise on int64 (two's-complement wrap-around, as the C++ kernels do)."""
    x = x ^ _srl(x, 30)
    x = x * _signed(_M1)
    x = x ^ _srl(x, 27)
    x = x * _signed(_M2)
    return x ^ _srl(x, 31)


def row_keys(seeds: list[int], step: int) -> torch.Tensor:
    """int64 ``[B, 1]`` per-row keys from each row's seed and the step."""
    keys = [mix_int(mix_int(seed + _GAMMA) ^ mix_int(step + 2 * _GAMMA)) for seed in seeds]
    return torch.tensor([_signed(k) for k in keys], dtype=torch.int64).reshape(-1, 1)


def uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 ``[B, n]`` in (0, 1): the uniform of each (row key, global token id) pair; ``token_ids``
    ``[n]`` (the same ids for every row) or ``[B, n]`` (each row its own, such as its top-k candidates)."""
    ids = token_ids.to(torch.int64)
    h = mix_tensor(keys + ((ids[None, :] if ids.dim() == 1 else ids) + 1) * _signed(_GAMMA))
    return (_srl(h, 11).to(torch.float64) + 0.5) * 2.0**-53


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))``, float64 ``[B, n]``: argmax(logits + noise) ~ softmax
    (``token_ids`` as for :func:`uniforms`)."""
    return -torch.log(-torch.log(uniforms(keys, token_ids)))
