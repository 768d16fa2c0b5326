"""``generate --body-kernels``: the body's float32 linear layers on trtvocab's dense kernel.

* A module tree's float32 ``nn.Linear`` layers, swapped in, give a float64 recomputation of
  ``x @ W.T + b`` within float32 rounding; each row's bits do not depend on the batch it came in
  (up to the kernel's band); larger calls (prefill) are torch's own, bitwise; leaving the block
  restores the modules; ``torch.library.opcheck`` accepts the custom op a compiled step calls.
* On SmolLM2, greedy ids with the body on the kernel equal ``transformers.generate``'s on a
  left-padded batch, eager and under ``--compile-step``.
* Without the kernels the option is refused by name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.pipeline.test_generate import A, B, hf_generate
from trtvocab import kernels
from trtvocab.errors import InputError
from trtvocab.kernels import gemm
from trtvocab.pipeline.body_kernels import BODY_MAX_BATCH, KernelLinears, body_kernel_reason, dense_linear


@pytest.fixture
def kernels_here() -> None:
    """Skips where the option cannot run (asked at run time: collection builds no kernels)."""
    reason = body_kernel_reason()
    if reason is not None:
        pytest.skip(f"--body-kernels: {reason}")


needs_kernels = pytest.mark.usefixtures("kernels_here")


def tree(seed: int = 0) -> torch.nn.Module:
    """Two linears (with and without a bias, H a multiple of 8) and one the kernel cannot take (H = 12)."""
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.ModuleDict({"up": torch.nn.Linear(64, 96), "down": torch.nn.Linear(96, 40, bias=False),
                               "odd": torch.nn.Linear(12, 8)})
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net.eval()


def band() -> int:
    loaded = kernels.load()
    assert loaded is not None
    return min(BODY_MAX_BATCH, gemm.dense_max_batch(torch.float32, loaded.isa))


@needs_kernels
def test_swapped_linears_match_float64_and_are_batch_invariant() -> None:
    net = tree()
    swap = KernelLinears(net)
    assert len(swap.forwards) == 2  # "odd" stays torch's
    x = torch.randn(band(), 2, 64, generator=torch.Generator().manual_seed(1))[:, 0]  # a strided view
    with torch.no_grad(), swap.swapped():
        up = net["up"](x)
        down = net["down"](up)
        one_by_one = torch.cat([net["down"](up[i : i + 1]) for i in range(up.shape[0])])
    ref_up = x.double() @ net["up"].weight.double().T + net["up"].bias.double()
    ref_down = up.double() @ net["down"].weight.double().T
    for got, ref, k in ((up, ref_up, 64), (down, ref_down, 96)):
        bound = 4 * k * torch.finfo(torch.float32).eps * ref.abs().max()
        assert (got.double() - ref).abs().max() <= bound
    assert torch.equal(one_by_one, down)


@needs_kernels
def test_prefill_rows_are_torch_and_leaving_restores_the_modules() -> None:
    net = tree()
    swap = KernelLinears(net)
    x = torch.randn(band() + 1, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = net["up"](x)
        with swap.swapped():
            assert "forward" in vars(net["up"])
            big = net["up"](x)
    assert torch.equal(big, plain)
    assert all("forward" not in vars(m) for m in net.modules())


@needs_kernels
def test_the_compiled_steps_custom_op_passes_opcheck() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(24, 64, generator=gen)
    torch.library.opcheck(dense_linear, (x, w), test_utils=("test_schema", "test_faketensor"))
    ref = x.double() @ w.double().T
    assert (dense_linear(x, w).double() - ref).abs().max() <= 4 * 64 * torch.finfo(torch.float32).eps * ref.abs().max()


def test_refused_by_name_without_the_kernels(monkeypatch) -> None:
    monkeypatch.setenv("TRTVOCAB_KERNELS", "0")
    with pytest.raises(InputError, match="`body_kernels`"):
        KernelLinears(tree())


needs_model = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "xgrammar")),
                                 reason="trtvocab generate needs transformers and xgrammar")


@pytest.fixture(scope="module")
def loaded(smollm2: Path):
    from trtvocab.pipeline import generate as G

    return G.load_model(smollm2)


@needs_kernels
@needs_model
@pytest.mark.model
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile-step"])
def test_greedy_ids_equal_transformers_generate(loaded, smollm2: Path, compiled: bool) -> None:
    from trtvocab.pipeline import generate as G

    prompts = [A, B, "Sushi is a dish from", "Once upon a time"]
    spec, _ = G.prepare(smollm2, prompts, tp=1, max_new_tokens=10, body_kernels=True,
                        kv_cache="static" if compiled else "dynamic", compile_step=compiled)
    report = G.generate(spec, loaded)
    assert [r.token_ids for r in report.results] == hf_generate(loaded, prompts, 10)
    assert all("forward" not in vars(m) for m in loaded.model.modules())
