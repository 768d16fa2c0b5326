"""The ModelOpt exporter: an LM head quantized with ``modelopt.torch.quantization`` and exported with
ModelOpt's per-layer helpers, on the CPU (the compressed-tensors one: :mod:`trtvocab.quant.ct_export`).

The head is wrapped as ``nn.Linear(H, V, bias=False)`` named ``lm_head``
(:class:`~trtvocab.quant.head_module.HeadOnly`), quantized with ModelOpt's stock FP8 / NVFP4 presets
(their ``*lm_head*`` exclusion switched back on) and calibrated (max calibrator) on the given hidden
states. Writing the checkpoint around it: :func:`trtvocab.quant.quantize.quantize_checkpoint`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trtvocab.base.inputs import check_hidden_states
from trtvocab.errors import ConfigError, QuantizationError
from trtvocab.quant.config import QuantAlgo
from trtvocab.quant.head_module import HeadOnly
from trtvocab.quant.nvfp4 import BLOCK as NVFP4_GROUP

# ---- what is written ------------------------------------------------------------------------------
# ModelOpt's export (modelopt.torch.export.quant_utils):
#
#     FP8    lm_head.weight float8_e4m3fn [V, H]   weight_scale fp32 ()   input_scale fp32 () (W8A8)
#     NVFP4  lm_head.weight uint8 [V, H/2]         weight_scale e4m3 [V, H/16]
#            weight_scale_2 fp32 ()                input_scale fp32 () (W4A4)
#
# Everything ModelOpt does here runs on the CPU: max calibration only *observes* the activations,
# and the export helpers quantize with ``FP8QTensor`` / ``NVFP4QTensor`` (the NVFP4 fake-quant
# *forward* is CUDA-only and is never called). The static activation scale (``calib``) comes from
# ``amax(|x|)`` of the calibration rows in the model's dtype, in both formats.

DEFAULT_BATCH_ROWS = 256
MAX_BATCH_ROWS = 2**31 - 1
ProgressFn = Callable[[int, int], None]  # (batches done, batches total)


def import_modelopt() -> tuple[Any, Any]:
    """``(modelopt.torch.quantization, modelopt.torch.export.quant_utils)``, imported quietly."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "transformers X is not tested with modelopt" on import
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import quant_utils as qu
    except ImportError as exc:
        raise QuantizationError(f"quantizing needs nvidia-modelopt (pip install 'trtvocab[quant]'): {exc}") from None
    return mtq, qu



def modelopt_config(algo: QuantAlgo, *, calibrate_inputs: bool) -> dict[str, Any]:
    """ModelOpt's stock preset for ``algo`` with the LM-head quantizers enabled.

    The presets disable ``*lm_head*`` (most deployments keep the head dense); the
    entries appended here come later in the list and so win. Only the weight and,
    with calibration data, the input quantizer are enabled: ``output_quantizer``
    stays off as in every preset.
    """
    mtq, _ = import_modelopt()
    preset = mtq.FP8_DEFAULT_CFG if algo is QuantAlgo.FP8 else mtq.NVFP4_DEFAULT_CFG
    cfg = copy.deepcopy(preset)
    entries = cfg["quant_cfg"]
    entries.append({"quantizer_name": "*lm_head.weight_quantizer", "enable": True})
    entries.append({"quantizer_name": "*lm_head.input_quantizer", "enable": calibrate_inputs})
    return cfg



def check_batch_rows(batch_rows: Any) -> int:
    """``batch_rows`` as a positive int (bools and floats refused); ConfigError naming the option."""
    if not isinstance(batch_rows, int) or isinstance(batch_rows, bool) or not 1 <= batch_rows <= MAX_BATCH_ROWS:
        raise ConfigError(f"`batch_rows` (calibration rows per batch) must be an int in [1, {MAX_BATCH_ROWS}], "
                          f"got {batch_rows!r}")
    return batch_rows


def _calib_batches(calib: torch.Tensor, batch_rows: int) -> list[torch.Tensor]:
    return list(torch.split(calib, batch_rows)) if calib.shape[0] else []


def check_calib(calib: Any, hidden: int) -> torch.Tensor:
    return check_hidden_states(calib, hidden_size=hidden, finite=True, what="calibration hidden_states")



def quantize_head(
    weight: torch.Tensor,
    algo: QuantAlgo,
    calib: torch.Tensor | None = None,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    progress: ProgressFn | None = None,
) -> tuple[dict[str, torch.Tensor], float, float | None]:
    """ModelOpt-quantize a ``[V, H]`` head; returns ``(tensors by lm_head.* name, weight amax, input amax)``.

    ``calib`` rows are cast to the weight's dtype first: ModelOpt calibrates on the
    activations the model actually produces, which are in the model's dtype.
    """
    check_batch_rows(batch_rows)
    mtq, qu = import_modelopt()
    hidden = weight.shape[1]
    if algo is QuantAlgo.NVFP4 and hidden % NVFP4_GROUP:
        raise QuantizationError(f"NVFP4 needs the hidden size to be a multiple of {NVFP4_GROUP}, got {hidden}")
    if not bool(torch.isfinite(weight).all()):
        raise QuantizationError("the head weight contains NaN or Inf; it cannot be quantized")
    if float(weight.abs().max()) == 0.0:
        raise QuantizationError("the head weight is all zeros: its scale would be 0")
    model = HeadOnly(weight)
    forward_loop = None
    if calib is not None:
        batches = _calib_batches(check_calib(calib, hidden).to(weight.dtype), batch_rows)

        def forward_loop(m: nn.Module) -> None:
            # Max calibration only records |x|.max(): no fake quantization runs here,
            # which is why it works on the CPU for NVFP4 too.
            with torch.no_grad():
                for i, batch in enumerate(batches):
                    m(batch)
                    if progress is not None:
                        progress(i + 1, len(batches))

    # ModelOpt warns about untested transformers versions and prints "Inserted N quantizers"
    # to stdout: keep both out of the CLI's output (and out of its JSON).
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, modelopt_config(algo, calibrate_inputs=calib is not None), forward_loop)
    layer = model.lm_head
    fmt = qu.get_quantization_format(layer)
    block = qu.get_weight_block_size(layer)
    scale = qu.get_weight_scaling_factor(layer)
    scale_2 = qu.get_weight_scaling_factor_2(layer)
    qweight = qu.to_quantized_weight(layer.weight.data, scale, fmt, scale_2, block)
    out: dict[str, torch.Tensor] = {"lm_head.weight": qweight.contiguous()}
    if algo is QuantAlgo.FP8:
        out["lm_head.weight_scale"] = scale.float().reshape(())  # ModelOpt keeps a [1] amax; files hold a scalar
    else:
        out["lm_head.weight_scale"] = scale.contiguous()
        out["lm_head.weight_scale_2"] = scale_2.float().reshape(())
    input_amax = None
    if calib is not None:
        input_scale = qu.get_activation_scaling_factor(layer)
        out["lm_head.input_scale"] = input_scale.float().reshape(())
        input_amax = float(layer.input_quantizer.amax.float())
    return out, float(layer.weight_quantizer.amax.float()), input_amax


def hf_quant_config(algo: QuantAlgo) -> dict[str, Any]:
    """The ``hf_quant_config.json`` ModelOpt writes, for a checkpoint whose quantized layer is the head."""
    import modelopt

    quantization: dict[str, Any] = {"quant_algo": algo.value, "kv_cache_quant_algo": None}
    if algo is QuantAlgo.NVFP4:
        quantization["group_size"] = NVFP4_GROUP
    quantization["exclude_modules"] = []
    return {"producer": {"name": "modelopt", "version": modelopt.__version__}, "quantization": quantization}



DEFAULT_BATCH_ROWS = 256
MAX_BATCH_ROWS = 2**31 - 1

ProgressFn = Callable[[int, int], None]  # (batches done, batches total)


__all__ = ["DEFAULT_BATCH_ROWS", "MAX_BATCH_ROWS", "check_batch_rows", "check_calib", "hf_quant_config",
           "import_modelopt", "modelopt_config", "quantize_head"]
