"""``trtvocab --help`` as a new user reads it: plain text at 80 columns, nothing eaten or cut, and fast.

Help is rendered as plain text (no rich markup: ``[output]`` and ``E[h^2]`` are words), wrapped at
spaces only (a flag such as ``--json-schema`` never breaks at its hyphen), and every command that
accepts a llama.cpp GGUF says so. ``--help`` and argument errors import no torch.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from trtvocab.commands.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
GGUF_COMMANDS = {"plan", "hidden", "quantize", "compare", "generate"}


def _help(*args: str) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0, res.output
    return res.output


def _help_texts(name: str) -> list[str]:
    command: Any = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return [p.help for p in command.params if getattr(p, "help", None)] + [command.help or ""]


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_help_fits_80_columns_and_keeps_every_word(name: str) -> None:
    text = _help(*([name] if name else []))
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text
    if not name:
        assert all(c in text for c in COMMANDS)
        return
    words = set(text.split())
    for help_text in _help_texts(name):
        missing = [w for w in help_text.split() if w not in words]
        assert not missing, f"{name} --help lost or cut {missing}:\n{text}"


def test_bracketed_words_survive() -> None:
    assert "[output]" in _help("build") and "[engine]" in _help("build")
    assert "E[h^2]" in _help("quantize")
    compare = _help("compare")
    assert "fp8[-row][-dyn|-w8a8|-w8a16]," in compare and "nvfp4[-mse|-mse-act][-w4a16|-w4a4]" in compare


@pytest.mark.parametrize("name", sorted(GGUF_COMMANDS))
def test_gguf_named_wherever_accepted(name: str) -> None:
    assert ".gguf" in _help(name)


START_SCRIPT = """
import json, sys
sys.argv = ["trtvocab", *json.loads(sys.argv[1])]
from trtvocab.commands.cli import app
try:
    app()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("args", [["--help"], ["build", "--help"], ["generate", "--help"], ["biuld"],
                                  ["build", "--froce", "x.toml"], ["infer", "art"]])
def test_help_and_argument_errors_import_no_torch(fresh_python: Any, args: list[str]) -> None:
    """A fresh interpreter: ``--help`` and a mistyped command or option answer without importing torch."""
    out = fresh_python(START_SCRIPT, json.dumps(args))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, 2), out.stdout
    assert result["torch"] is False, f"trtvocab {' '.join(args)} imported torch"
