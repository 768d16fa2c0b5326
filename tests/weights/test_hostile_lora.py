"""Hostile LoRA adapters (``trtvocab/weights/lora.py``): a scaling (``lora_alpha``, ``alpha_pattern``, rsLoRA)
outside [-2^24, 2^24], finite factors whose product overflows float32, float8 / integer / bool factors, a
FIFO as the weights file -- an AdapterError naming the file and the field, through the API and
``compare --lora``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.hostile import assert_cli_error, cli, deadline
from tests.weights.hostile_files import V, dense_checkpoint
from trtvocab import LMHead
from trtvocab.errors import AdapterError


def _adapter(root: Path, *, a: torch.Tensor | None = None, b: torch.Tensor | None = None, **config: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["lm_head"], **config}
    (root / "adapter_config.json").write_text(json.dumps(cfg))
    g, r = torch.Generator().manual_seed(1), cfg["r"]
    save_file({"base_model.model.lm_head.lora_A.weight": torch.randn(r, 32, generator=g) * 0.01 if a is None else a,
               "base_model.model.lm_head.lora_B.weight": torch.randn(V, r, generator=g) * 0.01 if b is None else b},
              str(root / "adapter_model.safetensors"))
    return root


# ==== scaling and factors: +inf made where the data enters ====================================================
@pytest.mark.parametrize(("config", "field"), [
    ({"lora_alpha": 1e308}, "lora_alpha"), ({"lora_alpha": -1e300}, "lora_alpha"),
    ({"alpha_pattern": {"lm_head": 1e300}}, "alpha_pattern"), ({"lora_alpha": 2.0**26, "r": 2}, "lora_alpha"),
    ({"lora_alpha": 2.0**25, "use_rslora": True, "r": 1}, "lora_alpha"),
])
def test_h2_lora_scaling_is_bounded_like_the_family_factors(tmp_path: Path, config: dict, field: str) -> None:
    head = LMHead.from_checkpoint(dense_checkpoint(tmp_path / "ck"), dtype=torch.float32)
    with pytest.raises(AdapterError, match=rf"adapter_config.json: {field} for lm_head .*outside \[-2\^24, 2\^24\]"):
        head.load_adapter(_adapter(tmp_path / "a", **config))
    head.load_adapter(_adapter(tmp_path / "ok", lora_alpha=2.0**24, r=1))  # the bound itself loads


def test_h2_a_finite_factor_whose_product_overflows_is_refused(tmp_path: Path) -> None:
    head = LMHead.from_checkpoint(dense_checkpoint(tmp_path / "ck"), dtype=torch.float32)
    b = torch.randn(V, 2) * 0.01
    b[9] = 3e38  # finite in float32, but s * (x @ A.T) @ B.T is inf
    with pytest.raises(AdapterError, match=r"lora_A.weight and .*lora_B.weight .*past float32's range"):
        head.load_adapter(_adapter(tmp_path / "a", b=b))
    with pytest.raises(AdapterError, match=r"lora_B.weight holds NaN or inf \(in float32\)"):
        head.load_adapter(_adapter(tmp_path / "f64", b=torch.full((V, 2), 1e300, dtype=torch.float64)))


def test_h2_cli_compare_lora_refuses_a_huge_alpha(tmp_path: Path) -> None:
    ck = dense_checkpoint(tmp_path / "ck")
    save_file({"hidden_states": torch.randn(6, 32)}, str(tmp_path / "h.safetensors"))
    code, text = cli("compare", str(ck), "--hidden", str(tmp_path / "h.safetensors"), "--bootstrap", "0",
                     "--lora", f"a={_adapter(tmp_path / 'huge', lora_alpha=1e308)}")
    assert_cli_error(code, text, "AdapterError", "lora_alpha", "2^24")
    assert "nan" not in text.lower().replace("nan or inf", "")


# ==== factor dtypes, and the file itself ======================================================================
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.bool])
def test_m2_float8_int_and_bool_factors_are_typed_errors(tmp_path: Path, dtype: torch.dtype) -> None:
    head = LMHead.from_checkpoint(dense_checkpoint(tmp_path / "ck"), dtype=torch.float32)
    a = torch.ones(2, 32).to(dtype)
    with pytest.raises(AdapterError, match=rf"lora_A.weight is stored as {dtype}"):
        head.load_adapter(_adapter(tmp_path / "a", a=a))


def test_m2_cli_compare_float8_adapter_is_one_error_line(tmp_path: Path) -> None:
    ck = dense_checkpoint(tmp_path / "ck")
    save_file({"hidden_states": torch.randn(6, 32)}, str(tmp_path / "h.safetensors"))
    bad = _adapter(tmp_path / "f8", a=torch.ones(2, 32).to(torch.float8_e4m3fn))
    code, text = cli("compare", str(ck), "--hidden", str(tmp_path / "h.safetensors"), "--bootstrap", "0",
                     "--lora", f"a={bad}")
    assert_cli_error(code, text, "AdapterError", "float8_e4m3fn")


def test_low_a_fifo_adapter_weights_file_is_named_as_a_fifo(tmp_path: Path) -> None:
    from trtvocab.weights.lora import open_adapter

    folder = tmp_path / "fifo"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8}))
    os.mkfifo(folder / "adapter_model.safetensors")
    with deadline(10), pytest.raises(AdapterError, match=r"adapter_model.safetensors: is a FIFO.*regular file"):
        open_adapter(folder)
