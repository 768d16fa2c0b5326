"""Tests follow the package: ``tests/<layer>/`` holds the tests of ``trtvocab/<layer>/`` (docs/testing.md).

Checked on the imports of the test files (an AST scan): in each layer folder, the layer imported most is the
folder's own, counting each name a test imports from ``trtvocab.<layer>...`` (a name of the ``trtvocab`` facade
counts for the layer that defines it; ``errors`` and ``base``, which every layer's tests use, count only in
``tests/base/``); and every file of ``tests/commands/`` tests the command line (``trtvocab.commands`` is its
layer imported most). No test file is over 800 lines.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Top-level modules of the package and the test folder of their layer.
TOP_LEVEL = {"vocab_parallel": "layers", "lm_head": "layers", "embedding": "layers", "logits": "layers"}
NOT_COUNTED = {"errors", "version", "base"}
EXEMPT_FOLDERS = {"project"}  # tests of the repository itself
# A layer whose tests reach it through another: the weight strategies run inside LMHead / VocabParallelEmbedding.
REACHED_THROUGH = {"weights": ("layers",)}
MAX_LINES = 800


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return TOP_LEVEL.get(parts[1], parts[1]) if parts[0] == "trtvocab" and len(parts) > 1 else None


def facade() -> dict[str, str]:
    """Each name ``trtvocab/__init__.py`` re-exports -> the layer of the module it comes from."""
    out = {}
    for node in ast.walk(ast.parse((TESTS.parent / "trtvocab" / "__init__.py").read_text())):  # TYPE_CHECKING too
        if isinstance(node, ast.ImportFrom) and node.module and (layer := _layer(node.module)) is not None:
            out.update({a.asname or a.name: layer for a in node.names})
    return out


def layers_imported(path: Path, folder: str) -> Counter[str]:
    """How many names ``path`` imports from each layer of the package (at module level or not)."""
    counts: Counter[str] = Counter()
    names = facade()
    for node in ast.walk(ast.parse(path.read_text())):
        found: list[str | None] = []
        if isinstance(node, ast.ImportFrom) and node.module == "trtvocab" and node.level == 0:
            found = [names.get(a.name, TOP_LEVEL.get(a.name, a.name)) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [_layer(node.module)] * len(node.names)
        elif isinstance(node, ast.Import):
            found = [_layer(a.name) for a in node.names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found = [_layer(node.args[0].value)]
        for layer in found:
            if layer is not None and (layer not in NOT_COUNTED or folder == "base"):
                counts["base" if layer in NOT_COUNTED else layer] += 1
    return counts


def test_each_layer_folder_mostly_imports_its_layer() -> None:
    wrong = {}
    for folder in sorted(p for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        if folder.name in EXEMPT_FOLDERS:
            continue
        counts: Counter[str] = Counter()
        for path in folder.glob("test_*.py"):
            counts += layers_imported(path, folder.name)
        own = counts[folder.name] + sum(counts[other] for other in REACHED_THROUGH.get(folder.name, ()))
        if counts and own < max(counts.values()):
            wrong[folder.name] = counts.most_common(3)
    assert not wrong, f"test folders whose own layer is not the one their tests import most: {wrong}"


def test_commands_holds_only_tests_of_the_command_line() -> None:
    wrong = {}
    for path in sorted((TESTS / "commands").glob("test_*.py")):
        counts = layers_imported(path, "commands")
        if counts["commands"] < max(counts.values(), default=0):
            wrong[path.name] = counts.most_common(3)
    assert not wrong, f"tests/commands/ files that test another layer (move them to its folder): {wrong}"


def test_no_test_file_is_over_800_lines() -> None:
    long = {str(p.relative_to(TESTS)): n for p in TESTS.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"test files over {MAX_LINES} lines (split them by what they test): {long}"
