"""No library layer spells a command-line flag: every module of ``trtvocab/`` outside the command lines names
its options by field or Python argument (`` `scale_search` ``), and ``commands/cli.py`` spells each as the
command's flag (``_flags``). A source scan: code, strings, comments and docstrings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trtvocab"

# The command lines, where flags are declared and spelled: trtvocab's, and the kernels' own (argparse).
COMMAND_LINES = ("trtvocab/commands", "trtvocab/kernels/__main__.py")
# A shell command quoted whole for the user to type (an install instruction): pip's flags, and a trtvocab
# command line as the user writes it. Each entry must still occur in its file.
QUOTED_COMMANDS = {"trtvocab/checkpoints/real_models.py": {"--no-deps", "--assemble"}}

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _scanned() -> list[Path]:
    """Every module of the package but the command lines."""
    def command_line(rel: str) -> bool:
        return any(rel == entry or rel.startswith(entry + "/") for entry in COMMAND_LINES)

    return [p for p in sorted(PACKAGE.rglob("*.py")) if not command_line(p.relative_to(ROOT).as_posix())]


def _flags_in(path: Path) -> list[str]:
    quoted = QUOTED_COMMANDS.get(path.relative_to(ROOT).as_posix(), set())
    return [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in FLAG.finditer(line) if m[0] not in quoted]


def test_the_scan_finds_a_flag() -> None:
    text = 'raise ConfigError(f"--tp must be >= 1")  # ``--json`` and --max-kld-mean, not x--y or a - -b'
    assert FLAG.findall(text) == ["--tp", "--json", "--max-kld-mean"]


def test_the_scan_covers_the_package() -> None:
    """Every layer is scanned (over a hundred modules), the command lines are not, and each exception exists."""
    scanned = {p.relative_to(ROOT).as_posix() for p in _scanned()}
    assert len(scanned) > 100 and "trtvocab/accuracy/gates.py" in scanned and "trtvocab/lm_head.py" in scanned \
        and "trtvocab/pipeline/plan.py" in scanned
    assert not any(s.startswith("trtvocab/commands/") for s in scanned)
    assert all((ROOT / entry).exists() for entry in COMMAND_LINES)
    for entry, flags in QUOTED_COMMANDS.items():
        text = (ROOT / entry).read_text()
        assert all(flag in text for flag in flags), f"{entry}: drop what it no longer quotes from QUOTED_COMMANDS"


def test_no_flag_below_the_command_line() -> None:
    found = [hit for p in _scanned() for hit in _flags_in(p)]
    assert found == [], "name the field in backquotes; commands/cli.py spells it as the flag:\n" + "\n".join(found)

