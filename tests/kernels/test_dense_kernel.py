"""The dense bf16 / fp16 / float32 kernel: its bound against float64 at every batch 1..9, partitions and TP
shards, every bf16 / fp16 value and float32 special value read back exactly, and when it runs instead of
torch's GEMM (``TRTVOCAB_DENSE_KERNEL``, the batch limits per path).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.fused_reference import BATCHES_1_9, DENSE_DTYPES, batch_invariant, gamma
from trtvocab import LMHead, Mapping, kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}  # of the final rounding


def _dense_head(dtype: torch.dtype, v: int, h: int, w: torch.Tensor, mapping: Mapping | None = None,
                layout: str = "uneven") -> LMHead:
    head = LMHead(v, h, dtype=dtype, mapping=mapping, vocab_layout=layout, pad_to=4)
    head.load_weights({"weight": w})
    return head


def _dense_check(head: LMHead, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Logits against float64: 8 float32 FMA chains of ceil(H / 8) steps, a 3-level tree, then one
    rounding to the head dtype (unit roundoff 2**-8 bf16, 2**-11 fp16; none for float32)."""
    weights = head.weights
    assert weights._kernel(x)
    got = weights(x)
    shard = head.shard
    assert got.dtype == w.dtype and torch.equal(got[:, shard.size :], torch.zeros_like(got[:, shard.size :]))
    got = got[:, : shard.size].double()
    w64 = w[shard.start : shard.end].double()
    ref, a = x.double() @ w64.t(), x.double().abs() @ w64.abs().t()
    fp32_err = gamma(math.ceil(head.hidden_size / 8) + 3) * a
    u = UNIT_ROUNDOFF[w.dtype]
    bound = fp32_err + u * (ref.abs() + fp32_err)
    excess = ((got - ref).abs() - bound).max().item() if got.numel() else 0.0
    assert excess <= 0, f"error exceeds its bound by {excess:.3g}"
    return got


@pytest.fixture
def dense_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "1")  # on every CPU, also where torch's GEMM is the default


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("hidden", [1, 13, 40, 520, 1029])
def test_dense_kernel_bounds_batches_and_partitions(isa, dense_kernel, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = 203
    w = (torch.randn(v, hidden, generator=gen) * 0.05).to(dtype)
    head = _dense_head(dtype, v, hidden, w)
    x = torch.randn(9, hidden, generator=gen).to(dtype)
    got = batch_invariant(head, x)
    for b in BATCHES_1_9:
        _dense_check(head, x[:b], w)
        pieces = torch.cat([head.weights.block_logits(x[:b], lo, min(v, lo + 17)) for lo in range(0, v, 17)], 1)
        assert torch.equal(pieces, got[:b])
    for rank in range(3):
        shard_head = _dense_head(dtype, v, hidden, w, mapping=Mapping(world_size=3, rank=rank, tp_size=3))
        part = _dense_check(shard_head, x, w)
        assert torch.equal(part, got[:, shard_head.shard.start : shard_head.shard.end].double())
    # torch's GEMM (the kernel off) gives the same numbers within its own bound (any order, one rounding)
    with library.disabled():
        assert not head.weights._kernel(x)
        old = head.weights(x).double()
    u = UNIT_ROUNDOFF[dtype]
    a = x.double().abs() @ w.double().abs().t()
    assert ((old - got.double()).abs() <= 2 * (gamma(hidden + 2) * a + u * a) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_kernel_decodes_every_value(isa, dtype):
    """Every finite bf16 / fp16 bit pattern (subnormals, -0, the extremes) read back through one-hot
    inputs, at every batch 1..9 and a tail step (H = 13)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    _dense_reads_back(values[torch.isfinite(values.float())])


def _dense_reads_back(values: torch.Tensor, h: int = 13) -> torch.Tensor:
    """``values`` laid out in rows of ``h`` (zero-padded), read back through one-hot inputs at every batch
    1..9: each logit is its weight exactly (bit for bit; -0 weights give +0 logits, sum + 0). Returns the rows."""
    v = -(-values.numel() // h)
    w = torch.zeros(v * h, dtype=values.dtype)
    w[: values.numel()] = values
    w = w.reshape(v, h)
    for b in BATCHES_1_9:
        cols = (torch.arange(b) * 5) % h
        eye = torch.zeros(b, h, dtype=torch.float32)
        eye[torch.arange(b), cols] = 1.0
        got = kernels.dense_logits(kernels.fp8_x(eye), h, w)
        want = w.float()[:, cols].t() + 0.0
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    return w


def test_dense_kernel_reads_float32_weights_as_they_are(isa):
    """float32 weights need no decode: every special value (signed zeros, subnormals down to the
    smallest, the largest finite, both ends of the normals) and random bit patterns come back exactly
    through one-hot inputs, at every batch 1..9 and a tail step (H = 13)."""
    special = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 2.0**-126 - 2.0**-149, 1.0, -1.0,
                            3.4028234663852886e38, -3.4028234663852886e38, 1e-40, 0.1], dtype=torch.float32)
    bits = torch.randint(-(2**31), 2**31 - 1, (4000,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    values = torch.cat([special, bits.to(torch.int32).view(torch.float32)])
    w = _dense_reads_back(values[torch.isfinite(values)])
    h, v = w.shape[1], w.shape[0]
    # a weight kind the library does not know is an error status, not a guess
    out = torch.empty(1, v)
    x8 = kernels.fp8_x(torch.ones(1, h))
    assert kernels.load().lib.trtvocab_dense_logits(x8.data_ptr(), 1, x8.stride(0), h, w.data_ptr(), v, h, 3,
                                                    out.data_ptr(), v) == 2


def test_dense_kernel_dispatch(monkeypatch):
    head = _dense_head(torch.bfloat16, 40, 16, torch.randn(40, 16).bfloat16())
    x = torch.randn(3, 16).bfloat16()
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "0")
    assert not head.weights._kernel(x)
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "1")
    assert head.weights._kernel(x) == kernels.available()
    assert not head.weights._kernel(torch.randn(gemm.DENSE_MAX_BATCH + 1, 16).bfloat16())
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "auto")
    native = any(f in kcompile.cpu_flags() for f in gemm.NATIVE_DOT[torch.bfloat16])
    wide = kernels.available() and kernels.load().isa == "avx512"
    want = (gemm.WIDE_MAX_BATCH if wide else 0) if native else gemm.DENSE_MAX_BATCH
    assert kernels.dense_max_batch(torch.bfloat16) == want
    assert gemm.dense_max_batch(torch.bfloat16, "avx2+fma+f16c") == (0 if native else gemm.DENSE_MAX_BATCH)
    # float32: by the library's path (measured: 16 rows on AVX-512, 8 on AVX2, never portable)
    assert gemm.dense_max_batch(torch.float32, "avx512") == 16
    assert gemm.dense_max_batch(torch.float32, "avx2+fma+f16c") == 8
    assert gemm.dense_max_batch(torch.float32, "portable") == 0
    limit = kernels.dense_max_batch(torch.float32)
    assert limit == (0 if not kernels.available() else {"avx512": 16, "avx2+fma+f16c": 8}.get(kernels.load().isa, 0))
    head32 = _dense_head(torch.float32, 40, 16, torch.randn(40, 16))
    if limit:
        assert head32.weights._kernel(torch.randn(limit, 16))
    assert not head32.weights._kernel(torch.randn(limit + 1, 16))
    assert not head32.weights._kernel(torch.randn(3, 16).bfloat16())  # x in another dtype: torch's GEMM
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "1")
    assert kernels.dense_max_batch(torch.float32) == gemm.DENSE_MAX_BATCH
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "0")
    assert kernels.dense_max_batch(torch.float32) == 0
    monkeypatch.setenv(gemm.DENSE_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=gemm.DENSE_ENV_VAR):
        kernels.dense_max_batch(torch.bfloat16)
