"""No library layer spells a command-line flag: the modules below ``trtvocab/commands/`` that a command drives
name their options by field or Python argument (`` `scale_search` ``), and ``commands/cli.py`` spells each as
the command's flag (``_flags``). A source scan: code, strings, comments and docstrings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The library modules a command's options reach, each a file or a folder.
SCANNED = ("trtvocab/accuracy/compare.py", "trtvocab/quant/quantize.py", "trtvocab/sampling/grammar.py",
           "trtvocab/pipeline/generate", "trtvocab/pipeline/plan.py")
# pending: plan.py still spells its flags; it leaves this list when it names fields.
PENDING = {"trtvocab/pipeline/plan.py"}

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _files(entry: str) -> list[Path]:
    path = ROOT / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _flags_in(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in FLAG.finditer(line)]


def test_the_scan_finds_a_flag() -> None:
    text = 'raise ConfigError(f"--tp must be >= 1")  # ``--json`` and --max-kld-mean, not x--y or a - -b'
    assert FLAG.findall(text) == ["--tp", "--json", "--max-kld-mean"]


def test_no_flag_below_the_command_line() -> None:
    assert all(_files(entry) and all(p.is_file() for p in _files(entry)) for entry in SCANNED)
    found = [hit for entry in SCANNED if entry not in PENDING for p in _files(entry) for hit in _flags_in(p)]
    assert found == [], "name the field in backquotes; commands/cli.py spells it as the flag:\n" + "\n".join(found)


def test_a_pending_module_still_needs_its_place() -> None:
    """A module on the pending list that no longer spells a flag leaves the list (and is scanned)."""
    done = sorted(entry for entry in PENDING if not any(_flags_in(p) for p in _files(entry)))
    assert done == [], f"remove from PENDING: {done}"
