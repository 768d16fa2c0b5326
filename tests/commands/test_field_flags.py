"""The library names its fields (`` `scale_search` ``, `` `variant_specs` ``); ``compare`` and ``quantize``
spell each as the command's own flag, in error lines and in the report's notes (a tiny dense head, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import write_single
from trtvocab.checkpoints.hidden_file import save_hidden
from trtvocab.commands.cli import _flags, app, compare, generate, quantize

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
    return {"head": head, "hidden": hidden, "out": tmp_path / "out"}


def test_the_flag_map_reads_a_declared_name() -> None:
    """An option declared with its own name (``typer.Option("--variant")`` inside ``Annotated``) is that flag."""
    assert _flags(compare)["variant_specs"] == "--variant"
    assert _flags(compare)["as_json"] == "--json" and _flags(generate)["as_json"] == "--json"
    assert _flags(compare)["all_tokens"] == "--all-tokens"
    assert _flags(quantize)["checkpoint_format"] == "--format"
    assert _flags(compare)["variants"] == "VARIANTS"


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
