"""Hostile ``quantize`` runs (``trtvocab/quant/quantize.py``): ``--force`` replaces only a folder quantize
wrote (its marker), never a foreign ModelOpt checkpoint; a full disk keeps the old output; a bad ``--out``
or ``--batch-rows`` is refused before the work, naming the option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import model_config, write_hf_dir
from tests.hostile import H, V, assert_cli_error, cli, snapshot
from trtvocab.errors import ArtifactError


# ==== --force replaces only what quantize wrote ===============================================================
def _foreign_modelopt(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.31.0"}, "quantization": {"quant_algo": "FP8"}}))
    (folder / "config.json").write_text(json.dumps(model_config(V, H)))
    save_file({"lm_head.weight": torch.randn(V, H).to(torch.float8_e4m3fn)},
              str(folder / "model-00001-of-00001.safetensors"))
    return snapshot(folder)


@pytest.mark.model
def test_quantize_force_keeps_a_foreign_modelopt_checkpoint(tmp_path: Path) -> None:
    from trtvocab.quant.quantize import quantize_checkpoint

    source = write_hf_dir(tmp_path / "dense", {"lm_head.weight": torch.randn(V, H)}, model_config(V, H))
    foreign = tmp_path / "their-fp8"
    before = _foreign_modelopt(foreign)
    with pytest.raises(ArtifactError, match="not a folder this tool wrote") as info:
        quantize_checkpoint(source, foreign, algo="fp8", force=True)
    assert str(foreign) in str(info.value)
    assert snapshot(foreign) == before


@pytest.mark.model
def test_quantize_writes_a_marker_and_force_replaces_only_that(tmp_path: Path) -> None:
    pytest.importorskip("modelopt")
    from trtvocab.quant.quantize import MARKER, quantize_checkpoint

    source = write_hf_dir(tmp_path / "dense", {"lm_head.weight": torch.randn(V, H)}, model_config(V, H))
    out = tmp_path / "q"
    quantize_checkpoint(source, out, algo="fp8")
    marker = json.loads((out / MARKER).read_text())
    assert marker["format"] == "trtvocab-quantized-checkpoint" and marker["format_version"] == 1
    quantize_checkpoint(source, out, algo="fp8", force=True)  # ours: replaced
    (out / MARKER).write_text(json.dumps({"format": "someone-else"}))
    with pytest.raises(ArtifactError, match="not a folder this tool wrote"):
        quantize_checkpoint(source, out, algo="fp8", force=True)


# ==== --out and --batch-rows: refused before the work, a full disk keeps the old output =======================
def test_cli_quantize_batch_rows_zero(tmp_path: Path) -> None:
    assert_cli_error(*cli("quantize", str(tmp_path), "--algo", "fp8", "--out", str(tmp_path / "q"), "--batch-rows",
                          "0"), "ConfigError", "--batch-rows", "got 0")


def _dense_ckpt(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    save_file({"lm_head.weight": weight}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64, "hidden_size": 32}))
    return folder


def _quantize_cli(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    return cli("quantize", str(src), "--algo", "fp8", "--format", "compressed-tensors", "--out", str(out), *extra)


def test_q26_full_disk_during_quantize_is_one_error_line_and_keeps_the_old_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """q26: a full disk (EFBIG under RLIMIT_FSIZE) during ``quantize --force`` printed a SafetensorError
    traceback; now one WriteError line naming ``--out``, the old output byte for byte, no private folder."""
    import safetensors.torch

    src = _dense_ckpt(tmp_path / "dense")
    out = tmp_path / "q"
    code, output = _quantize_cli(src, out)
    assert code == 0, output
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def too_large(*args: Any, **kwargs: Any) -> None:
        raise safetensors.SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", too_large)
    code, output = _quantize_cli(src, out, "--force")
    assert_cli_error(code, output, "WriteError", f"quantize --out {out}", "EFBIG", "is as it was")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "q"]


@pytest.mark.parametrize("case", ["q07_out_in_proc", "q08_out_under_a_file", "q22_name_too_long"])
def test_q07_q08_q22_out_problems_are_refused_before_the_work_naming_out(tmp_path: Path, case: str) -> None:
    """q07 / q08 / q22 (Low): ``--out`` under /proc, under a file, or with a 300-character name failed after
    the quantization work with a raw OSError naming the private build folder; now an ArtifactError naming
    ``--out`` before any work."""
    src = _dense_ckpt(tmp_path / "dense")
    (tmp_path / "afile").write_text("x")
    out = {"q07_out_in_proc": Path("/proc/trtvocab_q37"), "q08_out_under_a_file": tmp_path / "afile" / "sub",
           "q22_name_too_long": tmp_path / ("n" * 300)}[case]
    code, output = _quantize_cli(src, out)
    assert_cli_error(code, output, "ArtifactError", "--out")
    assert ".building-" not in output
