"""A quantized head's format is its enum: the stored bytes' format a ``WeightFormat`` (``HeadQuantDecision.stored``,
the compressed-tensors module verdicts), the config's algo a ``QuantAlgo``; no code compares either with a
string such as ``"NVFP4"``. An AST scan of the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"FP8", "NVFP4"}


def _string_compares(source: str) -> list[int]:
    """Lines comparing a value with one of :data:`NAMES` written as a string (``==``, ``!=``, ``is``, ``in``)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and any(isinstance(x, ast.Constant) and x.value in NAMES for x in (node.left, *node.comparators))]


def test_the_scan_finds_a_string_compare() -> None:
    assert _string_compares('if algo == "NVFP4":\n    pass\nok = fmt is WeightFormat.FP8\n') == [1]


def test_no_format_is_compared_as_a_string() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "trtvocab").rglob("*.py"))
             for line in _string_compares(path.read_text())]
    assert found == [], "compare WeightFormat / QuantAlgo members:\n" + "\n".join(found)
