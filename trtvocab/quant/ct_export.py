"""Writing a quantized head in the compressed-tensors format, through the compressed-tensors library.

``quantize_checkpoint`` with ``checkpoint_format`` ``compressed-tensors`` (beside ModelOpt's export, the
default). The head is wrapped as ``nn.Linear(H, V, bias=False)`` named ``lm_head``, given one config
group whose only target is the exact name ``lm_head`` (the form vLLM matches), calibrated as
llm-compressor's observers calibrate, and compressed and described by the library's own
``ModelCompressor`` (``compress_model`` + ``update_config``). Everything runs on the CPU.

The library scheme and the stored tensors of each ``algo`` / activation option, the calibration,
and how these files differ from ModelOpt's: docs/checkpoint_formats.md, the section "Writing both".
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trtvocab.base.formats import Activation
from trtvocab.errors import QuantizationError
from trtvocab.quant.compressed_tensors import reciprocal
from trtvocab.quant.config import QuantAlgo
from trtvocab.quant.head_module import HeadOnly
from trtvocab.quant.nvfp4 import BLOCK

HEAD = "lm_head"
TARGETS = [HEAD]  # an exact name: what vLLM's head matching (name or regex only) reaches
GROUP = "group_0"
ProgressFn = Callable[[int, int], None]


def import_compressed_tensors() -> Any:
    """``compressed_tensors``, imported quietly (a typed error naming the extra when it is missing)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import compressed_tensors
            import compressed_tensors.compressors
            import compressed_tensors.quantization
    except ImportError as exc:
        raise QuantizationError("`checkpoint_format` compressed-tensors needs the compressed-tensors library "
                                f"(pip install 'trtvocab[compressed-tensors]'): {exc}") from None
    return compressed_tensors


def library_scheme(algo: QuantAlgo, activation: Activation) -> Any:
    """The library's ``QuantizationScheme`` for ``algo`` with ``activation`` (see the module table)."""
    import_compressed_tensors()
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    if algo is QuantAlgo.FP8:
        scheme = preset_name_to_scheme("FP8", list(TARGETS))
        if activation is Activation.DYNAMIC:
            scheme.input_activations = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True,
                                                        dynamic=True)
        elif activation is Activation.NONE:
            scheme.input_activations = None
        return scheme
    if algo is QuantAlgo.NVFP4:
        if activation is Activation.DYNAMIC:
            raise QuantizationError("NVFP4 has no dynamic-activation mode here: W4A4 (with `calib`) or W4A16")
        return preset_name_to_scheme("NVFP4" if activation is Activation.STATIC else "NVFP4A16", list(TARGETS))
    raise QuantizationError(f"cannot write an LM head as {algo.value} in the compressed-tensors format")


@dataclass(frozen=True)
class CTHead:
    """What :func:`compress_head` produced: the stored tensors (``lm_head.*``, the library's names and
    dtypes), the library's ``quantization_config`` (as ``update_config`` writes it) and the amaxes."""

    tensors: dict[str, torch.Tensor]
    compressor: Any  # the library's ModelCompressor: its update_config writes config.json's quantization_config
    weight_amax: float
    input_amax: float | None
    library_version: str


def calib_range(calib: torch.Tensor, dtype: torch.dtype, batch_rows: int,
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The running ``(min, max)`` over every batch of ``calib`` cast to ``dtype`` (llm-compressor's
    ``static_minmax`` observer: the activations the model produces are in its dtype)."""
    batches = list(torch.split(calib, batch_rows)) if calib.shape[0] else []
    if not batches:
        raise QuantizationError("calibration hidden_states: no rows")
    lo = hi = None
    for i, batch in enumerate(batches):
        rows = batch.to(dtype)
        b_lo, b_hi = rows.amin(), rows.amax()
        lo = b_lo if lo is None else torch.minimum(lo, b_lo)
        hi = b_hi if hi is None else torch.maximum(hi, b_hi)
        if progress is not None:
            progress(i + 1, len(batches))
    assert lo is not None and hi is not None
    return lo.reshape(1), hi.reshape(1)


def _calibrate_weight(module: nn.Module) -> None:
    """llm-compressor's min/max weight observer, through the library's ``calculate_qparams`` /
    ``generate_gparam``: per tensor (FP8) or per 16-block under a float32 global scale (NVFP4)."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w, args = module.weight.data, module.quantization_scheme.weights
    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        global_scale = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(global_scale)
        blocks = w.unflatten(-1, (-1, args.group_size))
        lo, hi = blocks.amin(-1), blocks.amax(-1)
    elif args.strategy == QuantizationStrategy.TENSOR:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:  # pragma: no cover - the schemes of library_scheme are tensor / tensor_group
        raise QuantizationError(f"weight strategy {args.strategy} is not written here")
    scale = calculate_qparams(lo, hi, args, global_scale=global_scale)[0]
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))


def _calibrate_input(module: nn.Module, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """The static activation scale from the calibration range: FP8 ``input_scale = amax / 448`` (model
    dtype), NVFP4 ``input_global_scale = 448 * 6 / amax`` (float32)."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.input_activations
    if hasattr(module, "input_global_scale"):
        module.input_global_scale.data.copy_(generate_gparam(lo, hi).reshape(module.input_global_scale.shape))
    elif hasattr(module, "input_scale"):
        scale = calculate_qparams(lo, hi, args)[0]
        module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    else:  # pragma: no cover - a static scheme always has one of them
        raise QuantizationError("the static activation scheme has no activation scale to calibrate")


def compress_head(weight: torch.Tensor, algo: QuantAlgo, activation: Activation, *,
                  calib_range_: tuple[torch.Tensor, torch.Tensor] | None = None) -> CTHead:
    """Quantize and compress a dense ``[V, H]`` head with the compressed-tensors library.

    ``activation`` STATIC needs ``calib_range_`` (the ``(min, max)`` of :func:`calib_range`).
    Returns the module's compressed tensors, as ``save_pretrained`` would store them.
    """
    ct = import_compressed_tensors()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    if weight.dim() != 2:
        raise QuantizationError(f"weight: expected [V, H], got {list(weight.shape)}")
    if algo is QuantAlgo.NVFP4 and weight.shape[1] % BLOCK:
        raise QuantizationError(f"NVFP4 needs the hidden size to be a multiple of {BLOCK}, got {weight.shape[1]}")
    if not bool(torch.isfinite(weight).all()):
        raise QuantizationError("the head weight contains NaN or Inf; it cannot be quantized")
    if float(weight.abs().max()) == 0.0:
        raise QuantizationError("the head weight is all zeros: its scale would be 0")
    static = activation is Activation.STATIC
    if static and calib_range_ is None:
        raise QuantizationError("static activations need calibration rows (`calib`)")
    scheme = library_scheme(algo, activation)
    model = HeadOnly(weight)
    # The library logs (loguru) and shows tqdm bars on stderr: keep both out of the CLI's output.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, QuantizationConfig(config_groups={GROUP: scheme}, ignore=[]),
                                  show_progress=False)
        module = model.lm_head
        if getattr(module, "quantization_scheme", None) is None:
            raise QuantizationError("compressed-tensors did not attach the scheme to lm_head")
        _calibrate_weight(module)
        if static:
            assert calib_range_ is not None
            _calibrate_input(module, *calib_range_)
        module.quantization_status = QuantizationStatus.FROZEN
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    input_amax = None
    if static:
        assert calib_range_ is not None
        lo, hi = calib_range_
        input_amax = float(torch.maximum(lo.abs(), hi.abs()).float().max())
    return CTHead(tensors=tensors, compressor=compressor, weight_amax=float(weight.abs().amax().float()),
                  input_amax=input_amax, library_version=str(ct.__version__))


def modelopt_named(tensors: dict[str, torch.Tensor], algo: QuantAlgo) -> dict[str, torch.Tensor]:
    """The ``lm_head.*`` compressed-tensors tensors as the ModelOpt-named tensors trtvocab's reader runs
    them with (:func:`trtvocab.quant.compressed_tensors.modelopt_tensors`): the same codes and block
    scales, FP8 scales widened to float32, the NVFP4 global scales replaced by their float32
    reciprocals. For the in-memory head of ``quantize_checkpoint``'s ``gate``: the same logits as the
    written checkpoint."""
    out: dict[str, torch.Tensor] = {}
    p = HEAD + "."
    if algo is QuantAlgo.NVFP4:
        out[p + "weight"] = tensors[p + "weight_packed"]
        out[p + "weight_scale"] = tensors[p + "weight_scale"]
        out[p + "weight_scale_2"] = reciprocal(tensors[p + "weight_global_scale"], p + "weight_global_scale")
        if p + "input_global_scale" in tensors:
            out[p + "input_scale"] = reciprocal(tensors[p + "input_global_scale"], p + "input_global_scale")
        return out
    out[p + "weight"] = tensors[p + "weight"]
    out[p + "weight_scale"] = tensors[p + "weight_scale"].float().reshape(())
    if p + "input_scale" in tensors:
        out[p + "input_scale"] = tensors[p + "input_scale"].float().reshape(())
    return out


__all__ = ["CTHead", "calib_range", "compress_head", "import_compressed_tensors", "library_scheme",
           "modelopt_named"]
