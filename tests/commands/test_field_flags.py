"""The library names its fields (`` `scale_search` ``, `` `variant_specs` ``); each command spells them as its
own flags, in error lines, gate lines and the report's notes (a tiny dense head or synthetic recipe, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import write_single
from trtvocab.checkpoints.hidden_file import save_hidden
from trtvocab.commands.cli import _flags, app, compare, generate, plan, quantize

V, H = 32, 32


def _cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    gen = torch.Generator().manual_seed(0)
    head = write_single(tmp_path / "head.safetensors", {"lm_head.weight": torch.randn(V, H, generator=gen)})
    hidden = tmp_path / "hidden.safetensors"
    # Two sequences whose last rows have no next token: the last-token rows get no teacher-forced statistics.
    save_hidden(hidden, torch.randn(4, H, generator=gen), torch.tensor([2, 2]),
                next_token_ids=torch.tensor([3, -1, 5, -1]))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('name = "tiny"\n[checkpoint.synthetic]\nvocab_size = 64\nhidden_size = 16\n'
                      '[mapping]\ntp_size = 2\n')
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("not ours")
    return {"head": head, "hidden": hidden, "out": tmp_path / "out", "recipe": recipe, "taken": taken}


def test_the_flag_map_reads_a_declared_name() -> None:
    """An option declared with its own name (``typer.Option("--variant")`` inside ``Annotated``) is that flag."""
    assert _flags(compare)["variant_specs"] == "--variant"
    assert _flags(compare)["as_json"] == "--json" and _flags(generate)["as_json"] == "--json"
    assert _flags(compare)["all_tokens"] == "--all-tokens"
    assert _flags(quantize)["checkpoint_format"] == "--format"
    assert _flags(compare)["variants"] == "VARIANTS"
    assert _flags(plan)["adp_rows"] == "--attention-dp-rows"  # make_plan's argument, plan's --attention-dp-rows


@pytest.mark.parametrize(("extra", "said"), [
    (["--algo", "int4"], "QuantizationError: --algo: unknown quant_algo 'int4'"),
    (["--algo", "w4a16"], "QuantizationError: --algo must be fp8 or nvfp4"),
    (["--algo", "nvfp4", "--format", "gguf"], "QuantizationError: --format must be one of modelopt, "
                                              "compressed-tensors"),
    (["--algo", "nvfp4", "--scale-search", "mse", "--format", "compressed-tensors"],
     "QuantizationError: --scale-search mse is for --format modelopt: with --format compressed-tensors the "
     "compressed-tensors library computes the block scales"),
    (["--algo", "fp8", "--scale-search", "mse"], "--scale-search mse is for --algo nvfp4"),
    (["--algo", "fp8", "--weight-only", "--calib", "{hidden}"],
     "--weight-only writes no activation scale: drop --calib (or --weight-only)"),
    (["--algo", "nvfp4", "--scale-search", "mse-act"], "give --calib (with --weight-only for W4A16)"),
])
def test_quantize_refusals_name_its_flags(files: dict[str, Path], extra: list[str], said: str) -> None:
    extra = [a.format(**files) for a in extra]
    code, text = _cli("quantize", files["head"], "--out", files["out"], *extra)
    assert code == 2 and said in text, text
    assert "`" not in text and not files["out"].exists()


@pytest.mark.parametrize(("extra", "said"), [
    (["--variant", "no equals sign"], "ConfigError: --variant 'no equals sign': expected [TOOLCHAIN:]NAME=DIR"),
    (["--variant", "awq:A={head}"], "unknown toolchain 'awq'"),
    (["--variant", "A={head}"], "stores its head dense"),
    (["--simulate", "fp9"], "ConfigError: --simulate: unknown variant 'fp9'"),
    (["--simulate", "fp8-mse"], "--simulate 'fp8-mse': -mse (block-scale search) is for NVFP4 only"),
    (["--lora", "nameless"], "ConfigError: --lora 'nameless': expected NAME=DIR"),
    (["--dtype", "fp7", "--simulate", "fp8"], "ConfigError: --dtype (or auto): must be one of"),
    ([], "nothing to compare: give VARIANTS checkpoints, --variant, --lora and/or --simulate specs"),
])
def test_compare_refusals_name_its_flags(files: dict[str, Path], extra: list[str], said: str) -> None:
    extra = [a.format(**files) for a in extra]
    code, text = _cli("compare", files["head"], "--hidden", files["hidden"], "--bootstrap", "0", *extra)
    assert code == 2 and said in text, text
    assert "`variant" not in text and "`simulate" not in text


def test_compare_notes_name_its_flags(files: dict[str, Path]) -> None:
    """A variant's note and the teacher-forced note, in the table's lines and in the JSON, as flags."""
    args = ["compare", files["head"], "--hidden", files["hidden"], "--bootstrap", "0", "--simulate",
            "nvfp4-mse-act", "--last-tokens"]
    code, text = _cli(*args)
    assert code == 0, text
    assert "(optimistic: give --calib)" in text
    assert "(each sequence's last token has none; compare with --all-tokens)" in text
    code, text = _cli(*args, "--json")
    assert code == 0 and "give --calib" in text and "compare with --all-tokens" in text and "`" not in text


def test_compare_gates_name_its_flags(files: dict[str, Path]) -> None:
    """A missed gate's line and a refused threshold or bootstrap option (``accuracy/gates.py`` and
    ``accuracy/stats.py`` name the fields), as compare's flags."""
    args = ["compare", files["head"], "--hidden", files["hidden"], "--bootstrap", "0", "--simulate", "nvfp4"]
    code, text = _cli(*args, "--max-kld-mean", "1e-12")
    assert code == 1 and "gate failed: sim:nvfp4: KLD mean" in text and "> --max-kld-mean 1e-12" in text, text
    assert "`max_kld_mean`" not in text
    code, text = _cli(*args, "--min-same-top", "98")
    assert code == 2 and "ConfigError: --min-same-top: must be a finite number in [0, 1], got 98.0 (a fraction, " \
                         "not percent)" in text, text
    code, text = _cli(*args, "--seed", "-1")
    assert code == 2 and "ConfigError: --seed: the bootstrap seed must be an int" in text and "`" not in text, text


@pytest.mark.parametrize(("args", "said"), [
    (["build", "{recipe}", "--ranks", "2", "--out", "{out}"], "ConfigError: --ranks [2] out of range for tp_size 2"),
    (["build", "{recipe}", "--out", "{taken}"], "already exists; pass --force to replace it (atomically)"),
    (["quantize", "{head}", "--algo", "fp8", "--out", "{out}", "--batch-rows", "0"],
     "ConfigError: --batch-rows (calibration rows per batch) must be an int in [1, "),
    (["quantize", "{head}", "--algo", "fp8", "--out", "{taken}"], "already exists; pass --force to replace it"),
    (["hidden", "{head}", "--out", "{out}.safetensors", "--max-tokens", "0"],
     "InputError: --max-tokens: must be a positive integer, got 0"),
    (["generate", "{head}", "--prompt", "x", "--backend", "bogus"], "ArtifactError: --backend must be one of"),
    (["plan", "--vocab", "100", "--hidden", "8", "--tp", "4", "--lm-head-tp", "3"],
     "ConfigError: --lm-head-tp (3) must divide --tp (4)"),
    (["plan", "--vocab", "100", "--hidden", "8", "--tp", "2", "--embedding-dtype", "int4"],
     "ConfigError: --embedding-dtype must be one of bf16, fp32, fp8, got 'int4'"),
    (["plan", "--vocab", "100", "--hidden", "8", "--tp", "2", "--overlap-chunks", "0"],
     "ConfigError: --overlap-chunks must be an integer in [1, inf), got 0"),
])
def test_other_refusals_name_each_commands_flags(files: dict[str, Path], args: list[str], said: str) -> None:
    """Refusals raised by ``pipeline/build.py``, ``base/publish.py``, ``quant/modelopt_export.py``,
    ``checkpoints/hidden_states.py``, ``backends/__init__.py`` and ``pipeline/plan.py``, before any work, in
    flags."""
    code, text = _cli(*[a.format(**files) for a in args])
    assert code == 2 and said in text and "`" not in text, text
    assert not files["out"].exists() and (files["taken"] / "notes.txt").is_file()
