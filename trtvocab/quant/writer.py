"""Writing quantized heads: a dense ``[V, H]`` matrix -> the tensors a ModelOpt checkpoint stores.

The writer side of :mod:`trtvocab.quant.fp8` / :mod:`trtvocab.quant.nvfp4`, used by
``trtvocab quantize`` (beside ModelOpt's own export) and ``compare``'s ``simulate`` variants.
"""

from __future__ import annotations

import torch

from trtvocab.base.formats import Activation, Granularity
from trtvocab.errors import QuantizationError
from trtvocab.quant import fp8, nvfp4
from trtvocab.quant.config import QuantAlgo, QuantConfig


def quantize_head_tensors(
    weight: torch.Tensor,
    quant_config: QuantConfig,
    input_amax: float | torch.Tensor | None = None,
    chunk_rows: int = 4096,
    scale_search: str = "max",
    column_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """A dense ``[V, H]`` head -> checkpoint tensors (``weight``, scales) in the ModelOpt layout.

    Works through ``chunk_rows`` rows at a time so a large head needs no full float32
    copy. ``input_amax`` (calibrated ``amax(|x|)``) gives ``input_scale`` for static
    activations: ``amax / 448`` (FP8) or ``amax / (6 * 448)`` (NVFP4). ``scale_search="mse"``
    (NVFP4 only) chooses each block scale by :func:`trtvocab.quant.nvfp4.block_scales_mse`; the
    tensors are those of an ordinary NVFP4 checkpoint. ``column_weights [H]`` weights the
    search's squared error per column (``E[h_j^2]`` of calibration rows: ``mse-act``).
    """
    if scale_search != "max" and quant_config.quant_algo is not QuantAlgo.NVFP4:
        raise QuantizationError(f"scale search {scale_search!r} is for NVFP4 block scales only")
    if weight.dim() != 2:
        raise QuantizationError(f"weight: expected [V, H], got {list(weight.shape)}")
    static = quant_config.activation is Activation.STATIC
    if static and input_amax is None:
        raise QuantizationError("static activation quantization needs input_amax (the calibrated amax of inputs)")
    amax = weight.abs().amax().float()
    chunks = range(0, weight.shape[0], chunk_rows)
    out: dict[str, torch.Tensor] = {}
    if quant_config.quant_algo is QuantAlgo.FP8:
        per_row = quant_config.granularity is Granularity.PER_ROW
        pieces = [fp8.quantize_fp8(weight[s : s + chunk_rows], None if per_row else fp8.fp8_scale_from_amax(amax),
                                   per_row=per_row) for s in chunks]
        out["weight"] = torch.cat([q for q, _ in pieces])
        out["weight_scale"] = torch.cat([s.reshape(-1) for _, s in pieces]) if per_row else pieces[0][1]
        if static:
            out["input_scale"] = fp8.fp8_scale_from_amax(torch.as_tensor(input_amax))
    elif quant_config.quant_algo is QuantAlgo.NVFP4:
        g = nvfp4.global_scale_from_amax(amax)
        pieces4 = [nvfp4.quantize_nvfp4(weight[s : s + chunk_rows], g, scale_search=scale_search,
                                         column_weights=column_weights) for s in chunks]
        out["weight"] = torch.cat([p for p, _, _ in pieces4])
        out["weight_scale"] = torch.cat([b for _, b, _ in pieces4])
        out["weight_scale_2"] = g
        if static:
            out["input_scale"] = nvfp4.global_scale_from_amax(torch.as_tensor(input_amax))
    else:
        raise QuantizationError(f"cannot quantize the LM head to {quant_config.quant_algo.value}")
    return out
