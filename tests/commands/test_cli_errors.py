"""The command line's own handling of hostile input (``trtvocab/commands/cli.py``): options checked before
any work and named in the message (``--top-k``, ``--seq-lens``, ``--out``, ``--compiler``, generate's
sampling flags), user text printed as text (no markup, no emoji), a rank failure printed as the failing
rank's typed error, notices that say what was written. A lower layer's refusal seen through the CLI is
tested with that layer (``tests/<layer>/test_hostile_*.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from tests.hostile import H, assert_cli_error, build_art, cli, deadline, forbid_inference, write_hidden
from trtvocab.errors import ArtifactError, ConfigError, PeerRankError, RankFailures


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


@pytest.fixture
def no_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI runs inference: every refusal below must come before it."""
    forbid_inference(monkeypatch)


@pytest.fixture
def hidden_file(tmp_path: Path) -> Path:
    return write_hidden(tmp_path / "h.safetensors")


# ==== options: refused before any work, naming the flag =======================================================
@pytest.mark.parametrize("args, text", [
    (["--top-k", "0"], "--top-k: must be >= 1"),
    (["--top-k", "-1"], "--top-k: must be >= 1"),
    (["--seq-lens", "99999999999999999999999"], "--seq-lens: 99999999999999999999999 is out of range"),
    (["--seq-lens", "2,x"], "--seq-lens: expected comma-separated integers"),
])
def test_cli_infer_refuses_bad_options_before_inference(art: Path, hidden_file: Path, no_inference, args: list[str],
                                                        text: str) -> None:
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), *args), "InputError", text)


def test_cli_infer_refuses_bad_outputs_before_inference(art: Path, hidden_file: Path, tmp_path: Path,
                                                        no_inference) -> None:
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), "--out", str(tmp_path)),
                     "InputError", f"--out {tmp_path}: is a folder")
    missing = tmp_path / "no" / "such" / "logits.safetensors"
    assert_cli_error(*cli("infer", str(art), "--hidden", str(hidden_file), "--out", str(missing)),
                     "InputError", "does not exist")


@pytest.mark.parametrize(("args", "needles"), [
    (["--compiler", "bogus"], ["--compiler 'bogus'"]),  # f01
    (["--compiler", ""], ["--compiler ''"]),  # f02
    (["--compiler", "tensorrt", "--targets", "sm89"], ["TensorRT-RTX targets", "compiler 'tensorrt'"]),  # f08
])
def test_f01_f02_f08_engine_flags_name_the_flag_and_value(tmp_path: Path, args: list[str],
                                                          needles: list[str]) -> None:
    """f01 / f02 / f08 (Low): a bad ``--compiler`` names the flag and its value; ``--compiler tensorrt`` with
    TensorRT-RTX ``--targets`` is a contradiction refused before any work."""
    recipe = tmp_path / "r.toml"
    out = tmp_path / "a"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n')
    code, output = cli("build", str(recipe), *args)
    assert_cli_error(code, output, "ConfigError", *needles)
    assert not out.exists()


@pytest.mark.parametrize(("flags", "option"), [
    (["--logit-bias", "12=1e30", "--logit-bias", "7042=1e30"], "--logit-bias"),
    (["--logit-bias", "12=inf"], "--logit-bias"),
    (["--repetition-penalty", "1e-45"], "--repetition-penalty"),
    (["--repetition-penalty", "1e3"], "--repetition-penalty"),
    (["--lora", "a=x", "--lora", "b=y", "--lora-for", "0=a", "--lora-for", "0=b"], "--lora-for"),
])
def test_h3_cli_generate_refuses_before_the_model_loads(tmp_path: Path, flags: list[str], option: str) -> None:
    with deadline(30):  # no model at this path: the refusal comes first
        code, text = cli("generate", str(tmp_path / "no-model"), "--prompt", "x", *flags)
    assert_cli_error(code, text, option)


# ==== what the command line prints ============================================================================
@pytest.mark.ranks  # infer on the tp 2 artifact launches the ranks itself
def test_cli_infer_prints_tokens_as_text_not_markup(art: Path, tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(save({"hidden_states": torch.randn(5, H), "seq_lens": torch.tensor([2, 3], dtype=torch.int32)},
                          metadata={"last_tokens": json.dumps(["[lowercase]", "[/bold]"])}))
    code, out = cli("infer", str(art), "--hidden", str(path), "--backend", "torch")
    assert code == 0, out
    assert "[lowercase]" in out and "[/bold]" in out


def test_cli_messages_are_text_not_markup(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[checkpoint]\npath = "."\n[output]\ndirr = "x"\n')
    assert_cli_error(*cli("build", str(recipe)), "ConfigError", "[output] dirr: unknown key")
    weird = tmp_path / "we[/bold]ird[red].toml"
    assert_cli_error(*cli("build", str(weird)), "ConfigError", "we[/bold]ird[red].toml", "no such file")


def test_cli_prints_a_rank_failure_as_the_failing_ranks_typed_error(capsys) -> None:
    from trtvocab.commands.cli import _fail

    exc = RankFailures("2 of 2 ranks failed:\nrank 0: PeerRankError: ...\nrank 1: ArtifactError: ...\n"
                       "--- traceback of rank 1 ---\nTraceback (most recent call last): ...",
                       {0: PeerRankError("infer: rank(s) [1] of the group rejected their input"),
                        1: ArtifactError("/a/rank1/weights.safetensors: checksum mismatch [bold]")})
    assert _fail(exc).exit_code == 2
    err = capsys.readouterr().err
    assert_cli_error(2, err, "ArtifactError: /a/rank1/weights.safetensors: checksum mismatch [bold]", "(rank 1;")


def test_v05_v08_user_names_never_become_emoji(capsys: pytest.CaptureFixture[str]) -> None:
    """v05 / v08 (Low): rich turned ``:X:`` / ``:b:`` inside a user-supplied name into an emoji."""
    from trtvocab.commands.cli import _fail

    _fail(ConfigError("--variant 'a:b:c=ck/ct_fp8' and compressed-tensors:X: logits"))
    err = capsys.readouterr().err
    assert "'a:b:c=ck/ct_fp8'" in err and "compressed-tensors:X:" in err, err


def test_e27_notice_without_onnx_says_what_was_written(tmp_path: Path) -> None:
    """e27 (Low): with ``onnx = false`` the notice said "Wrote the ONNX graphs"; it names what was written."""
    out = tmp_path / "art"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n'
                      'onnx = false\n')
    code, output = cli("build", str(recipe))
    assert code == 0, output
    assert "Wrote the ONNX graphs" not in output and "PyTorch fallback weights only" in output
