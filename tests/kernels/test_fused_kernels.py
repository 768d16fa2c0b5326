"""The fused dequantize-multiply CPU kernels (trtvocab/kernels/) against float64 and the torch path.

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

import ctypes
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig, kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library, probes
from trtvocab.kernels.__main__ import main as kernels_main
from trtvocab.quant import nvfp4

F8 = torch.float8_e4m3fn
FP8, NVFP4 = QuantAlgo.FP8, QuantAlgo.NVFP4
U = 2.0**-24
E2M1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
FINITE_FP8 = torch.arange(256, dtype=torch.uint8)[(torch.arange(256) & 0x7F) != 0x7F]  # 254 codes
DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    monkeypatch.setenv(library.ENV_VAR, "0")


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

    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setattr(library, "_build", broken)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.load() is None
        assert kernels.load() is None  # logged once, not per call
    assert "c++: not found" in (kernels.unavailable_reason() or "")
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    t = tensors_for(NVFP4, 40, 32)
    head = make_head(NVFP4, "static", 40, 32, t)
    check(head, torch.randn(2, 32).bfloat16(), exact_weight(NVFP4, t), fused_path=False)


def test_cli_build(capsys, monkeypatch):
    monkeypatch.setenv(library.ENV_VAR, "0")
    assert kernels_main(["--build"]) == 0
    assert "disabled" in capsys.readouterr().out
    monkeypatch.delenv(library.ENV_VAR)
    assert kernels_main(["--build"]) == 0
    out = capsys.readouterr().out
    assert ("self-check passed" in out) == kernels.available(), out


def test_source_ships_with_the_package():
    assert kcompile.SOURCE.is_file() and kcompile.SOURCE.parent.name == "csrc"
    assert kcompile.build_name().startswith("trtvocab_fused_")


def _included(source: Path) -> set[Path]:
    """The quoted ``#include`` files of ``source``, transitively (read from the text, not from build.py)."""
    found: set[Path] = set()
    for line in source.read_text().splitlines():
        if line.startswith('#include "'):
            header = (source.parent / line.split('"')[1]).resolve()
            found |= {header} | _included(header)
    return found


def test_build_name_hashes_every_file_under_csrc(tmp_path, monkeypatch):
    # A stale cached library must never be served: every header the translation units include is
    # among the hashed files, and editing, adding or renaming one changes the build's name.
    csrc = kcompile.CSRC
    hashed = {p.resolve() for p in kcompile.source_files()}
    units = sorted(csrc.glob("*.cpp"))
    assert units and {p.resolve() for p in units} <= hashed
    headers = set().union(*(_included(u) for u in units))
    assert headers and headers <= hashed, sorted(map(str, headers - hashed))
    copy = tmp_path / "csrc"
    shutil.copytree(csrc, copy)
    monkeypatch.setattr(kcompile, "CSRC", copy)
    base = kcompile.build_name()
    header = copy / "fused" / "vec8.h"
    text = header.read_bytes()
    header.write_bytes(text + b"// an edit\n")
    edited = kcompile.build_name()
    header.write_bytes(text)
    assert kcompile.build_name() == base != edited
    (copy / "fused" / "new.h").write_bytes(b"#pragma once\n")
    added = kcompile.build_name()
    (copy / "fused" / "new.h").rename(copy / "fused" / "other.h")
    assert len({base, edited, added, kcompile.build_name()}) == 4


def test_package_data_ships_every_file_under_csrc():
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["trtvocab"]
    package = kcompile.CSRC.parent.parent
    for path in kcompile.source_files():
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatchcase(rel, pat) and rel.count("/") == pat.count("/") for pat in patterns), rel


# ---- the build cache: stale locks, FIFOs, truncated or rewritten libraries are rebuilt, never loaded -----
# Each load runs in a child process under a timeout (a regression hangs the child, not the suite)
# against a private copy of the cache (TRTVOCAB_KERNELS_DIR), so the user's cache is never touched.
CHILD_TIMEOUT_S = 600  # a cold compile on a slow machine; a hang is caught by the timeout, not by timing
LOAD_IN_CHILD = """
import json
from trtvocab import kernels
loaded = kernels.load()
print(json.dumps({"ok": loaded is not None, "reason": kernels.unavailable_reason(),
                  "path": loaded.path if loaded else None}))
"""


def load_in_child(cache: Path, lock_timeout_s: float = 60.0) -> tuple[dict, str]:
    env = {**os.environ, kcompile.CACHE_ENV_VAR: str(cache), kcompile.LOCK_TIMEOUT_ENV_VAR: str(lock_timeout_s)}
    env.pop(library.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"the loading process died (status {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache root holding a built, recorded library (copied from the user's cache when
    it has this build, so only the link step runs)."""
    if library.disabled_reason() is None and not kernels.available():
        pytest.skip(f"fused kernels cannot be built here: {kernels.unavailable_reason()}")
    root = tmp_path_factory.mktemp("kernel_cache")
    mine = Path(kernels.load().path).parent if kernels.load() is not None else None
    if mine is not None and mine.is_dir():
        shutil.copytree(mine, root / mine.name, ignore=shutil.ignore_patterns(kcompile.LOCK_NAME, kcompile.TORCH_BATON))
    out, err = load_in_child(root)
    assert out["ok"], (out, err)
    return root


def _library_in(cache: Path) -> Path:
    return cache / kcompile.build_name() / f"{kcompile.build_name()}.so"


def _fresh_copy(warm: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    return cache


@pytest.mark.subprocess
def test_stale_locks_of_a_killed_build_are_recovered(warm_cache: Path, tmp_path: Path) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    build_dir = _library_in(cache).parent
    (build_dir / kcompile.TORCH_BATON).write_text("")  # torch's baton, left by a build killed mid-way
    (build_dir / kcompile.LOCK_NAME).write_text("999999\n")  # our lock file, its owner dead (no flock held)
    os.unlink(_library_in(cache))  # forces the build path, where torch would wait for its baton forever
    out, err = load_in_child(cache)
    assert out["ok"], (out, err)
    assert not (build_dir / kcompile.TORCH_BATON).exists()
    assert kcompile.cache_problem(_library_in(cache)) is None


@pytest.mark.subprocess
def test_a_lock_held_by_a_live_build_times_out_to_the_torch_path(warm_cache: Path, tmp_path: Path) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    build_dir = _library_in(cache).parent
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(build_dir / kcompile.LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out, err = load_in_child(cache, lock_timeout_s=1.0)
    finally:
        holder.kill()
        holder.wait()
    assert not out["ok"] and "TimeoutError" in out["reason"] and "held by a live process" in out["reason"], out
    assert err.count("using the torch path") == 1, err  # one log line


@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["fifo", "truncated", "rewritten", "no record", "symlink"])
def test_a_damaged_cached_library_is_rebuilt_never_opened(warm_cache: Path, tmp_path: Path, damage: str) -> None:
    cache = _fresh_copy(warm_cache, tmp_path)
    library = _library_in(cache)
    data = library.read_bytes()
    if damage == "fifo":
        library.unlink()
        os.mkfifo(library)
    elif damage == "truncated":  # dlopen of this would SIGBUS
        library.write_bytes(data[: len(data) // 3])
    elif damage == "rewritten":  # same size, one byte changed
        library.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "no record":
        kcompile.record_path(library).unlink()
    else:
        elsewhere = tmp_path / "elsewhere.so"
        elsewhere.write_bytes(data)
        library.unlink()
        library.symlink_to(elsewhere)
    assert kcompile.cache_problem(library) is not None
    out, err = load_in_child(cache)
    assert out["ok"], (out, err)
    assert library.is_file() and not library.is_symlink() and library.read_bytes() == data  # rebuilt, same bits
    assert kcompile.cache_problem(library) is None


def test_cache_problem_names_what_is_wrong(tmp_path: Path) -> None:
    library = tmp_path / "lib.so"
    assert kcompile.cache_problem(library) == "not built yet"
    library.write_bytes(b"\x7fELF" + bytes(60))
    assert "no build record" in (kcompile.cache_problem(library) or "")
    kcompile.write_record(library)
    assert kcompile.cache_problem(library) is None
    library.write_bytes(b"\x7fELF" + bytes(30))
    assert "34 bytes, 64 were recorded at build" in (kcompile.cache_problem(library) or "")  # truncated
    kcompile.record_path(library).unlink()
    os.mkfifo(kcompile.record_path(library))  # a FIFO as the record: refused, not read
    assert "unreadable" in (kcompile.cache_problem(library) or "")


def test_lock_timeout_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kcompile.LOCK_TIMEOUT_ENV_VAR, "2.5")
    assert kcompile.lock_timeout() == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv(kcompile.LOCK_TIMEOUT_ENV_VAR, bad)
        with pytest.raises(ValueError, match=kcompile.LOCK_TIMEOUT_ENV_VAR):
            kcompile.lock_timeout()


# ---- every path (ISA), the batch-2..8 kernels, the NVFP4 4-group decoder, the dense kernel ---------------
# Each build of the library (TRTVOCAB_KERNELS_ISA: native, avx2, portable) runs the same checks; a path
# this machine cannot run is skipped with the reason. The chains are the same in every build; only the
# portable build may round a * b + c twice where the CPU has no FMA (still inside the same bounds).
def _isa_runs_here(isa: str) -> str | None:
    flags = kcompile.cpu_flags()
    if not kcompile.ISA_CPU_FLAGS[isa] <= flags:
        return f"this CPU lacks {', '.join(sorted(kcompile.ISA_CPU_FLAGS[isa] - flags))}"
    if isa != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        return "the avx512 / avx2 / portable builds are x86 -march targets"
    return None


@pytest.fixture(params=list(library.ISAS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Route the kernels of this test through the library built for one ISA."""
    if library.disabled_reason() is not None:
        pytest.skip(library.disabled_reason())
    why = _isa_runs_here(request.param)
    if why:
        pytest.skip(why)
    try:
        loaded = library.load_isa(request.param)
    except Exception as exc:  # no compiler here: the fused tests above skip for the same reason
        pytest.skip(f"{request.param} build unavailable: {exc}")
    monkeypatch.setattr(library, "_loaded", loaded)
    return request.param


def _native_path() -> str:
    """The path -march=native takes on this CPU."""
    flags = kcompile.cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    for isa, name in (("avx512", "avx512"), ("avx2", "avx2+fma+f16c")):
        if kcompile.ISA_CPU_FLAGS[isa] <= flags:
            return name
    return "portable"


def test_isa_builds_are_the_paths_they_claim(isa):
    loaded = kernels.load()
    assert loaded is not None
    want = {"portable": "portable", "avx2": "avx2+fma+f16c", "avx512": "avx512"}.get(isa, _native_path())
    assert loaded.isa == want  # native on an AVX-512 CPU: the AVX-512 code; on an AVX2 one: the AVX2 code
    assert library.self_check(loaded) is None
    assert str(loaded.path) != str(library.load_isa("portable").path) or isa == "portable"


def test_isa_setting_is_validated(monkeypatch):
    monkeypatch.setenv(kcompile.ISA_ENV_VAR, "avx2")
    assert kcompile.requested_isa() == "avx2"
    assert kcompile.build_name() == kcompile.build_name("avx2") != kcompile.build_name("portable")
    assert len({kcompile.build_name(isa) for isa in library.ISAS}) == len(library.ISAS)
    monkeypatch.setenv(kcompile.ISA_ENV_VAR, "sse9")
    with pytest.raises(ValueError, match=kcompile.ISA_ENV_VAR):
        kcompile.requested_isa()
    monkeypatch.delenv(kcompile.ISA_ENV_VAR)
    assert kcompile.requested_isa() == "native"


BATCHES_1_9 = list(range(1, 10))


def _batch_invariant(head: LMHead, x: torch.Tensor) -> torch.Tensor:
    """The head's logits of x; asserts each row equals the row computed alone, and every B' <= B prefix."""
    got = head.weights(x)
    for b in range(1, x.shape[0]):
        assert torch.equal(head.weights(x[:b]), got[:b]), f"batch {b} prefix of {x.shape[0]}"
    singles = torch.cat([head.weights(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(singles, got)
    return got


@pytest.mark.parametrize("hidden", [1, 13, 40, 520, 1029])
def test_fp8_every_code_batches_1_to_9(isa, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 3  # not a multiple of the tiles
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    for per_row in (False, True):
        t = fp8_tensors(v, hidden, gen, codes=codes, per_row=per_row)
        head = make_head(FP8, "none", v, hidden, t, per_row=per_row)
        w64 = exact_weight(FP8, t)
        x = torch.randn(9, hidden, generator=gen).bfloat16()
        got = _batch_invariant(head, x)
        for b in BATCHES_1_9:
            check(head, x[:b], w64, fused_path=True)
        assert got.shape[0] == 9
    eye = torch.eye(hidden)[: min(hidden, 9)]
    if hidden <= 9:  # one-hot rows read single codes back exactly at batch <= 9
        assert torch.equal(head.weights(eye.bfloat16()).double(), exact_weight(FP8, t).t().float().double())


def _every_nibble_rows(hidden: int, gen: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(v, codes [v, hidden], packed [v, hidden / 2])``: 261 random NVFP4 rows in which row r also holds
    nibble r % 16 at column 7 r % hidden, so every nibble sits in every lane position; element 2k in the
    low nibble (row-major, as stored)."""
    v = 16 * 16 + 5
    codes = torch.randint(0, 16, (v, hidden), dtype=torch.uint8, generator=gen)
    codes[torch.arange(v), (torch.arange(v) * 7) % hidden] = torch.arange(v, dtype=torch.uint8) % 16
    return v, codes, codes[:, 0::2] | (codes[:, 1::2] << 4)


@pytest.mark.parametrize("hidden", [16, 144, 512, 528, 784, 1040])
def test_nvfp4_every_nibble_batches_1_to_9(isa, hidden):
    """Widths that take the 4-group decoder (>= 32 blocks), its pairs and singles, and a partial group."""
    gen = torch.Generator().manual_seed(hidden)
    v, _, packed = _every_nibble_rows(hidden, gen)
    t = nvfp4_tensors(v, hidden, gen, packed=packed, scale_codes=(0x01, 0x7F))
    w64 = exact_weight(NVFP4, t)
    for activation in ("none", "static"):
        head = make_head(NVFP4, activation, v, hidden, t)
        x = torch.randn(9, hidden, generator=gen).bfloat16()
        _batch_invariant(head, x)
        for b in BATCHES_1_9:
            check(head, x[:b], w64, fused_path=True)
    for b in BATCHES_1_9:  # one-hot rows: every nibble under every block scale read back exactly
        cols = (torch.arange(b) * 37) % hidden
        eye = torch.zeros(b, hidden)
        eye[torch.arange(b), cols] = 1.0
        got = make_head(NVFP4, "none", v, hidden, t).weights(eye.bfloat16()).double()
        assert torch.equal(got, w64[:, cols].t().float().double())


@pytest.mark.parametrize(("name", "algo", "spec"), adversarial_cases(), ids=[c[0] for c in adversarial_cases()])
def test_adversarial_values_every_path_and_batch(isa, name, algo, spec):
    v, h = 41, 528  # the NVFP4 4-group decoder and a pair; FP8 tail-free
    gen = torch.Generator().manual_seed(7)
    t = adversarial_tensors(algo, spec, v, h, gen)
    w64 = exact_weight(algo, t)
    head = make_head(algo, "none", v, h, t)
    for b in (1, 2, 3, 5, 8, 9):
        for x in (torch.zeros(b, h), torch.full((b, h), 448.0), torch.randn(b, h, generator=gen) * 1e4):
            got = check(head, x.bfloat16(), w64, fused_path=True)
            if not bool(x.any()) or not bool(w64.any()):
                assert torch.equal(got, torch.zeros_like(got)) and not bool(torch.signbit(got).any())


@pytest.mark.parametrize("algo", [FP8, NVFP4])
def test_uneven_shards_and_partitions_every_batch(isa, algo):
    v, h = 203, 528
    t = tensors_for(algo, v, h, seed=11, per_row=algo is FP8)
    w64 = exact_weight(algo, t)
    single = make_head(algo, "none", v, h, t, per_row=algo is FP8)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(12)).bfloat16()
    for b in BATCHES_1_9:
        full = check(single, x[:b], w64, fused_path=True)
        for rank in range(3):
            mapping = Mapping(world_size=3, rank=rank, tp_size=3)
            head = make_head(algo, "none", v, h, t, per_row=algo is FP8, mapping=mapping, layout="uneven")
            assert torch.equal(check(head, x[:b], w64, fused_path=True), full[:, head.shard.start : head.shard.end])
        prepared = single.weights.prepare(x[:b])
        pieces = torch.cat([single.weights.block_logits(prepared, lo, min(v, lo + 29)) for lo in range(0, v, 29)], 1)
        assert torch.equal(pieces.double(), full)


# ---- the vector paths give the same bits ---------------------------------------------------------------------
def _vector_paths() -> list[kernels.Loaded]:
    """The builds of the vector paths this CPU runs (AVX-512, AVX2); portable may round a * b + c twice."""
    if library.disabled_reason() is not None:
        pytest.skip(library.disabled_reason())
    paths = []
    for isa in ("avx512", "avx2"):
        if _isa_runs_here(isa) is None:
            try:
                paths.append(library.load_isa(isa))
            except Exception as exc:  # no compiler here: the fused tests above skip for the same reason
                pytest.skip(f"{isa} build unavailable: {exc}")
    if len(paths) < 2:
        pytest.skip(f"fewer than two vector paths run here ({[p.isa for p in paths]})")
    return paths


def _same_on_every_path(paths: list[kernels.Loaded], call, *args) -> torch.Tensor:
    """``call(library, *args)`` (a :mod:`trtvocab.kernels.gemm` call) on every path: the same bits."""
    first = call(paths[0], *args)
    for other in paths[1:]:
        got = call(other, *args)
        assert torch.equal(got.view(torch.int32), first.view(torch.int32)), f"{other.isa} differs from {paths[0].isa}"
    return first


@pytest.mark.parametrize("hidden", [13, 520, 1029])
def test_fp8_and_dense_bitwise_across_paths(hidden):
    paths = _vector_paths()
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 3  # odd: the AVX-512 row pairs end with a row paired with itself
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    scales = [torch.tensor(2e-3), torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60)]
    dense = {dt: (torch.randn(v, hidden, generator=gen) * 0.05).to(dt) for dt in DENSE_DTYPES}
    for b in BATCHES_1_9:
        x = kernels.fp8_x(torch.randn(b, hidden, generator=gen).bfloat16().float())
        for scale in scales:
            for lo, hi in ((0, v), (3, v - 2)):  # a shard starting mid-pair
                rows_scale = scale if scale.numel() == 1 else scale[lo:hi]
                _same_on_every_path(paths, gemm.fp8_logits, x, hidden, codes[lo:hi], rows_scale)
        for w in dense.values():
            _same_on_every_path(paths, gemm.dense_logits, x, hidden, w)


def test_dense_float32_whole_rows_and_chunks_bitwise_across_paths():
    """The AVX-512 kernel runs float32 rows whole while x (B rows of H float32) fits in 256 KiB, else in
    K-chunks: at H = 8200, B = 7 runs whole, B = 8 in chunks (and a tail step); every path, the same bits."""
    paths = _vector_paths()
    gen = torch.Generator().manual_seed(8200)
    hidden, v = 8200 + 3, 37
    w = torch.randn(v, hidden, generator=gen) * 0.05
    for b in (7, 8):
        x = kernels.fp8_x(torch.randn(b, hidden, generator=gen))
        _same_on_every_path(paths, gemm.dense_logits, x, hidden, w)
        _same_on_every_path(paths, gemm.dense_logits, x, hidden, w[3:])


@pytest.mark.parametrize("hidden", [16, 144, 256, 528, 784, 1040, 5120])
def test_nvfp4_bitwise_across_paths(hidden):
    """Widths with no full pair of lane groups, an odd group after the pairs, a partial group, and the head's H."""
    paths = _vector_paths()
    gen = torch.Generator().manual_seed(hidden)
    v, _, packed = _every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        for b in BATCHES_1_9:
            x = kernels.nvfp4_x(torch.randn(b, hidden, generator=gen).bfloat16().float() * 100)
            _same_on_every_path(paths, gemm.nvfp4_logits, x, hidden, packed, bs, global_scale)
            _same_on_every_path(paths, gemm.nvfp4_logits, x, hidden, packed[5:], bs[5:], global_scale)


# ---- the vdpbf16ps kernels (AVX-512 BF16, every batch): the FMA chain's bits, taken only where x fits ---------
def _has_dpbf16_kernels(lib: ctypes.CDLL) -> bool:
    """Whether this build compiled the vdpbf16ps kernels (its x check answers -1 where it has none)."""
    return lib.trtvocab_fused_x_fits_bf16(None, *[ctypes.c_int64(0)] * 3) != -1


def test_dpbf16_kernels_are_built_where_the_cpu_has_them():
    """The native build compiles them on a CPU with avx512_bf16 and avx512vbmi, the forced avx512
    (x86-64-v4) and avx2 builds never do; a build runs them only where it has them (and only where
    vdpbf16ps passed the library's check against two FMAs on this CPU: measured so on Zen 5, so a
    CPU that fails it runs the FMA kernels, which this test accepts)."""
    flags = kcompile.cpu_flags()
    for isa in ("native", "avx512", "avx2"):
        if _isa_runs_here(isa) is not None:
            continue
        try:
            loaded = library.load_isa(isa)
        except Exception as exc:
            pytest.skip(f"{isa} build unavailable: {exc}")
        built = _has_dpbf16_kernels(loaded.lib)
        want = isa == "native" and loaded.isa == "avx512" and {"avx512_bf16", "avx512vbmi"} <= flags
        assert built == want, isa
        assert loaded.lib.trtvocab_fused_dpbf16() in ((0, 1) if built else (0,)), isa


def _x_cases(b: int, width: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """x [b, width] that qualifies for the vdpbf16ps kernels (bf16 values, 2**-100 <= |x| <= 2**100, signed
    zeros), and x that does not: one value not exact in bf16, one tiny, one huge, inf, NaN (at the last row)."""
    x = torch.randn(b, width, generator=gen).bfloat16().float()
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    edge = x.clone()
    edge[0, :4] = torch.tensor([2.0**-100, -(2.0**100), 2.0**-100 * 1.5, 2.0**99 * 1.9921875])
    small = torch.where(x == 0, x, x.sign() * x.abs().clamp(min=2.0**-8)) * 2.0**-92  # |x| >= 2**-100
    cases = [("fits", x), ("edge", edge), ("big", x * 2.0**95), ("small", small)]
    for name, value in (("non-bf16", 1.0 + 2.0**-12), ("tiny", 2.0**-101), ("huge", 2.0**101),
                        ("inf", math.inf), ("nan", math.nan)):
        y = x.clone()
        y[-1, width // 2] = value
        cases.append((name, y))
    return cases


def test_dpbf16_x_check_takes_exactly_the_x_that_fits():
    """x_fits_bf16 (the per-call choice of the vdpbf16ps kernels) accepts the qualifying cases, whatever
    the batch and width (a vector body and a scalar tail), and refuses every other one."""
    if _isa_runs_here("native") is not None:
        pytest.skip(_isa_runs_here("native"))
    try:
        lib = library.load_isa("native").lib
    except Exception as exc:
        pytest.skip(f"native build unavailable: {exc}")
    if not _has_dpbf16_kernels(lib):
        pytest.skip("no vdpbf16ps kernels in this build")
    gen = torch.Generator().manual_seed(3)
    for b, width in ((1, 8), (3, 40), (9, 1029)):
        for name, x in _x_cases(b, width, gen):
            x = x.contiguous()
            fits = lib.trtvocab_fused_x_fits_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(b),
                                                  ctypes.c_int64(x.stride(0)), ctypes.c_int64(width))
            assert fits == int(name in ("fits", "edge", "big", "small")), (name, b, width)


def test_dpbf16_kernels_run_by_default_on_amd_only():
    """Where the native build has the vdpbf16ps kernels and they match the FMAs, they run by default on AMD
    CPUs only (a Xeon measured vdpbf16ps at a quarter of its 512-bit FMA rate: the FMA kernels are faster), and
    trtvocab_fused_set_dpbf16 turns them on (1) and off (0) on any such CPU."""
    if _isa_runs_here("native") is not None:
        pytest.skip(_isa_runs_here("native"))
    lib = library.load_isa("native").lib
    if not _has_dpbf16_kernels(lib):
        assert [lib.trtvocab_fused_set_dpbf16(m) for m in (1, 0, -1)] == [0, 0, 0]
        pytest.skip("no vdpbf16ps kernels in this build")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        amd = any(line.split(":", 1)[1].strip() == "AuthenticAMD" for line in f if line.startswith("vendor_id"))
    try:
        matches = lib.trtvocab_fused_set_dpbf16(1)
        assert lib.trtvocab_fused_set_dpbf16(0) == 0
        assert lib.trtvocab_fused_set_dpbf16(-1) == int(amd and matches == 1)
    finally:
        lib.trtvocab_fused_set_dpbf16(-1)


@pytest.fixture
def dpbf16_paths() -> Iterator[list[kernels.Loaded]]:
    """The vector builds, the native one first, its vdpbf16ps kernels turned on whatever this CPU's default
    (off on Intel: slower there, the same bits), and back to the default afterwards."""
    paths = _vector_paths()
    if _isa_runs_here("native") is None:
        paths = [library.load_isa("native"), *paths]
    if not any(p.lib.trtvocab_fused_set_dpbf16(1) for p in paths):
        pytest.skip("no build here runs the vdpbf16ps kernels (a CPU without avx512_bf16 / avx512vbmi)")
    try:
        yield paths
    finally:
        for p in paths:
            p.lib.trtvocab_fused_set_dpbf16(-1)


def _same_bits_or_nan(paths: list[kernels.Loaded], call, *args) -> None:
    """Every path gives the same bits (NaN logits: NaN on every path, any payload)."""
    first = call(paths[0], *args)
    for other in paths[1:]:
        got = call(other, *args)
        nan = torch.isnan(first)
        assert torch.equal(torch.isnan(got), nan), f"{other.isa}: NaN logits differ"
        assert torch.equal(got[~nan].view(torch.int32), first[~nan].view(torch.int32)), f"{other.isa} differs"


@pytest.mark.parametrize("hidden", [13, 24, 520, 1029])
def test_dpbf16_fp8_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """FP8 heads (every code, adversarial scales, a shard starting mid-pair, odd step counts) on the
    vdpbf16ps kernels and the FMA kernels: the same bits, for x that qualifies and x that does not."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 1)
    v = FINITE_FP8.numel() + 3
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    scales = [torch.tensor(2e-3), torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60)]
    for b in BATCHES_1_9:
        for _, x in _x_cases(b, hidden, gen):
            x8 = kernels.fp8_x(x)
            for scale in scales:
                for lo, hi in ((0, v), (3, v - 2)):
                    rows_scale = scale if scale.numel() == 1 else scale[lo:hi]
                    _same_bits_or_nan(paths, gemm.fp8_logits, x8, hidden, codes[lo:hi], rows_scale)


def _bf16_rows_at_the_domain_edges(v: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 weights [v, hidden]: random rows, and rows whose logit shows whether a weight outside the vdpbf16ps
    domain was read as the FMAs read it: a lone subnormal, a lone tiny normal, rows of 2**-30 (products
    below 2**-124 against tiny x), a lone huge weight (products past 2**102 against big x), a zero row."""
    w = torch.randn(v, hidden, generator=gen) * 0.05
    w[1] = 0.0
    w[1, hidden // 2] = 1e-40  # subnormal in bf16: vdpbf16ps reads it as zero
    w[2] = 0.0
    w[2, -1] = -(2.0**-126)
    w[3] = 2.0**-30 * torch.where(torch.rand(hidden, generator=gen) < 0.5, -1.0, 1.0)
    w[4] = 0.0
    w[4, 0] = 2.0**120
    w[5] = 0.0
    w[6, :: 5] = 0.0
    return w.bfloat16()


@pytest.mark.parametrize("hidden", [13, 24, 520, 1029])
def test_dpbf16_dense_bf16_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """Dense bf16 heads at batch 1..9 on the vdpbf16ps kernels (batch <= 8; each pass checks the weights it read
    against the domain this x allows, and reruns on FMAs where one is outside) and the FMA kernels: the same
    bits, for x that qualifies, x that does not, tiny x against tiny weights and big x against a huge weight,
    whole and from a row mid-pair."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    v = 23
    w = _bf16_rows_at_the_domain_edges(v, hidden, gen)
    for b in BATCHES_1_9:
        cases = _x_cases(b, hidden, gen)
        x = cases[0][1]
        cases.append(("tiny", x.sign() * 2.0**-99))
        big = x * 2.0**20
        big[:, 0] = 2.0**-10
        cases.append(("big vs huge", big))
        for _, xc in cases:
            x8 = kernels.fp8_x(xc)
            _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w)
            _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w[3:])


def test_dpbf16_pairs_kernels_chunked_passes(dpbf16_paths):
    """Where x's bf16 pairs outgrow a quarter of L2 (256 KiB: B = 8 past H = 16384 for dense bf16, 8192 for FP8,
    whose pairs are laid out twice) the FP8 / dense bf16 vdpbf16ps kernels read K-chunks of 64 steps for a
    tile's rows (an odd last chunk included): the same bits as the FMA kernels."""
    paths = dpbf16_paths
    hidden = 16404  # 2051 steps: the last chunk is a full pair and a partial step
    gen = torch.Generator().manual_seed(6)
    w = _bf16_rows_at_the_domain_edges(9, hidden, gen)
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (9, hidden), generator=gen)]
    for b in (7, 8):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                x8 = kernels.fp8_x(x)
                _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w)
                _same_bits_or_nan(paths, gemm.fp8_logits, x8, hidden, codes, torch.tensor(2e-3))


def _block_major_rows(hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``_every_nibble_rows`` in block-major order, with random e4m3 block scales 0x01..0x7E."""
    v, _, packed = _every_nibble_rows(hidden, gen)
    bs = torch.randint(0x01, 0x7F, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
    return nvfp4.to_block_major(packed), bs


@pytest.mark.parametrize("hidden", [16, 256, 528, 1040])
def test_dpbf16_nvfp4_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """NVFP4 heads (every nibble, the smallest and largest block scales, a partial group, a shard) on the
    vdpbf16ps kernels and the FMA kernels: the same bits, for x that qualifies and x that does not."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 2)
    v, _, packed = _every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        for b in BATCHES_1_9:
            for _, x in _x_cases(b, hidden, gen):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, global_scale)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[5:], bs[5:], global_scale)


@pytest.mark.parametrize("hidden", [2816, 4240, 5120])
def test_dpbf16_nvfp4_chunked_passes(hidden, dpbf16_paths):
    """The vdpbf16ps row-pair kernel (B = 5..8, and 3-4 where x's pairs outgrow L1) runs K-chunks of as many lane
    groups as keep x's pairs (two copies, N * 512 bytes a group) in L1 less 16 KiB, for a tile's rows: on a 48 KiB
    L1D 8 groups at B = 8, 12 at B = 5 (4 and 6 on 32 KiB). The same bits as the FMA kernels. 2816 (22 groups): a
    short last chunk; 4240 (33 and a partial group): a last chunk of one group at B = 8, of an odd number (the
    single-group tail) at B = 5; 5120: the head's H."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 3)
    packed, bs = _block_major_rows(hidden, gen)
    for b in (5, 8):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, 1e-3)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[3:], bs[3:], 1e-3)


@pytest.mark.parametrize("hidden", [6400, 12816])
def test_dpbf16_nvfp4_block_lanes_chunked_passes(hidden, dpbf16_paths):
    """Batch 2 runs the block-lanes vdpbf16ps kernel, which reads x's pairs whole while they fit in L1 (its size
    less 8 KiB) and in K-chunks of pairs for a tile's rows beyond: 6400 (25 pairs) is chunked at B = 2 on a 32 KiB
    L1D, 12816 (50 pairs and a partial group) on 48 KiB, with a short last chunk run one pair at a time. Batch 1
    runs row runs (three chunks of a row at 12816). Batches 3 and 4 run it only while x's pairs fit whole (B = 3 at
    6400 on a 48 KiB L1D: 37.5 KiB) and the row pairs otherwise (B = 4 here, B = 3 at 12816 and on 32 KiB). The
    same bits as the FMA kernels."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 4)
    packed, bs = _block_major_rows(hidden, gen)
    for b in (1, 2, 3, 4):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, 1e-3)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[3:], bs[3:], 1e-3)


@pytest.mark.parametrize("hidden", [4240, 5376, 6400])
def test_dpbf16_nvfp4_row_runs_pending_chunks(hidden, dpbf16_paths):
    """Batch 1 runs the row-runs vdpbf16ps kernel: each row in chunks of at most 20 block pairs (5376: 21 pairs,
    chunks of 11 and 10; 6400: 25, chunks of 13 and 12; 4240: one chunk of 16, then a full and a partial group
    in the 8-lane tail), each chunk's block sums scaled and added while the next chunk runs, the last one of a
    thread's rows at the end. Shards of 1, 2, 3 and 40 rows (40: two ranges of 20 rows where torch has two
    threads): the same bits as the FMA kernels."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    packed, bs = _block_major_rows(hidden, gen)
    for name, x in _x_cases(1, hidden, gen):
        if name in ("fits", "edge"):
            xn = kernels.nvfp4_x(x)
            for start, rows in ((0, 1), (7, 2), (100, 3), (3, 40)):
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[start : start + rows],
                                  bs[start : start + rows], 1e-3)


# ---- batch >= 9: the AVX-512 tile kernel, against the AVX2 one and against batch 1 -----------------------------
# The batches are the remainders of its register blocks: 8 x rows per block (4 row pairs, the last block's odd row
# paired with zeros), 6 weight rows per micro kernel, 24 per tile, 128 x rows per pass. The row ranges start
# mid-micro-kernel and mid-tile and end short of the last tile.
BATCHES_TILED = (9, 10, 17, 33, 64, 65, 130)
TILED_RANGES = ((0, None), (5, None), (7, -3), (25, -1))


def _alone(call, x: torch.Tensor, *args) -> torch.Tensor:
    """``call`` (a :mod:`trtvocab.kernels` call) on each row of ``x`` alone: batch 1, another kernel."""
    return torch.cat([call(x[i : i + 1], *args) for i in range(x.shape[0])])


def _tiled_x(b: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16-valued float32 rows: normal, huge (1e4), tiny (1e-4) and one zero row (its logits must be +0)."""
    x = torch.randn(b, hidden, generator=gen)
    x[1::3] *= 1e4
    x[2::5] *= 1e-4
    x[3] = 0.0
    return x.bfloat16().float()


def _check_tiled(call, x: torch.Tensor, w: torch.Tensor, *args) -> None:
    """Every tiled batch and row range equals the rows computed alone (batch invariance); a zero x row
    gives +0 logits."""
    for lo, hi in TILED_RANGES:
        rows = w[lo:hi]
        extra = [a[lo:hi] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == w.shape[0] else a
                 for a in args]
        want = _alone(call, x, rows, *extra)
        for b in BATCHES_TILED:
            got = call(x[:b], rows, *extra)
            assert torch.equal(got.view(torch.int32), want[:b].view(torch.int32)), f"B={b} rows [{lo}, {hi})"
        assert torch.equal(want[3].view(torch.int32), torch.zeros_like(want[3]).view(torch.int32))


@pytest.mark.parametrize("hidden", [13, 1029])
def test_fp8_and_dense_tiled_batches_equal_batch_1(isa, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 5
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    x = kernels.fp8_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
    for scale in (torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60), torch.tensor(2.0**-60)):
        _check_tiled(lambda xx, w, s: kernels.fp8_logits(xx, hidden, w, s), x, codes, scale)
    for dtype in DENSE_DTYPES:
        w = (torch.randn(v, hidden, generator=gen) * 0.05).to(dtype)
        _check_tiled(lambda xx, ww: kernels.dense_logits(xx, hidden, ww), x, w)
    # one-hot rows read every code back exactly at a tiled batch
    b = 17
    eye = torch.zeros(b, hidden)
    cols = torch.arange(b) % hidden
    eye[torch.arange(b), cols] = 1.0
    got = kernels.fp8_logits(kernels.fp8_x(eye), hidden, codes, torch.tensor(0.75))
    assert torch.equal(got, codes.view(F8).float()[:, cols].t() * 0.75)


@pytest.mark.parametrize("hidden", [16, 144, 528, 1040])
def test_nvfp4_tiled_batches_equal_batch_1(isa, hidden):
    """A partial lane group (16, 144, 528) and an odd count of full groups (1040: 8 full + 1 partial)."""
    gen = torch.Generator().manual_seed(hidden)
    v, codes, packed = _every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    x = kernels.nvfp4_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        _check_tiled(lambda xx, p, s, g: kernels.nvfp4_logits(xx, hidden, p, s, g), x, packed, bs, global_scale)
    # one-hot rows: every nibble under every block scale read back exactly at a tiled batch
    bs = (torch.arange(v * (hidden // 16)) % 0x7E + 1).to(torch.uint8).reshape(v, hidden // 16).view(F8)
    b = 33
    cols = (torch.arange(b) * 37) % hidden
    eye = torch.zeros(b, hidden)
    eye[torch.arange(b), cols] = 1.0
    got = kernels.nvfp4_logits(kernels.nvfp4_x(eye), hidden, packed, bs, 0.375)
    want = nvfp4.dequantize_nvfp4(codes[:, 0::2] | (codes[:, 1::2] << 4), bs, torch.tensor(0.375))
    assert torch.equal(got, want[:, cols].t() + 0.0)


def test_tiled_batches_bitwise_across_paths():
    paths = _vector_paths()
    gen = torch.Generator().manual_seed(21)
    for hidden in (13, 520, 1029):
        v = FINITE_FP8.numel() + 5
        codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
        codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
        scale = torch.rand(v, generator=gen) * 1e-2 + 1e-4
        dense = [(torch.randn(v, hidden, generator=gen) * 0.05).to(dt) for dt in DENSE_DTYPES]
        x = kernels.fp8_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
        for b in BATCHES_TILED:
            for lo, hi in TILED_RANGES:
                _same_on_every_path(paths, gemm.fp8_logits, x[:b], hidden, codes[lo:hi], scale[lo:hi])
                for w in dense:
                    _same_on_every_path(paths, gemm.dense_logits, x[:b], hidden, w[lo:hi])
    for hidden in (16, 528, 1040, 5120):
        v = 16 * 16 + 5
        packed = nvfp4.to_block_major(torch.randint(0, 256, (v, hidden // 2), dtype=torch.uint8, generator=gen))
        bs = torch.randint(0x01, 0x7F, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        x = kernels.nvfp4_x(_tiled_x(max(BATCHES_TILED), hidden, gen) * 100)
        for b in BATCHES_TILED:
            for lo, hi in TILED_RANGES:
                _same_on_every_path(paths, gemm.nvfp4_logits, x[:b], hidden, packed[lo:hi], bs[lo:hi], 1e-3)


@pytest.mark.parametrize("hidden", [13, 24, 1029, 528, 5120])
def test_dpbf16_tiled_batches_bitwise(hidden, dpbf16_paths):
    """Batches >= 9 on the vdpbf16ps tile kernel (tile and x packed into bf16 step pairs) and on the FMA tile
    kernels: the same bits, for x that qualifies and x that does not, every FP8 code under adversarial
    scales at an odd step count (13: 2 steps, 24: 3, 1029: 129: the last step paired with a zero step) and
    NVFP4 (528: a partial lane group; 5120: the head's H) with the smallest and largest block scales."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    if hidden % 16:
        v = FINITE_FP8.numel() + 5
        codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
        codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
        scales = [torch.rand(v, generator=gen)[3:] * 1e-2 + 1e-4, torch.tensor(2.0**60)]
        for b in (9, 17, 64):
            for _, x in _x_cases(b, hidden, gen):
                for scale in scales:
                    _same_bits_or_nan(paths, gemm.fp8_logits, kernels.fp8_x(x), hidden, codes[3:], scale)
        return
    v, _, packed = _every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    block_scales = [(torch.randint(*codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8), g)
                    for codes, g in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448))]
    for b in (9, 17, 64):
        for _, x in _x_cases(b, hidden, gen):
            xn = kernels.nvfp4_x(x)
            for bs, global_scale in block_scales:
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[5:], bs[5:], global_scale)


# ---- the dense bf16 / fp16 / float32 kernel -----------------------------------------------------------------
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
    got = _batch_invariant(head, x)
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


def test_read_probe_reads_every_byte(isa):
    buf = torch.arange(1 << 16, dtype=torch.int64)
    assert probes.read_probe(buf) == int(buf.sum()) % (1 << 64)
    with pytest.raises(ValueError):
        probes.read_probe(torch.zeros(3, dtype=torch.uint8))


def test_mul_probe_counts_the_multiplies_its_chains_made(isa):
    # 16 chains a thread on the widest vectors of the build: AVX-512 16 lanes, AVX2 8, portable 1; the
    # chains' sum (every lane exactly 1.0) is checked inside, so a dropped chain raises.
    lanes = {"avx512": 16, "avx2+fma+f16c": 8, "portable": 1}[library.require().isa]
    assert probes.mul_probe(1000) == 1000 * 16 * lanes * torch.get_num_threads()
    with pytest.raises(ValueError, match="steps"):
        probes.mul_probe(0)


def test_gguf_chain_probe_counts_the_weights_its_chains_multiplied(isa):
    # 4 rows of 768 codes a thread, x = 0 (every chain exactly 0: checked inside)
    assert probes.gguf_chain_probe(10) == 10 * 4 * 768 * torch.get_num_threads()
    with pytest.raises(ValueError, match="rounds"):
        probes.gguf_chain_probe(0)
    # x = 1: every product is a multiple of 2^-6 and every sum exact, so the chains' total is the float64
    # sum of the probe's own codes times scales (the C++ file's pattern), once per round and thread
    import ctypes

    q = [[(i * 7 + r) % 64 - 32 for i in range(768)] for r in range(4)]
    scale = [[0.015625 * (1 + (s + r) % 7) for s in range(96)] for r in range(4)]
    one_round = sum(scale[r][i // 8] * q[r][i] for r in range(4) for i in range(768))
    sink = ctypes.c_float(0.0)
    made = library.require().lib.trtvocab_gguf_chain_probe(7, 1.0, ctypes.addressof(sink))
    assert made == 7 * 4 * 768 * torch.get_num_threads()
    assert sink.value == one_round * 7 * torch.get_num_threads()
