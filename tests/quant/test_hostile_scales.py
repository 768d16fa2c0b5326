"""Hostile quantization scales (``trtvocab/quant/scales.py``): every per-tensor / per-row scale a quantized
head multiplies by must be finite, > 0 and small enough that scale times the largest code stays finite;
otherwise a QuantizationError naming it.
"""

from __future__ import annotations

import pytest
import torch

from tests.hostile import V


def _quant_tensors(algo: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if algo == "FP8":
        codes = torch.randint(0, 0x7F, (V, 32), dtype=torch.uint8, generator=gen)
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(0.01),
                "input_scale": torch.tensor(0.02)}
    return {"weight": torch.randint(0, 256, (V, 16), dtype=torch.uint8, generator=gen),
            "weight_scale": torch.full((V, 2), 0.5).to(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(0.01),
            "input_scale": torch.tensor(0.02)}


@pytest.mark.parametrize("algo,key", [("FP8", "weight_scale"), ("FP8", "input_scale"), ("FP8", "per-row"),
                                      ("NVFP4", "weight_scale_2"), ("NVFP4", "input_scale")])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e36, -1.0, 0.0])
def test_scales_that_would_give_inf_logits_are_refused(algo: str, key: str, bad: float) -> None:
    """Every per-tensor / per-row scale a quantized head multiplies by is finite, > 0, and small
    enough that scale * the largest code (6 * 448) stays finite: 1e36 passes a finiteness check
    but turns 448 into inf (and then the GEMM into NaN logits)."""
    from trtvocab import LMHead, QuantAlgo, QuantConfig
    from trtvocab.errors import QuantizationError

    gen = torch.Generator().manual_seed(0)
    tensors = _quant_tensors(algo, gen)
    granularity = "per_row" if key == "per-row" else "per_tensor"
    if key == "per-row":
        tensors["weight_scale"] = torch.full((V, 1), 0.01)
        tensors["weight_scale"][40] = bad
    else:
        tensors[key] = torch.tensor(bad)
    config = QuantConfig(quant_algo=QuantAlgo(algo), activation="static", granularity=granularity)
    head = LMHead(V, 32, dtype=torch.float32, quant_config=config)
    with pytest.raises(QuantizationError, match=r"weight_scale|input_scale"):
        head.load_weights(tensors)
