"""The teacher-forced accuracy path on a real causal LM: SmolLM2-135M-Instruct (Q4_1 GGUF).

`trtvocab hidden` against transformers' own decoder states and the text's own token ids;
`trtvocab compare` against a float64 recomputation from ModelOpt's quantizers and the
independent statistics of tests/accuracy/llamacpp_reference.py; the NVFP4 MSE scale search against
plain NVFP4 block by block.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.accuracy.llamacpp_reference import per_row, summary
from tests.conftest import modelopt_qtensor
from trtvocab.accuracy.compare import compare
from trtvocab.checkpoints.hidden_file import load_hidden_file
from trtvocab.commands.cli import app
from trtvocab.quant import nvfp4

pytestmark = pytest.mark.model  # every test here (docs/testing.md)

TEXTS = ["The capital of France is Paris, and the capital of Japan is Tokyo.",
         "def add(a, b):\n    return a + b",
         "Water boils at 100 degrees Celsius at sea level."]
runner = CliRunner()


@pytest.fixture(scope="module")
def hidden_file(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smol") / "h.safetensors"
    args = ["hidden", str(smollm2), "--out", str(out)]
    for t in TEXTS:
        args += ["--text", t]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "next_token_ids" in result.output
    return out


@pytest.fixture(scope="module")
def reference(smollm2: Path):  # type: ignore[no-untyped-def]
    """transformers' own tokenizer and model, loaded independently of trtvocab (one load for the module)."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name).eval()
    return tok, model


@pytest.fixture(scope="module")
def head_weight(reference) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return reference[1].lm_head.weight.detach().float().clone()  # tied: the embedding, as transformers dequantizes it


def test_hidden_equals_transformers_and_next_ids(reference, hidden_file: Path) -> None:  # type: ignore[no-untyped-def]
    data = load_hidden_file(hidden_file)
    tok, model = reference
    ids = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    assert data.seq_lens.tolist() == [len(i) for i in ids]
    assert data.input_ids.tolist() == [x for seq in ids for x in seq]
    assert data.input_ids.dtype == torch.int64 and data.next_token_ids.dtype == torch.int64
    assert data.next_token_ids.tolist() == [x for seq in ids for x in [*seq[1:], -1]]
    with torch.no_grad():
        want = torch.cat([model.model(input_ids=torch.tensor([seq])).last_hidden_state[0] for seq in ids])
        # The states the head consumes: the model's own logits come from them.
        logits = model.lm_head(want[: len(ids[0])])
        full = model(input_ids=torch.tensor([ids[0]])).logits[0]
    torch.testing.assert_close(data.states, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def _fp8_dequant(w: torch.Tensor) -> torch.Tensor:
    q, scale = modelopt_qtensor().FP8QTensor.quantize(w)
    return q._quantized_data.float() * scale.float()


def _nvfp4_dequant(w: torch.Tensor) -> torch.Tensor:
    q, wsf, wsf2 = modelopt_qtensor().NVFP4QTensor.quantize(w, 16)
    return nvfp4.dequantize_nvfp4(q._quantized_data, wsf.view(torch.float8_e4m3fn), wsf2.float())


def test_compare_equals_float64_recomputation(smollm2: Path, hidden_file: Path, head_weight: torch.Tensor) -> None:
    data = load_hidden_file(hidden_file)
    report = compare(smollm2, [], data.states, data.seq_lens, simulate=["fp8-w8a16", "nvfp4"],
                     next_token_ids=data.next_token_ids, bootstrap=0)
    assert report.dtype == "fp32" and report.teacher_forced_rows == data.states.shape[0] - len(TEXTS)
    w = head_weight
    base = (data.states.double() @ w.double().T).numpy()
    for v, deq in zip(report.variants, (_fp8_dequant(w), _nvfp4_dequant(w)), strict=True):
        var = (data.states.double() @ deq.double().T).numpy()
        want = summary(per_row(base, var, data.next_token_ids.numpy()))
        got = v.llamacpp.as_dict()
        for key in ("ppl_q", "ppl_base", "ln_ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_max", "dp_rms",
                    "same_top", "ear", "kl_rev_mean", "js_mean"):
            assert got[key] == pytest.approx(want[key], rel=2e-3, abs=1e-6), (v.name, key)


def test_cli_json_gates_and_markdown(smollm2: Path, hidden_file: Path) -> None:
    args = ["compare", str(smollm2), "--hidden", str(hidden_file), "--simulate", "fp8-row", "--bootstrap", "100"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    v = json.loads(result.stdout)["variants"][0]
    for key in ("n", "ppl_q", "ppl_base", "ln_ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_p95", "kld_max",
                "dp_rms", "same_top", "ear", "ci95"):
        assert key in v["llamacpp"], key
    assert 0 <= v["llamacpp"]["same_top"] <= 1 and 0 <= v["llamacpp"]["ear"] <= 1
    kld = v["llamacpp"]["kld_mean"]
    ok = runner.invoke(app, [*args, "--max-kld-mean", str(kld * 1.5), "--min-same-top", "0.01"])
    assert ok.exit_code == 0 and "====== KL divergence statistics ======" in ok.stdout
    bad = runner.invoke(app, [*args, "--max-kld-mean", str(kld / 2)])
    assert bad.exit_code == 1
    lines = [line for line in bad.output.splitlines() if line.startswith("gate failed")]
    assert len(lines) == 1 and "sim:fp8-row" in lines[0] and "--max-kld-mean" in lines[0]
    md = runner.invoke(app, [*args, "--markdown"])
    assert md.exit_code == 0 and "| Mean KLD | " in md.stdout and "| Same top p | " in md.stdout


def test_nvfp4_mse_block_error_never_above_plain(head_weight: torch.Tensor) -> None:
    w = head_weight[:12288]  # a quarter of the head keeps the test short
    g = nvfp4.global_scale_from_amax(w.abs().amax())
    packed, bs, _ = nvfp4.quantize_nvfp4(w, g, scale_search="mse")
    mse = (w.double() - nvfp4.dequantize_nvfp4(packed, bs, g).double()).square().reshape(-1, 16).sum(-1)
    q, wsf, wsf2 = modelopt_qtensor().NVFP4QTensor.quantize(w, 16)
    assert torch.equal(wsf2.float(), g)  # the same global scale as ModelOpt
    plain = (w.double() - _nvfp4_dequant_with(q, wsf, wsf2).double()).square().reshape(-1, 16).sum(-1)
    assert bool((mse <= plain).all())
    assert float(mse.sum()) < 0.9 * float(plain.sum())
    assert np.count_nonzero((bs.view(torch.uint8) != wsf.view(torch.uint8)).numpy()) > 0


def _nvfp4_dequant_with(q, wsf, wsf2) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return nvfp4.dequantize_nvfp4(q._quantized_data, wsf.view(torch.float8_e4m3fn), wsf2.float())
