"""The body's float32 linear layers on trtvocab's dense kernel at decode batches (``generate``'s ``body_kernels``).

At a decode step a transformers body multiplies a few rows by each of its linear layers' weights
(SmolLM2: 210 of them, 425 MB of float32 a step). torch's sgemm is slow at that shape (one thread,
8 rows: about 7.5 GB/s here); the dense kernel the float32 heads already use (``kernels.gemm.dense_logits``,
one fixed chain of FMA lanes a logit) reads the same weights at 16-18 GB/s. :class:`KernelLinears`
swaps the ``forward`` of every float32 ``nn.Linear`` under a module for one that calls the kernel when a
call's rows fit its batch band (:func:`trtvocab.kernels.dense_max_batch`, at most :data:`BODY_MAX_BATCH`)
and torch otherwise (prefill), and restores the modules on exit, so the model object stays transformers'
own for anyone else.

Numbers: each output is the kernel's chain, not sgemm's order: within float32 rounding of it, bitwise
the same for any batch up to the band (batch invariant), and the same greedy ids as ``transformers`` on
the prompts the tests run. Weights are read where they lie (no copy); a bias is added after the chain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from trtvocab import kernels
from trtvocab.errors import EngineUnavailableError, InputError
from trtvocab.kernels import gemm


def _eligible(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.stride(1) == 1
            and module.in_features % gemm.LANES == 0
            and (module.bias is None or module.bias.dtype == torch.float32))


# The op a compiled step calls: defined on torch's dispatcher with a CPU kernel (and a fake one for tracing),
# not through ``torch.library.custom_op``, whose autograd wrapper cost 16 us a call against 7.5 (SmolLM2's step
# makes 210 calls). It is only called without autograd (``_kernel_forward`` hands grad-enabled calls to torch).
_LIBRARY = torch.library.Library("trtvocab", "FRAGMENT")
_LIBRARY.define("dense_linear(Tensor x, Tensor weight) -> Tensor")


def _dense_linear_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    loaded = kernels.load()
    if loaded is None:
        raise EngineUnavailableError(f"trtvocab::dense_linear: the fused kernels are unavailable "
                                     f"({kernels.unavailable_reason()})")
    return gemm.dense_logits(loaded, x.contiguous(), weight.shape[1], weight)


_LIBRARY.impl("dense_linear", _dense_linear_cpu, "CPU")


@torch.library.register_fake("trtvocab::dense_linear")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


dense_linear = torch.ops.trtvocab.dense_linear.default
"""``x [N, H] @ weight [R, H].T`` on this process's dense kernel: one opaque op for ``torch.compile``
(a compiled step calls it where eager calls the kernel directly)."""

# The most rows a call runs on the kernel: its row-pair kernels (batch 1..8). Its tile kernel (9..16 rows,
# the heads' float32 band on AVX-512) was slower than torch's sgemm on SmolLM2's 210 linears, one thread
# (9 rows 0.89x, 16 rows 0.85x), so larger calls stay torch's.
BODY_MAX_BATCH = 8


def _kernel_forward(module: torch.nn.Linear, loaded: kernels.Loaded,
                    band: int) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = module.weight, module.bias
    hidden, rows = module.in_features, module.out_features
    torch_forward = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        n = x.numel() // hidden if hidden else 0
        if not (0 < n <= band) or x.dtype != torch.float32 or torch.is_grad_enabled():
            return torch_forward(x)
        flat = x.reshape(n, hidden).contiguous()
        if torch.compiler.is_compiling():
            out = dense_linear(flat, weight)
        else:
            out = gemm.dense_logits(loaded, flat, hidden, weight)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, rows)

    return forward


def _loaded_band() -> tuple[kernels.Loaded, int] | str:
    """This process's kernels and their float32 batch band, or why ``body_kernels`` cannot run here:
    the kernels do not build, or this build has no float32 batch band."""
    loaded = kernels.load()
    if loaded is None:
        return f"the fused kernels are unavailable ({kernels.unavailable_reason()})"
    band = min(BODY_MAX_BATCH, gemm.dense_max_batch(torch.float32, loaded.isa))
    if band == 0:
        return f"the {loaded.isa} kernel build multiplies no float32 decode batch (TRTVOCAB_DENSE_KERNEL or ISA)"
    return loaded, band


def body_kernel_reason() -> str | None:
    """Why ``body_kernels`` cannot run here (None: it can)."""
    found = _loaded_band()
    return found if isinstance(found, str) else None


class KernelLinears:
    """The float32 ``nn.Linear`` modules under ``root`` with their kernel ``forward`` made once;
    :meth:`swapped` puts them in place for a block (a decode step) and takes them out after.
    :class:`InputError` when the kernels cannot run here.

    Args:
        root: the module tree (a transformers body: ``model.model``).
    """

    def __init__(self, root: torch.nn.Module) -> None:
        found = _loaded_band()
        if isinstance(found, str):
            raise InputError(f"`body_kernels`: {found}")
        loaded, band = found
        self.forwards = [(m, _kernel_forward(m, loaded, band)) for m in root.modules() if _eligible(m)]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[int]:
        """Within the block the modules multiply decode batches on the kernel; yields how many."""
        for module, forward in self.forwards:
            module.forward = forward  # an instance attribute, removed below
        try:
            yield len(self.forwards)
        finally:
            for module, _ in self.forwards:
                module.__dict__.pop("forward", None)
