"""The README's command blocks run as written, top to bottom, from a fresh clone.

Every ```bash block is read the way a shell would (continuation lines joined, comments dropped,
``VAR="$(trtvocab models NAME)"`` assignments and ``"$VAR"`` expanded; ``[...]`` marks an optional part).
Each ``trtvocab`` line must parse with the real CLI (command, options, values), every flag of an optional
part must exist, and every file or folder a line reads must be in the repository or written by a line
before it (``--out``, ``--plot``, ``make demo``'s artifact). ``make`` targets and example scripts must exist.
``trtvocab models`` and ``plan`` lines run for real here; every line that takes seconds runs for real in a
scratch copy of the clone (``tools/readme_run.py --quick``), and ``make readme`` runs every line.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from trtvocab.checkpoints.real_models import MODELS, find
from trtvocab.commands.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
IGNORED = {"artifacts", "out", "build", "dist", ".venv"}  # .gitignore's folders: absent from a fresh clone
OUTPUT_OPTIONS = {"out", "plot"}  # the options whose path a command writes
RUN_NOW = {"models", "plan"}  # the commands cheap enough to run for real here (a header read at most)
MODELS_CALL = re.compile(r"\$\(trtvocab models (\w+)\)")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def command_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


@functools.cache
def _runner() -> Any:  # tools/readme_run.py: the script `make readme` runs, and the one optional-part parser
    spec = importlib.util.spec_from_file_location("readme_run", ROOT / "tools" / "readme_run.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def split_optional(line: str) -> tuple[list[str], list[list[list[str]]]]:
    """``line``'s tokens without its ``[...]`` parts, and those parts (each a list of its ``|`` alternatives,
    as tokens): ``tools/readme_run.py``'s parser, tokenized as a shell would."""
    required, parts = _runner().split_optional(line)
    return shlex.split(required, comments=True), [[shlex.split(alt) for alt in part] for part in parts]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", MAKEFILE.read_text(), flags=re.MULTILINE))


def _make_outputs(target: str) -> set[str]:
    """What ``make TARGET`` leaves for later README lines: the demo's artifact (``OUT``)."""
    if target != "demo":
        return set()
    out = re.search(r"^OUT\s*\?=\s*(\S+)", MAKEFILE.read_text(), flags=re.MULTILINE)
    assert out, "Makefile: no OUT ?= (the demo's artifact folder)"
    return {out.group(1)}


@dataclass
class Session:
    """One shell in the repository root: its variables and the paths the lines so far have written."""

    variables: dict[str, str] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def expand(self, line: str) -> str:
        line = MODELS_CALL.sub(lambda m: str(_model_path(m.group(1))), line)
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.variables.get(m.group(1), m.group(0)), line)

    def readable(self, path: str) -> bool:
        """In the repository (not in a folder git ignores: a clone has none), or written by a line before."""
        p = Path(path)
        if p.is_absolute():
            return p.exists()
        if (ROOT / p).exists() and p.parts[0] not in IGNORED:
            return True
        return any(p == w or w in p.parents for w in map(Path, self.written))

    def run(self, line: str) -> None:
        required, optional = split_optional(self.expand(line))
        if not required:
            return
        assignment = re.fullmatch(r"(\w+)=(.*)", required[0])
        if assignment and len(required) == 1 and not optional:
            self.variables[assignment.group(1)] = assignment.group(2)
            return
        head = required[0]
        if head == "trtvocab":
            self.trtvocab(line, required[1:], optional)
        elif head == "make":
            for target in required[1:]:
                if target not in _make_targets():
                    self.problems.append(f"{line}: no make target {target!r}")
                self.written |= _make_outputs(target)
        elif head.endswith("/python") and len(required) > 1:
            script = ROOT / required[1]
            if not script.is_file():
                self.problems.append(f"{line}: no script {required[1]}")
                return
            source = script.read_text()
            alternatives = [required[2:], *(alt for part in optional for alt in part)]
            for flag in (t for alt in alternatives for t in alt if t.startswith("--")):
                if f'"{flag}"' not in source:
                    self.problems.append(f"{line}: {required[1]} has no option {flag}")
        else:
            self.problems.append(f"{line}: not a trtvocab, make or example-script command")

    def trtvocab(self, line: str, args: list[str], optional: list[list[list[str]]]) -> None:
        """The line parses, alone and with each alternative of each optional part; what it reads exists."""
        group = typer.main.get_command(app)
        if not args or args[0] not in group.commands:  # type: ignore[attr-defined]
            self.problems.append(f"{line}: no trtvocab command {args[:1]}")
            return
        command = group.commands[args[0]]  # type: ignore[attr-defined]
        reads: list[str] = []
        for extra in [[], *(alt for part in optional for alt in part)]:
            try:
                ctx = command.make_context(args[0], [*args[1:], *extra])
            except Exception as exc:  # click's UsageError / BadParameter: the line does not parse
                self.problems.append(f"{line}: does not parse{' with ' + ' '.join(extra) if extra else ''} "
                                     f"({type(exc).__name__}: {exc})")
                continue
            for name, value in ctx.params.items():
                for path in (v for v in (value if isinstance(value, list | tuple) else [value])
                             if isinstance(v, Path)):
                    (self.written.add(str(path)) if name in OUTPUT_OPTIONS else reads.append(str(path)))
        for path in reads:
            if not self.readable(path):
                self.problems.append(f"{line}: reads {path}, which no line before it writes")
        if args[0] in RUN_NOW and not optional:  # seconds at most: these run for real
            res = CliRunner().invoke(app, args)
            if res.exit_code != 0:
                self.problems.append(f"{line}: exit {res.exit_code}: {res.output[-300:]}")


def _model_path(name: str) -> Path:
    model = next((m for m in MODELS if m.name == name), None)
    assert model is not None, f"README: trtvocab models {name}: no such model"
    path = find(model)
    if path is None:
        pytest.skip(f"{name} is not installed ({model.install})")
    return path


def test_readme_commands_run_as_written() -> None:
    session = Session()
    blocks = bash_blocks(README.read_text())
    assert len(blocks) >= 5
    for block in blocks:
        for line in command_lines(block):
            session.run(line)
    assert not session.problems, "README commands that do not run as written:\n" + "\n".join(session.problems)


def test_the_checker_catches_what_the_newcomer_hit() -> None:
    """Four broken README lines (a file no line writes, a misspelled option, a misspelled command): each
    is reported, and a file an earlier line writes is not."""
    session = Session()
    session.run("make demo")
    for line in ["trtvocab hidden SmolLM2-135M-Instruct.Q4_1.gguf --text-file examples/texts/eval.txt "
                 "--out eval.safetensors",
                 "trtvocab quantize x.gguf --algo nvfp4 --calib calib.safetensors --out nvfp4/",
                 "trtvocab infer artifacts/minilm --hidden hidden.safetensors --top-k 5 [--backnd onnx]",
                 "trtvocab biuld builders/minilm.toml"]:
        session.run(line)
    found = "\n".join(session.problems)
    for what in ("reads SmolLM2-135M-Instruct.Q4_1.gguf", "reads calib.safetensors", "reads artifacts/minilm",
                 "No such option: --backnd", "no trtvocab command ['biuld']"):
        assert what in found, found
    assert "reads eval.safetensors" not in found  # written by the first line: later lines may read it


def test_split_optional() -> None:
    line = "trtvocab x A [--b auto|c] [--json-schema F | --regex R] [--t 0.8 --s 1]"
    assert split_optional(line) == (["trtvocab", "x", "A"],
                                    [[["--b", "auto|c"]], [["--json-schema", "F"], ["--regex", "R"]],
                                     [["--t", "0.8", "--s", "1"]]])


def test_the_runner_runs_the_lines_this_checker_parses() -> None:
    runner = _runner()
    shown = [s.shown for s in runner.steps(README.read_text()) if s.kind == "bash"]
    assert shown == [line for block in bash_blocks(README.read_text()) for line in command_lines(block)]
    assert runner.split_optional('trtvocab x "a [b]" [--c 1 | --d] e  # [f]') == ('trtvocab x "a [b]" e # [f]',
                                                                                  [["--c 1", "--d"]])
    assert [s.expect for s in runner.steps(README.read_text()) if s.kind == "python"] == ["[2088, 4]"]


@pytest.mark.subprocess
def test_the_quick_readme_lines_run_for_real(tmp_path: Path) -> None:
    """Every README line that takes seconds (``tools/readme_run.py --quick``) runs as written in a scratch
    copy of the clone; ``make readme`` runs all of them (the demo, the comparisons, Gemma 3)."""
    if not (Path(sys.prefix) / "bin" / "trtvocab").is_file():
        pytest.skip(f"{sys.prefix}: trtvocab is not installed in this interpreter's environment")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_run.py"), "--quick", "--venv", sys.prefix,
                           "--keep", str(tmp_path / "clone"), "--json", str(tmp_path / "times.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "times.json").read_text())
    assert len(report["steps"]) >= 12 and all(s["ok"] for s in report["steps"])
