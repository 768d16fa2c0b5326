"""`trtvocab quantize --format compressed-tensors` and `trtvocab compare --variant TOOLCHAIN:NAME=DIR`.

The written checkpoints are read back by the compressed-tensors library's own ``decompress``
(tests/quant/ct_writer.py: the reference) and by trtvocab; their weight tensors are checked against the
library-driven writer of tests/quant/ct_writer.py on the same weights, and their activation scales
against the calibration rows' amax computed here.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tests.quant import ct_writer as ctw
from trtvocab import LMHead
from trtvocab.accuracy.compare import checkpoint_toolchain, compare, parse_variant
from trtvocab.base.formats import WeightFormat
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.checkpoints.hidden_file import save_hidden
from trtvocab.commands.cli import app
from trtvocab.errors import ConfigError, QuantizationError
from trtvocab.quant.compressed_tensors import DecompressedRows
from trtvocab.quant.config import resolve_lm_head_quant
from trtvocab.quant.quantize import is_quantized_output, quantize_checkpoint

V, H = 263, 64  # prime vocab
runner = CliRunner()
HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
# (algo, calibrated, weight_only) -> (label trtvocab runs, the library preset the tensors match)
CASES = {
    ("fp8", True, False): ("FP8 W8A8", "FP8"),
    ("fp8", False, False): ("FP8 W8A8-dyn", "FP8_TENSOR_DYNAMIC"),
    ("fp8", False, True): ("FP8 W8A16", "FP8_W8A16_TENSOR"),
    ("nvfp4", True, False): ("NVFP4 W4A4", "NVFP4"),
    ("nvfp4", False, True): ("NVFP4 W4A16", "NVFP4A16"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.05
    w[7, 3] = 0.9
    return w.bfloat16()


def _write_dense(path: Path, weight: torch.Tensor, *, tied: bool) -> Path:
    path.mkdir(parents=True)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    save_file({name: weight.contiguous()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": H,
                                                  "tie_word_embeddings": tied}))
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ctq")
    weight = _weight()
    g = torch.Generator().manual_seed(1)
    calib = torch.randn(40, H, generator=g) * 2.0
    states = torch.randn(24, H, generator=g) * 2.0
    lens = torch.tensor([10, 8, 6], dtype=torch.int32)
    next_ids = torch.randint(0, V, (24,), generator=g)
    next_ids[torch.cumsum(lens.long(), 0) - 1] = -1
    save_hidden(root / "calib.safetensors", calib, None)
    save_hidden(root / "hidden.safetensors", states, lens, next_token_ids=next_ids)
    return {"root": root, "weight": weight, "calib": calib, "tied": _write_dense(root / "tied", weight, tied=True),
            "untied": _write_dense(root / "untied", weight, tied=False)}


@pytest.fixture(scope="module")
def written(data) -> dict[tuple[str, bool, bool], Path]:
    """Every case of CASES quantized from the tied source with --format compressed-tensors."""
    out = {}
    for (algo, calibrated, weight_only) in CASES:
        path = data["root"] / f"ct-{algo}-{calibrated}-{weight_only}"
        quantize_checkpoint(data["tied"], path, algo=algo, calib=data["calib"] if calibrated else None,
                            weight_only=weight_only, checkpoint_format="compressed-tensors", batch_rows=16)
        out[(algo, calibrated, weight_only)] = path
    return out


def _cli(*args: object) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


# ---- quantize --format compressed-tensors ------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-cal{int(c[1])}-wo{int(c[2])}")
def test_library_decompress_equals_trtvocab_rows(written, case) -> None:
    path = written[case]
    ref = ctw.library_decompress(path, "lm_head", ("Linear",))
    ckpt = open_checkpoint(path)
    decision = resolve_lm_head_quant(ckpt)
    assert decision.stored in (WeightFormat.FP8, WeightFormat.NVFP4)
    assert same_bits(DecompressedRows(ckpt, "lm_head", decision.stored, H)[:], ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stored as ... but the head runs dense (quant='none')"
        dense = LMHead.from_checkpoint(path, quant="none", dtype=torch.bfloat16)
    assert same_bits(dense.weight, ref)


@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-cal{int(c[1])}-wo{int(c[2])}")
def test_trtvocab_reads_it_quantized(written, case) -> None:
    label, _ = CASES[case]
    path = written[case]
    decision = resolve_lm_head_quant(path)
    assert decision.checkpoint_format == "compressed-tensors" and decision.config is not None
    assert decision.config.label == label and not decision.dequantize and decision.notice is None
    assert decision.tensor_name == ("lm_head.weight_packed" if case[0] == "nvfp4" else "lm_head.weight")
    head = LMHead.from_checkpoint(path)
    assert head.label == label
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(head(x.to(head.dtype))).all()


@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-cal{int(c[1])}-wo{int(c[2])}")
def test_tensors_and_config_are_the_librarys(data, written, case) -> None:
    """The weight tensors equal those of tests/quant/ct_writer.py (the library's helpers, on the same weight); the
    activation scale is the calibration rows' amax in the model dtype; config.json is vLLM's shape of it."""
    algo, calibrated, _ = case
    _, preset = CASES[case]
    path = written[case]
    got = load_file(str(path / "model.safetensors"))
    ref_dir = ctw.write_ct(data["root"] / f"ref-{preset}", V, H, head=preset, head_weight=data["weight"])
    ref = ctw.module_tensors(ref_dir, "lm_head")
    weight_keys = {"fp8": ("weight", "weight_scale"),
                   "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale")}[algo]
    for key in weight_keys:
        assert same_bits(got[f"lm_head.{key}"], ref[key]), key
    amax = data["calib"].to(torch.bfloat16).abs().amax()
    inputs = {k for k in got if k.startswith("lm_head.input")}
    if not calibrated:
        assert inputs == set()
    elif algo == "fp8":
        assert inputs == {"lm_head.input_scale"}
        scale = got["lm_head.input_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == (1,)
        assert same_bits(scale, (amax / torch.tensor(448.0, dtype=torch.bfloat16)).reshape(1))
    else:
        assert inputs == {"lm_head.input_global_scale"}
        # The library computes the global scale in the dtype of the observed range (bf16 here: a coarse
        # scale, about 2688 / amax to bf16 precision); the amax is that of every calibration row.
        from compressed_tensors.quantization.utils import generate_gparam

        lo = data["calib"].to(torch.bfloat16).amin().reshape(1)
        hi = data["calib"].to(torch.bfloat16).amax().reshape(1)
        assert same_bits(got["lm_head.input_global_scale"], generate_gparam(lo, hi))
        assert got["lm_head.input_global_scale"].dtype == torch.float32
        assert abs(float(got["lm_head.input_global_scale"]) * float(amax) / 2688.0 - 1) < 2 ** -7
    assert not any(k.startswith("model.") for k in got)  # only the head is written
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False  # the tied head is written untied, as llm-compressor does
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == [] and list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["lm_head"]  # an exact name: what vLLM's head matching reaches
    fmt = {"fp8": "float-quantized" if inputs or not case[2] else "naive-quantized",
           "nvfp4": "nvfp4-pack-quantized"}[algo]
    assert group["format"] == qc["format"] == fmt
    assert not (path / "hf_quant_config.json").exists()
    assert (path / "tokenizer_config.json").exists() and is_quantized_output(path)
    marker = json.loads((path / "trtvocab_quantize.json").read_text())
    assert marker["checkpoint_format"] == "compressed-tensors"


def test_cli_quantize_compressed_tensors_and_force(data) -> None:
    out = data["root"] / "cli-ct"
    args = ["quantize", data["untied"], "--algo", "nvfp4", "--out", out, "--format", "compressed-tensors",
            "--calib", data["root"] / "calib.safetensors"]
    text = _cli(*args)
    assert "NVFP4 W4A4, compressed-tensors" in text and "lm_head.weight_packed" in text
    assert "input_global_scale" in text
    _cli(*args, "--force")  # replaces its own output
    assert resolve_lm_head_quant(out).config.label == "NVFP4 W4A4"


def test_gate_sees_the_written_head(data, tmp_path: Path) -> None:
    """--gate judges the in-memory head as the written checkpoint runs it: a gate it misses writes nothing."""
    out = tmp_path / "gated"
    result = runner.invoke(app, [str(a) for a in ["quantize", data["untied"], "--algo", "nvfp4", "--out", out,
                                                   "--format", "compressed-tensors", "--weight-only",
                                                   "--gate", data["root"] / "hidden.safetensors",
                                                   "--max-kld-mean", "1e-12"]])
    assert result.exit_code == 1, result.output
    assert not out.exists()
    _cli("quantize", data["untied"], "--algo", "nvfp4", "--out", out, "--format", "compressed-tensors",
         "--weight-only", "--gate", data["root"] / "hidden.safetensors", "--max-kld-mean", "100")
    assert out.is_dir()


# ---- errors ---------------------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("fmt", ["gguf", "", "modelopt,compressed-tensors", "compressed_tensors"])
def test_bad_format_is_refused(data, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "never"
    result = runner.invoke(app, ["quantize", str(data["untied"]), "--algo", "fp8", "--out", str(out),
                                 "--format", fmt])
    assert result.exit_code == 2
    assert "--format must be one of modelopt, compressed-tensors" in result.output
    assert not out.exists()
    with pytest.raises(QuantizationError, match="`checkpoint_format` must be one of"):
        quantize_checkpoint(data["untied"], out, algo="fp8", checkpoint_format=fmt)


@pytest.mark.model
def test_scale_search_is_modelopt_only(data, tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="`scale_search` mse is for `checkpoint_format` modelopt"):
        quantize_checkpoint(data["untied"], tmp_path / "x", algo="nvfp4", scale_search="mse",
                            checkpoint_format="compressed-tensors")
    assert not (tmp_path / "x").exists()


# ---- compare: both toolchains side by side --------------------------------------------------------------
@pytest.mark.skipif(not HAS_MODELOPT, reason="the ModelOpt variant needs nvidia-modelopt")
@pytest.mark.parametrize("algo", ["nvfp4", "fp8"])
def test_compare_both_toolchains(data, tmp_path: Path, algo: str) -> None:
    name = algo.upper()
    dirs = {}
    for tool in ("modelopt", "compressed-tensors"):
        dirs[tool] = tmp_path / tool
        _cli("quantize", data["untied"], "--algo", algo, "--out", dirs[tool], "--format", tool,
             "--calib", data["root"] / "calib.safetensors")
    specs = [f"modelopt:{name}={dirs['modelopt']}", f"compressed-tensors:{name}={dirs['compressed-tensors']}"]
    hidden = data["root"] / "hidden.safetensors"
    text = _cli("compare", data["untied"], "--hidden", hidden, "--variant", specs[0], "--variant", specs[1],
                "--bootstrap", "0")
    raw = json.loads(_cli("compare", data["untied"], "--hidden", hidden, "--variant", specs[0], "--variant",
                          specs[1], "--bootstrap", "0", "--json"))
    label = {"nvfp4": "NVFP4 W4A4", "fp8": "FP8 W8A8"}[algo]
    variants = {v["name"]: v for v in raw["variants"]}
    assert list(variants) == [f"modelopt:{name}", f"compressed-tensors:{name}"]
    from trtvocab.base.units import human_bytes

    for tool in ("modelopt", "compressed-tensors"):
        v = variants[f"{tool}:{name}"]
        assert v["toolchain"] == tool and v["label"] == label and v["path"] == str(dirs[tool])
        assert v["llamacpp"] is not None and v["llamacpp"]["n"] == raw["teacher_forced_rows"] > 0
        per_row = H // 2 + H // 16 if algo == "nvfp4" else H  # codes + block scales per vocab row
        assert v["head_bytes_per_rank"] >= V * per_row
        header = f"###### {label} ({tool}:{name}, {human_bytes(v['head_bytes_per_rank'], digits=2)}) vs "
        assert header in text, text
    md = _cli("compare", data["untied"], "--hidden", hidden, "--variant", specs[0], "--variant", specs[1],
              "--bootstrap", "0", "--markdown")
    assert f"{label} (compressed-tensors:{name}, " in md and f"{label} (modelopt:{name}, " in md


@pytest.mark.model
def test_variant_specs_are_checked(data, written, tmp_path: Path) -> None:
    ct_dir = written[("nvfp4", False, True)]
    assert checkpoint_toolchain(ct_dir) == "compressed-tensors" and checkpoint_toolchain(data["untied"]) == "dense"
    src = parse_variant(f"NVFP4A16={ct_dir}")
    assert (src.name, src.path, src.toolchain) == ("NVFP4A16", str(ct_dir), "compressed-tensors")
    with pytest.raises(ConfigError, match="is a compressed-tensors checkpoint, not modelopt"):
        parse_variant(f"modelopt:NVFP4={ct_dir}")
    with pytest.raises(ConfigError, match="unknown toolchain 'awq'"):
        parse_variant(f"awq:NVFP4={ct_dir}")
    with pytest.raises(ConfigError, match="stores its head dense"):
        parse_variant(f"compressed-tensors:BF16={data['untied']}")
    for bad in (str(ct_dir), f"=:{ct_dir}", "compressed-tensors:NVFP4="):
        with pytest.raises(ConfigError, match=r"expected \[TOOLCHAIN:\]NAME=DIR"):
            parse_variant(bad)
    states = torch.randn(4, H)
    with pytest.raises(ConfigError, match="given twice"):
        compare(data["untied"], [], states, None, variant_specs=[f"a={ct_dir}", f"a={ct_dir}"])
    result = runner.invoke(app, ["compare", str(data["untied"]), "--hidden", str(data["root"] / "hidden.safetensors"),
                                 "--variant", f"modelopt:NVFP4={ct_dir}"])
    assert result.exit_code == 2 and "not modelopt" in result.output


@pytest.mark.model
def test_positional_variants_get_their_toolchain(data, written) -> None:
    ct_dir = written[("fp8", True, False)]
    report = compare(data["untied"], [ct_dir], torch.randn(6, H), None, simulate=["fp8"], bootstrap=0)
    assert [v.toolchain for v in report.variants] == ["compressed-tensors", "trtvocab (simulated)"]
