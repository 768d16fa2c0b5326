"""The fused dequantize-multiply kernels (``trtvocab/kernels/``) against float64 and the torch path: every
FP8 code and NVFP4 nibble at every width, adversarial values, the activation modes, TP shards and
partitions (the bounds: ``tests/kernels/fused_reference.py``).

Fused-specific checks (bounds, bitwise partition / batch independence) skip with the reason
when the kernels cannot be built here; the fallback is tested either way.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fused_reference import (
    FINITE_FP8,
    FP8,
    NVFP4,
    adversarial_cases,
    adversarial_tensors,
    check,
    exact_weight,
    fp8_tensors,
    gamma,
    make_head,
    nvfp4_tensors,
    tensors_for,
)
from trtvocab import Mapping, kernels
from trtvocab.kernels import library


@pytest.fixture(scope="module")
def fused() -> None:
    """Skip unless the kernels are available (after one build, cached by torch)."""
    if not kernels.available():
        reason = kernels.unavailable_reason() or ""
        if "self-check failed" in reason:  # built, but decodes wrongly: a bug, not a missing compiler
            pytest.fail(f"fused kernels built but {reason}")
        pytest.skip(f"fused kernels unavailable here: {reason}")


def fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.ENV_VAR, "0")


# ---- decode: every code, every width -------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [1, 7, 13, 40, 72, 129])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_every_code_and_width(fused, hidden, per_row):
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel()
    # Row i holds code i at column i % H and random codes elsewhere: every code in every lane position.
    codes = FINITE_FP8[torch.randint(0, v, (v, hidden), generator=gen)]
    codes[torch.arange(v), torch.arange(v) % hidden] = FINITE_FP8
    t = fp8_tensors(v, hidden, gen, codes=codes, per_row=per_row)
    head = make_head(FP8, "none", v, hidden, t, per_row=per_row)
    for batch in (1, 3, 8):
        check(head, torch.randn(batch, hidden, generator=gen).bfloat16(), exact_weight(FP8, t), fused_path=True)
    # One-hot inputs read single weights back: exact.
    eye = torch.eye(hidden)
    got = head.weights(eye.bfloat16()).double()
    assert torch.equal(got, exact_weight(FP8, t).t().float().double())


@pytest.mark.parametrize("hidden", [16, 48, 80, 128, 144, 272])
def test_nvfp4_every_nibble_and_width(fused, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = 16 * 16
    codes = torch.randint(0, 16, (v, hidden), dtype=torch.uint8, generator=gen)
    codes[torch.arange(v), torch.arange(v) % hidden] = torch.arange(v, dtype=torch.uint8) % 16
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    t = nvfp4_tensors(v, hidden, gen, packed=packed, scale_codes=(0x01, 0x7F))
    head = make_head(NVFP4, "none", v, hidden, t)
    w64 = exact_weight(NVFP4, t)
    for batch in (1, 3, 8):
        check(head, torch.randn(batch, hidden, generator=gen).bfloat16(), w64, fused_path=True)
    got = head.weights(torch.eye(hidden).bfloat16()).double()
    assert torch.equal(got, w64.t().float().double())


# ---- adversarial values --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "algo", "spec"), adversarial_cases(), ids=[c[0] for c in adversarial_cases()])
def test_adversarial_values(fused, name, algo, spec):
    v, h = 37, 80
    gen = torch.Generator().manual_seed(3)
    t = adversarial_tensors(algo, spec, v, h, gen)
    w64 = exact_weight(algo, t)
    head = make_head(algo, "none", v, h, t)
    inputs = [torch.zeros(4, h), torch.full((3, h), 448.0), torch.randn(8, h, generator=gen) * 1e4,
              torch.randn(1, h, generator=gen) * 1e-4]
    for x in inputs:
        got = check(head, x.bfloat16(), w64, fused_path=True)
        if not bool(x.any()) or not bool(w64.any()):
            assert torch.equal(got, torch.zeros_like(got))
            assert not bool(torch.signbit(got).any())  # canonical +0


# ---- activation modes, shapes, TP shards ---------------------------------------------------------------------
MODES = [(FP8, "static"), (FP8, "dynamic"), (FP8, "none"), (NVFP4, "static"), (NVFP4, "none")]


@pytest.mark.parametrize(("algo", "activation"), MODES, ids=[f"{a.value}-{m}" for a, m in MODES])
def test_activation_modes_batches_and_fallback(fused, monkeypatch, algo, activation):
    v, h = 203, 144
    t = tensors_for(algo, v, h)
    w64 = exact_weight(algo, t)
    head = make_head(algo, activation, v, h, t)
    gen = torch.Generator().manual_seed(1)
    xs = {b: torch.randn(b, h, generator=gen).bfloat16() for b in (1, 3, 8, 64)}
    got = {b: check(head, x, w64, fused_path=True) for b, x in xs.items()}
    # A row's logits do not depend on the batch it came in (the same chain at every B). The
    # activation quantization is per tensor for FP8 dynamic, so compare a batch with itself.
    if activation != "dynamic":
        for b in (3, 8, 64):
            singles = torch.cat([head.weights(xs[b][i : i + 1]) for i in range(b)])
            assert torch.equal(singles.double(), got[b])
    fallback(monkeypatch)
    for b, x in xs.items():
        old = check(head, x, w64, fused_path=False)
        assert torch.allclose(old, got[b], rtol=0, atol=float((2 * gamma(h + 2) * (head.weights.quantize_input(x)
                                                                                     .double().abs()
                                                                                     @ w64.abs().t())).max()))


def test_fallback_without_kernels_matches_reference(monkeypatch):
    """Runs on every machine: the torch path behind TRTVOCAB_KERNELS=0."""
    fallback(monkeypatch)
    assert not kernels.available() and kernels.unavailable_reason() == f"{library.ENV_VAR}=0"
    for algo, activation in MODES:
        v, h = 61, 48
        t = tensors_for(algo, v, h, seed=5)
        head = make_head(algo, activation, v, h, t)
        for b in (1, 3):
            check(head, torch.randn(b, h, generator=torch.Generator().manual_seed(b)).bfloat16(),
                  exact_weight(algo, t), fused_path=False)


@pytest.mark.parametrize("layout", ["uneven", "padded"])
@pytest.mark.parametrize("algo", [FP8, NVFP4])
def test_tp_shards_uneven_and_padded(fused, algo, layout):
    v, h = 101, 80
    t = tensors_for(algo, v, h, seed=2, per_row=algo is FP8)
    w64 = exact_weight(algo, t)
    x = torch.randn(8, h, generator=torch.Generator().manual_seed(9)).bfloat16()
    single = make_head(algo, "none", v, h, t, per_row=algo is FP8)
    full = check(single, x, w64, fused_path=True)
    for rank in range(3):
        mapping = Mapping(world_size=3, rank=rank, tp_size=3)
        head = make_head(algo, "none", v, h, t, per_row=algo is FP8, mapping=mapping, layout=layout)
        got = check(head, x, w64, fused_path=True)
        # The shard's logits are the single-device head's columns, bitwise (same chains).
        assert torch.equal(got, full[:, head.shard.start : head.shard.end])


# ---- partition independence ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("algo", "activation"), MODES, ids=[f"{a.value}-{m}" for a, m in MODES])
def test_block_logits_partition_independent(fused, algo, activation):
    v, h = 97, 272
    t = tensors_for(algo, v, h, seed=4)
    head = make_head(algo, activation, v, h, t)
    for b in (1, 5):
        prepared = head.weights.prepare(torch.randn(b, h, generator=torch.Generator().manual_seed(b)).bfloat16())
        whole = head.weights.block_logits(prepared, 0, v)
        bounds, start, sizes = [], 0, [1, 7]
        while start < v:
            end = min(v, start + sizes[len(bounds) % 2])
            bounds.append((start, end))
            start = end
        pieces = torch.cat([head.weights.block_logits(prepared, lo, hi) for lo, hi in bounds], dim=1)
        assert torch.equal(pieces, whole)
        out = torch.full((b, v + 3), float("nan"))
        head.weights.block_logits(prepared, 10, 50, out=out[:, 2:42])  # a strided view is written in place
        assert torch.equal(out[:, 2:42], whole[:, 10:50])
        assert head.weights.block_logits(prepared, 7, 7).shape == (b, 0)
        with pytest.raises(ValueError):
            head.weights.block_logits(prepared, 0, v + 1)
