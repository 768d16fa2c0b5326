"""``trtvocab generate``'s printing, on a stand-in run (no model): a compiled step's compile on its own line,
out of the rates; the library's field names spelled as the command's flags in an error line."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trtvocab.commands.cli import app
from trtvocab.pipeline import generate as G
from trtvocab.sampling import SamplingParams


def _report(compile_s: float) -> G.GenerateReport:
    results = [G.GenerateResult("a", [1] * 32, "x"), G.GenerateResult("b", [2] * 32, "y")]
    return G.GenerateReport(results, 1, "torch", 64, prefill_s=0.5, decode_s=1.5, deterministic=False,
                            compile_s=compile_s)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    """``prepare`` and ``generate`` replaced: the options the command built are kept, the report is given."""
    seen: dict[str, object] = {}

    def prepare(model: Path, options: G.GenerateOptions):
        seen["options"] = options
        spec = types.SimpleNamespace(params=(SamplingParams(),) * 2, artifact=None)
        return spec, types.SimpleNamespace(tokenizer=None)

    monkeypatch.setattr(G, "prepare", prepare)
    monkeypatch.setattr(G, "generate", lambda spec, loaded: seen["report"])
    return seen


def test_a_compiled_step_reports_its_compile_on_its_own_line(stand_in: dict, tmp_path: Path) -> None:
    stand_in["report"] = _report(compile_s=61.25)
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "a", "--prompt", "b", "--kv-cache",
                                      "static", "--compile-step"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    # 62 tokens after the prefill in 1.5 s; the 61 s compile is in neither rate.
    assert "64 new tokens in 2.00 s (prefill 0.50 s, then 41.3 tokens/s): 32.0 tokens/s" in lines
    assert [line for line in lines if line.startswith("compile: ")] == [
        "compile: 61.25 s (torch.compile of the body's one-token step, in this run; not in the times above)"]
    assert "compile 61.2 s" in result.stderr
    options = stand_in["options"]
    assert (options.prompts, options.kv_cache, options.compile_step) == (("a", "b"), "static", True)


def test_no_compile_line_without_a_compile(stand_in: dict, tmp_path: Path) -> None:
    stand_in["report"] = _report(compile_s=0.0)
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "a", "--prompt", "b"])
    assert result.exit_code == 0, result.output
    assert not [line for line in result.output.splitlines() if line.startswith("compile")]
    assert "compile" not in result.stderr


@pytest.mark.parametrize(("args", "line"), [
    (["--kv-cache", "paged"], "error: InputError: --kv-cache: expected one of static, dynamic, got 'paged'"),
    (["--compile-step"], "error: InputError: --compile-step: needs --kv-cache static"),
    (["--body-ranks", "2"], "error: ConfigError: --body-ranks: only with --attention-dp"),
    (["--lora-for", "0"], "error: ConfigError: --lora-for: names a prompt's adapter; give the adapters with --lora "
                          "NAME=DIR"),
    (["--lora", "a=x", "--lora-for", "1=a", "--lora-for", "+1=a"],
     "error: ConfigError: --lora-for: prompt index 1 is given twice ('1=a' and '+1=a'); one adapter per prompt"),
    (["--max-new-tokens", "0"], "error: InputError: --max-new-tokens: must be an int >= 1, got 0"),
    (["--top-p", "0"], "error: InputError: --top-p:"),
])
def test_errors_name_the_flags(stand_in: dict, tmp_path: Path, args: list[str], line: str) -> None:
    """The library names fields (`kv_cache`); the command line spells each as its flag, in one error line."""
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "a", "--prompt", "b", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(line), result.stderr
    assert "`" not in result.stderr and "Traceback" not in result.output
