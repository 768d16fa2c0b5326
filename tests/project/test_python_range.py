"""The Python range the package declares is the one it is tested and linted at: pyproject.toml's
``requires-python``, ruff's ``target-version`` and the Makefile's ``MIN_PYTHON`` (``make lint`` runs vermin
against it) name the same oldest version, the suite runs inside the range, and the one private module of
the standard library the package imports (``re._parser``, 3.11+: quant/patterns.py's bounded matcher;
docs/architecture.md, "What is written by hand, and why") is imported where the declaration says it exists."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Private standard-library modules the package may import, and the Python they need.
PRIVATE_STDLIB = {"re._parser": (3, 11), "re._constants": (3, 11)}


def declared_minimum() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert match, f"requires-python {spec!r}: one lower bound expected"
    return int(match[1]), int(match[2])


def test_pyproject_ruff_and_the_makefile_name_one_oldest_python() -> None:
    major, minor = declared_minimum()
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["target-version"]
    assert ruff == f"py{major}{minor}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^MIN_PYTHON := {major}\.{minor}$", makefile, re.MULTILINE)
    assert "vermin" in makefile and "--target=$(MIN_PYTHON)-" in makefile


def test_the_suite_runs_inside_the_declared_range() -> None:
    assert sys.version_info[:2] >= declared_minimum()


def test_private_stdlib_imports_are_listed_and_inside_the_range() -> None:
    found = {}
    for path in sorted((ROOT / "trtvocab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")
                if top[0] in sys.stdlib_module_names and any(p.startswith("_") and p != "__future__" for p in top):
                    found[name] = str(path.relative_to(ROOT))
    unlisted = {n: where for n, where in found.items() if n not in PRIVATE_STDLIB}
    assert not unlisted, f"private standard-library imports not in PRIVATE_STDLIB: {unlisted}"
    assert all(PRIVATE_STDLIB[n] <= declared_minimum() for n in found)
