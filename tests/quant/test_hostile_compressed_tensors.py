"""Hostile compressed-tensors checkpoints (``trtvocab/quant/compressed_tensors.py``): a deeply nested
``sparsity_config``; negative, zero or subnormal scales (refused by the dequantize path as by the quantized
one); an unrecognised ``quant_method``; a 1-D packed weight, a stray ModelOpt global scale, a zero point --
each a QuantizationError naming the real cause. ``build`` with ``mode = "none"`` refuses bad scales and
warns in one line.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.hostile import assert_cli_error, cli, deadline
from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.quant.config import resolve_lm_head_quant

pytest.importorskip("compressed_tensors")
from tests.quant import ct_writer as ctw

V, H = 64, 32


# ==== nesting in config.json ==================================================================================
@pytest.mark.parametrize("depth", [400, 900, 100_000])
def test_c36_deeply_nested_sparsity_config_is_refused_not_recursed(tmp_path: Path, depth: int) -> None:
    """c36 / c36b: ``sparsity_config`` lists nested 400 / 900 deep raised an untyped RecursionError."""
    path = ctw.head_checkpoint(tmp_path, "c36")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["sparsity_config"] = {"groups": "NESTED"}
    nested = "[" * depth + '{"targets": ["x"]}' + "]" * depth
    (path / "config.json").write_text(json.dumps(cfg).replace('"NESTED"', nested))
    with deadline(20), pytest.raises((QuantizationError, CheckpointError)) as err:  # json's own limit past ~1000
        resolve_lm_head_quant(path)
    assert "deep" in str(err.value) and "config.json" in str(err.value), str(err.value)


# ==== the dequantize path refuses the scales the quantized path refuses =======================================
def _set(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda t: {**t, name: make(t[name])}


def _neg_e4m3(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) | 0x80).view(torch.float8_e4m3fn)


def _one_sign_bit(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.uint8).clone()
    bits[3, 0] |= 0x80  # the sign of row 3's first block scale
    return bits.view(torch.float8_e4m3fn)


def _neg_row5(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[5] = -out[5]
    return out


SCALE_CASES = {  # probe id -> (preset, tensor, edit)
    "N02_all_block_scales_negative": ("NVFP4A16", "lm_head.weight_scale", _neg_e4m3),
    "N03_all_block_scales_zero": ("NVFP4A16", "lm_head.weight_scale", lambda t: torch.zeros_like(t)),
    "N07_fp8_row_scale_negative": ("FP8_W8A16_CHANNEL", "lm_head.weight_scale", _neg_row5),
    "N07b_fp8_row_scale_zero": ("FP8_W8A16_CHANNEL", "lm_head.weight_scale", lambda t: torch.zeros_like(t)),
    "N09_one_block_scale_sign_bit": ("NVFP4A16", "lm_head.weight_scale", _one_sign_bit),
}


@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_n02_n09_dequantize_path_refuses_what_the_quantized_path_refuses(tmp_path: Path, case: str) -> None:
    """N02 / N03 / N07 / N09: quant='none' loaded negative or zero scales (silently wrong logits) that
    quant='auto' refuses; both paths now give the same QuantizationError naming the tensor."""
    preset, name, edit = SCALE_CASES[case]
    path = ctw.head_checkpoint(tmp_path, case, preset)
    ctw.rewrite_tensors(path, _set(name, edit))
    for quant in ("auto", "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(QuantizationError) as err:
                LMHead.from_checkpoint(path, quant=quant)
        assert name in str(err.value) and "finite and > 0" in str(err.value), (quant, str(err.value))


def test_n02_nvfp4_embedding_refuses_negative_block_scales(tmp_path: Path) -> None:
    """N02 through the other user of the decompressed rows: an NVFP4 embedding (always dequantized)."""
    path = ctw.write_ct(tmp_path / "emb", V, H, head=None, embed="NVFP4A16", seed=2)
    ctw.rewrite_tensors(path, _set("model.embed_tokens.weight_scale", _neg_e4m3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(QuantizationError, match=r"model\.embed_tokens\.weight_scale: block scales"):
            VocabParallelEmbedding.from_checkpoint(path)


def test_t24_subnormal_global_scale_names_the_stored_tensor(tmp_path: Path) -> None:
    """t24 (Low): a subnormal ``weight_global_scale`` was reported as ``weight_scale_2``, a tensor the file
    does not have; both paths now name ``lm_head.weight_global_scale``."""
    path = ctw.head_checkpoint(tmp_path, "t24", "NVFP4A16")
    ctw.rewrite_tensors(path, _set("lm_head.weight_global_scale", lambda t: torch.full_like(t, 1e-45)))
    for quant in ("auto", "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(QuantizationError, match=r"lm_head\.weight_global_scale"):
                LMHead.from_checkpoint(path, quant=quant)


# ==== an unrecognised quant_method is named, not a symptom ====================================================
def _qm_null(cfg: dict) -> None:
    cfg["quantization_config"] = None


def _qm_missing(cfg: dict) -> None:
    del cfg["quantization_config"]["quant_method"]


def _qm_case(cfg: dict) -> None:
    cfg["quantization_config"]["quant_method"] = "Compressed-Tensors"


def _qm_list(cfg: dict) -> None:
    cfg["quantization_config"]["quant_method"] = ["compressed-tensors"]


QUANT_METHOD_CASES = {  # probe id -> (preset, edit of config.json, what the message quotes)
    "c03_qc_null": ("FP8", _qm_null, "quantization_config is None"),
    "c04_no_quant_method_fp8": ("FP8", _qm_missing, "has no quant_method"),
    "c05_quant_method_case_fp8": ("FP8", _qm_case, "quant_method is 'Compressed-Tensors'"),
    "c05b_quant_method_case_nvfp4": ("NVFP4", _qm_case, "quant_method is 'Compressed-Tensors'"),
    "c48_quant_method_list": ("FP8", _qm_list, "quant_method is ['compressed-tensors']"),
}


@pytest.mark.parametrize("case", sorted(QUANT_METHOD_CASES))
def test_c03_c48_unrecognised_quant_method_is_named(tmp_path: Path, case: str) -> None:
    """c03 / c04 / c05 / c05b / c48: the file fell to the ModelOpt rules and the error was a symptom
    ("expected a float32 scale", "weight_scale_2 is missing"); it now names config.json and quant_method."""
    preset, edit, quoted = QUANT_METHOD_CASES[case]
    path = ctw.head_checkpoint(tmp_path, case, preset)
    cfg = ctw.read_config(path)
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    for quant in ("auto", "none"):
        with pytest.raises(QuantizationError) as err:
            LMHead.from_checkpoint(path, quant=quant)
        for part in (str(path / "config.json"), quoted, "compressed-tensors tensors"):
            assert part in str(err.value), (part, str(err.value))


# ==== refusals that name the real cause =======================================================================
@pytest.mark.parametrize(("case", "edit", "needles"), [
    ("t40_nv_packed_1d", _set("lm_head.weight_packed", lambda t: t.reshape(-1)), ["must be 2-D", "[V, H/2]"]),
    ("t43_ct_plus_weight_scale_2", lambda t: {**t, "lm_head.weight_scale_2": torch.tensor(123.0)},
     ["lm_head.weight_scale_2 (ModelOpt's global scale)", "one module has one quantization format"]),
    ("t46_zero_point", lambda t: {**t, "lm_head.weight_zero_point": torch.zeros(V, 1, dtype=torch.int8)},
     ["lm_head.weight_zero_point is stored"]),
])
def test_t40_t43_t46_refusals_name_the_real_cause(tmp_path: Path, case: str, edit: Callable[[dict], dict],
                                                  needles: list[str]) -> None:
    """t40 / t43 / t46 (Low): a 1-D packed weight was reported as "block scales [1024, 0]", a stray ModelOpt
    ``weight_scale_2`` loaded without a word, a ``weight_zero_point`` was reported as "symmetric"."""
    path = ctw.head_checkpoint(tmp_path, case, "FP8_W8A16_CHANNEL" if case.startswith("t46") else "NVFP4A16")
    ctw.rewrite_tensors(path, edit)
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_t30_m01_m02_cli_dequantize_build_refuses_bad_scales_warns_in_one_line_and_writes_readable_files(
        tmp_path: Path) -> None:
    """t30_cli_build_mode_none (H2 through the CLI): ``[quantization] mode = "none"`` over negative block scales
    built and published; now one error line. m02 (Low): the dequantize warning printed in raw Python form
    (file, line number, source line); now one ``warning:`` line. m01 (Low): ``weights.safetensors`` was written
    0600 while the manifest was 0644; now every file of the artifact has the same mode."""
    good = ctw.head_checkpoint(tmp_path, "ok", "NVFP4A16")
    bad = ctw.head_checkpoint(tmp_path, "bad", "NVFP4A16")
    ctw.rewrite_tensors(bad, _set("lm_head.weight_scale", _neg_e4m3))

    def recipe(ckpt: Path, out: Path) -> Path:
        path = tmp_path / f"{out.name}.toml"
        path.write_text(f'[checkpoint]\npath = "{ckpt}"\n[quantization]\nmode = "none"\n'
                        f'[output]\ndir = "{out}"\nonnx = false\n')
        return path

    code, output = cli("build", str(recipe(good, tmp_path / "art")))  # first: a warning is shown once
    assert code == 0, output
    assert "UserWarning" not in output and ".py:" not in output, output
    assert sum("warning:" in line and "dequantizing" in line for line in output.splitlines()) == 1, output
    code, output = cli("build", str(recipe(bad, tmp_path / "art_bad")))
    assert_cli_error(code, output, "QuantizationError", "lm_head.weight_scale: block scales must be finite and > 0")
    assert not (tmp_path / "art_bad").exists()
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "art").rglob("*")
             if p.is_file()}
    assert len(set(modes.values())) == 1, modes
