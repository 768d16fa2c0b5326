"""The fused dequantize-multiply CPU kernels (trtvocab/weights/kernels.py) against float64 and the torch path.

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

Fused-specific checks (bounds, bitwise partition / batch independence) skip with the reason
when the kernels cannot be built here; the fallback is tested either way.
"""

from __future__ import annotations

import math

import pytest
import torch

from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig
from trtvocab.quant import nvfp4
from trtvocab.weights import kernels

F8 = torch.float8_e4m3fn
FP8, NVFP4 = QuantAlgo.FP8, QuantAlgo.NVFP4
U = 2.0**-24
E2M1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
FINITE_FP8 = torch.arange(256, dtype=torch.uint8)[(torch.arange(256) & 0x7F) != 0x7F]  # 254 codes


def gamma(m: int) -> float:
    return m * U / (1 - m * U)


@pytest.fixture(scope="module")
def fused() -> None:
    """Skip unless the kernels are available (after one build, cached by torch)."""
    if not kernels.available():
        reason = kernels.unavailable_reason() or ""
        if "self-check failed" in reason:  # built, but decodes wrongly: a bug, not a missing compiler
            pytest.fail(f"fused kernels built but {reason}")
        pytest.skip(f"fused kernels unavailable here: {reason}")


# ---- raw checkpoint tensors (codes chosen directly, not through quantization) ----------------------------
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


def fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV_VAR, "0")


# ---- decode: every code, every width -------------------------------------------------------------------
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


# ---- adversarial values --------------------------------------------------------------------------------
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


@pytest.mark.parametrize(("name", "algo", "spec"), adversarial_cases(), ids=[c[0] for c in adversarial_cases()])
def test_adversarial_values(fused, name, algo, spec):
    v, h = 37, 80
    gen = torch.Generator().manual_seed(3)
    spec = dict(spec)
    if algo is FP8:
        kind = spec.pop("codes", None)
        if kind == "max":
            signs = torch.randint(0, 2, (v, h), dtype=torch.uint8, generator=gen) << 7
            spec["codes"] = 0x7E | signs  # +-448
        elif kind == "zero":
            spec["codes"] = torch.zeros(v, h, dtype=torch.uint8)
        t = fp8_tensors(v, h, gen, **spec)
    else:
        kind = spec.pop("packed", None)
        if kind == "max":
            spec["packed"] = torch.randint(0, 2, (v, h // 2), dtype=torch.uint8, generator=gen) * 0x88 | 0x77
        elif kind == "negzero":
            spec["packed"] = torch.full((v, h // 2), 0x88, dtype=torch.uint8)
        t = nvfp4_tensors(v, h, gen, **spec)
    w64 = exact_weight(algo, t)
    head = make_head(algo, "none", v, h, t)
    inputs = [torch.zeros(4, h), torch.full((3, h), 448.0), torch.randn(8, h, generator=gen) * 1e4,
              torch.randn(1, h, generator=gen) * 1e-4]
    for x in inputs:
        got = check(head, x.bfloat16(), w64, fused_path=True)
        if not bool(x.any()) or not bool(w64.any()):
            assert torch.equal(got, torch.zeros_like(got))
            assert not bool(torch.signbit(got).any())  # canonical +0


# ---- activation modes, shapes, TP shards ----------------------------------------------------------------
MODES = [(FP8, "static"), (FP8, "dynamic"), (FP8, "none"), (NVFP4, "static"), (NVFP4, "none")]


def tensors_for(algo: QuantAlgo, v: int, h: int, seed: int = 0, per_row: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return fp8_tensors(v, h, gen, per_row=per_row) if algo is FP8 else nvfp4_tensors(v, h, gen)


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
    assert not kernels.available() and kernels.unavailable_reason() == f"{kernels.ENV_VAR}=0"
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


# ---- partition independence ------------------------------------------------------------------------------
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


# ---- building, disabling, failing -------------------------------------------------------------------------
def test_build_failure_falls_back_and_says_why(monkeypatch, caplog):
    def broken(verbose: bool = False):
        raise RuntimeError("Error building extension 'trtvocab_fused': c++: not found")

    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "_build", broken)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.load() is None
        assert kernels.load() is None  # logged once, not per call
    assert "c++: not found" in (kernels.unavailable_reason() or "")
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    t = tensors_for(NVFP4, 40, 32)
    head = make_head(NVFP4, "static", 40, 32, t)
    check(head, torch.randn(2, 32).bfloat16(), exact_weight(NVFP4, t), fused_path=False)


def test_cli_build(capsys, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "0")
    assert kernels.main(["--build"]) == 0
    assert "disabled" in capsys.readouterr().out
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.main(["--build"]) == 0
    out = capsys.readouterr().out
    assert ("self-check passed" in out) == kernels.available(), out


def test_source_ships_with_the_package():
    assert kernels.SOURCE.is_file() and kernels.SOURCE.parent.name == "csrc"
    assert kernels.build_name().startswith("trtvocab_fused_")
