"""What the fused kernel tests share (``tests/kernels/test_*.py``): checkpoint tensors with chosen codes, the
float64 reference and its error bounds, and the library builds (ISA paths) this CPU runs.

Reference: the exact weights in float64 (``e4m3(code) * weight_scale``, ``e2m1 * e4m3(block) *
weight_scale_2``: every such product is exact in float64) times the head's own quantized input
(``quantize_input``, which stays in torch for both paths), summed in float64.

Tolerances are rigorous bounds, not fitted numbers. With ``gamma(m) = m u / (1 - m u)``,
``u = 2**-24`` and ``A = sum_i |x_i w_i|`` (float64, per logit):

- fused FP8: every logit is 8 float32 FMA chains of ``S = ceil(H / 8)`` steps, a 3-level tree
  and one multiply by the scale; the decoded codes are exact: ``|fused - ref| <= gamma(S + 4) * A``.
- fused NVFP4: each lane sums a 16-block's ``e2m1 * x`` (16 FMAs from zero) and adds it times the
  block scale with one FMA, ``G = ceil(H / 128)`` times, then the tree and the global scale:
  ``|fused - ref| <= gamma(16 + G + 4) * A``.
- torch fallback: each weight is rounded once (``q * scale`` in float32), then BLAS sums the
  ``H`` products in some order: ``|torch - ref| <= gamma(H + 2) * A`` for any order.
"""

from __future__ import annotations

import math
import platform

import pytest
import torch

from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig, kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import library
from trtvocab.quant import nvfp4

F8 = torch.float8_e4m3fn
FP8, NVFP4 = QuantAlgo.FP8, QuantAlgo.NVFP4
U = 2.0**-24
E2M1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
FINITE_FP8 = torch.arange(256, dtype=torch.uint8)[(torch.arange(256) & 0x7F) != 0x7F]  # 254 codes
DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BATCHES_1_9 = list(range(1, 10))


def gamma(m: int) -> float:
    return m * U / (1 - m * U)


# ---- raw checkpoint tensors (codes chosen directly, not through quantization) --------------------------------
def fp8_tensors(v: int, h: int, gen: torch.Generator, *, codes: torch.Tensor | None = None, scale: float = 2e-3,
                per_row: bool = False) -> dict[str, torch.Tensor]:
    if codes is None:
        codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, h), generator=gen)]
    if per_row:
        ws = torch.rand(v, generator=gen) * scale + scale / 4
    else:
        ws = torch.tensor(scale)
    return {"weight": codes.view(F8), "weight_scale": ws.float()}


def nvfp4_tensors(v: int, h: int, gen: torch.Generator, *, packed: torch.Tensor | None = None,
                  scale_codes: tuple[int, int] = (0x08, 0x7F), global_scale: float = 1e-3) -> dict[str, torch.Tensor]:
    if packed is None:
        packed = torch.randint(0, 256, (v, h // 2), dtype=torch.uint8, generator=gen)
    bs = torch.randint(*scale_codes, (v, h // 16), dtype=torch.uint8, generator=gen)
    return {"weight": packed, "weight_scale": bs.view(F8), "weight_scale_2": torch.tensor(global_scale)}


def tensors_for(algo: QuantAlgo, v: int, h: int, seed: int = 0, per_row: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return fp8_tensors(v, h, gen, per_row=per_row) if algo is FP8 else nvfp4_tensors(v, h, gen)


def exact_weight(algo: QuantAlgo, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 [V, H], exact."""
    if algo is FP8:
        ws = t["weight_scale"].double()
        return t["weight"].double() * (ws.reshape(-1, 1) if ws.numel() > 1 else ws)
    codes = nvfp4.unpack_codes(t["weight"]).long()
    values = E2M1[codes]
    scale = t["weight_scale"].double() * t["weight_scale_2"].double()
    return (values.reshape(values.shape[0], -1, 16) * scale.unsqueeze(-1)).reshape(values.shape)


def make_head(algo: QuantAlgo, activation: str, v: int, h: int, t: dict[str, torch.Tensor], *,
              per_row: bool = False, mapping: Mapping | None = None, layout: str = "uneven",
              input_scale: float = 4.0 / 448) -> LMHead:
    config = QuantConfig(quant_algo=algo, activation=activation, granularity="per_row" if per_row else "per_tensor")
    head = LMHead(v, h, quant_config=config, mapping=mapping, vocab_layout=layout, pad_to=4)
    tensors = dict(t)
    if activation == "static":
        tensors["input_scale"] = torch.tensor(input_scale)
    head.load_weights(tensors)
    return head


def check(head: LMHead, x: torch.Tensor, w64: torch.Tensor, *, fused_path: bool) -> torch.Tensor:
    """The head's local logits of x against float64, within the bound of the path that ran."""
    weights = head.weights
    prepared = weights.prepare(x)
    assert isinstance(prepared, kernels.FusedInput) is fused_path
    shard = head.shard
    got = weights(x)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], shard.width)
    assert torch.equal(got[:, shard.size :], torch.zeros_like(got[:, shard.size :]))  # padding columns
    got = got[:, : shard.size].double()
    xq = weights.quantize_input(x).double()
    w = w64[shard.start : shard.end]
    ref = xq @ w.t()
    a = xq.abs() @ w.abs().t()
    if fused_path:
        chain = math.ceil(head.hidden_size / 8) if head.weight_format.value == "FP8" else \
            16 + math.ceil(head.hidden_size / 128)
        bound = gamma(chain + 4) * a
    else:
        bound = gamma(head.hidden_size + 2) * a
    excess = ((got - ref).abs() - bound).max().item() if got.numel() else 0.0
    assert excess <= 0, f"error exceeds its bound by {excess:.3g}"
    return got


def adversarial_cases() -> list[tuple[str, QuantAlgo, dict]]:
    return [
        ("fp8 all 448", FP8, {"codes": "max", "scale": 1.0}),
        ("fp8 large scale", FP8, {"scale": 2.0**60}),
        ("fp8 tiny scale", FP8, {"scale": 2.0**-60}),
        ("fp8 all zero codes", FP8, {"codes": "zero"}),
        ("nvfp4 max codes, 448 block scales", NVFP4, {"packed": "max", "scale_codes": (0x7E, 0x7F),
                                                      "global_scale": 1.0}),
        ("nvfp4 subnormal block scales", NVFP4, {"scale_codes": (0x01, 0x08)}),
        ("nvfp4 6*448 global", NVFP4, {"global_scale": 6.0 * 448}),
        ("nvfp4 all -0 codes", NVFP4, {"packed": "negzero"}),
    ]


def adversarial_tensors(algo, spec: dict, v: int, h: int, gen: torch.Generator) -> dict:
    """A head's checkpoint tensors with ``spec``'s adversarial codes: FP8 ``codes`` "max" (+-448) or
    "zero", NVFP4 ``packed`` "max" (+-6) or "negzero" (every nibble -0), the other keys as given."""
    spec = dict(spec)
    if algo is FP8:
        kind = spec.pop("codes", None)
        if kind == "max":
            spec["codes"] = 0x7E | (torch.randint(0, 2, (v, h), dtype=torch.uint8, generator=gen) << 7)
        elif kind == "zero":
            spec["codes"] = torch.zeros(v, h, dtype=torch.uint8)
        return fp8_tensors(v, h, gen, **spec)
    kind = spec.pop("packed", None)
    if kind == "max":
        spec["packed"] = torch.randint(0, 2, (v, h // 2), dtype=torch.uint8, generator=gen) * 0x88 | 0x77
    elif kind == "negzero":
        spec["packed"] = torch.full((v, h // 2), 0x88, dtype=torch.uint8)
    return nvfp4_tensors(v, h, gen, **spec)


def every_nibble_rows(hidden: int, gen: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(v, codes [v, hidden], packed [v, hidden / 2])``: 261 random NVFP4 rows in which row r also holds
    nibble r % 16 at column 7 r % hidden, so every nibble sits in every lane position; element 2k in the
    low nibble (row-major, as stored)."""
    v = 16 * 16 + 5
    codes = torch.randint(0, 16, (v, hidden), dtype=torch.uint8, generator=gen)
    codes[torch.arange(v), (torch.arange(v) * 7) % hidden] = torch.arange(v, dtype=torch.uint8) % 16
    return v, codes, codes[:, 0::2] | (codes[:, 1::2] << 4)


def batch_invariant(head: LMHead, x: torch.Tensor) -> torch.Tensor:
    """The head's logits of x; asserts each row equals the row computed alone, and every B' <= B prefix."""
    got = head.weights(x)
    for b in range(1, x.shape[0]):
        assert torch.equal(head.weights(x[:b]), got[:b]), f"batch {b} prefix of {x.shape[0]}"
    singles = torch.cat([head.weights(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(singles, got)
    return got


# ---- the library's builds (ISA paths) ------------------------------------------------------------------------
def isa_runs_here(isa: str) -> str | None:
    flags = kcompile.cpu_flags()
    if not kcompile.ISA_CPU_FLAGS[isa] <= flags:
        return f"this CPU lacks {', '.join(sorted(kcompile.ISA_CPU_FLAGS[isa] - flags))}"
    if isa != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        return "the avx512 / avx2 / portable builds are x86 -march targets"
    return None


def vector_paths() -> list[kernels.Loaded]:
    """The builds of the vector paths this CPU runs (AVX-512, AVX2); portable may round a * b + c twice."""
    if library.disabled_reason() is not None:
        pytest.skip(library.disabled_reason())
    paths = []
    for isa in ("avx512", "avx2"):
        if isa_runs_here(isa) is None:
            try:
                paths.append(library.load_isa(isa))
            except Exception as exc:  # no compiler here: the fused tests above skip for the same reason
                pytest.skip(f"{isa} build unavailable: {exc}")
    if len(paths) < 2:
        pytest.skip(f"fewer than two vector paths run here ({[p.isa for p in paths]})")
    return paths


def same_on_every_path(paths: list[kernels.Loaded], call, *args) -> torch.Tensor:
    """``call(library, *args)`` (a :mod:`trtvocab.kernels.gemm` call) on every path: the same bits."""
    first = call(paths[0], *args)
    for other in paths[1:]:
        got = call(other, *args)
        assert torch.equal(got.view(torch.int32), first.view(torch.int32)), f"{other.isa} differs from {paths[0].isa}"
    return first
