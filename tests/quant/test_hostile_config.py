"""Hostile ModelOpt quantization configs (``trtvocab/quant/config.py``): ``hf_quant_config.json`` values of the
wrong type (``exclude_modules``, ``ignore``, ``group_size``, ``quant_algo``, ``quantized_layers``) are a
QuantizationError naming the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import model_config
from tests.hostile import H, V
from trtvocab.errors import QuantizationError


def _fp8_checkpoint(folder: Path, quantization: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    save_file({"lm_head.weight": (torch.randn(V, H) * 0.1).to(torch.float8_e4m3fn),
               "lm_head.weight_scale": torch.tensor(0.01)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model_config(V, H)))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                             "quantization": quantization}))
    return folder


@pytest.mark.parametrize("quantization, text", [
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, "exclude_modules must be a list of module-name patterns"),
    ({"quant_algo": "FP8", "exclude_modules": 5}, "exclude_modules must be a list"),
    ({"quant_algo": "FP8", "ignore": [1, 2]}, "ignore must be a list of module-name patterns (strings)"),
    ({"quant_algo": "FP8", "group_size": "abc"}, "group_size must be an int in [1, 65536], got 'abc'"),
    ({"quant_algo": "FP8", "group_size": True}, "group_size must be an int"),
    ({"quant_algo": 8}, "unknown quant_algo 8"),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": ["lm_head"]}, "quantized_layers must be an object"),
])
def test_hf_quant_config_values_are_typed(tmp_path: Path, quantization: dict[str, Any], text: str) -> None:
    from trtvocab.quant.config import resolve_lm_head_quant

    folder = _fp8_checkpoint(tmp_path / "fp8", quantization)
    with pytest.raises(QuantizationError) as info:
        resolve_lm_head_quant(folder)
    assert text in str(info.value) and str(folder) in str(info.value), str(info.value)
