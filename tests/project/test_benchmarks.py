"""The benchmarks share one harness (benchmarks/_harness.py) and one helper module (benchmarks/common.py):
every script takes ``--json``, none imports another script, and the harness's rounds and record do what
its docstring says."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SHARED = {"_harness", "common"}  # what a script may import from its own folder
_spec = importlib.util.spec_from_file_location("_harness", BENCH / "_harness.py")
harness = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_harness", harness)
_spec.loader.exec_module(harness)


def scripts() -> list[Path]:
    return [p for p in sorted(BENCH.glob("*.py")) if p.stem not in SHARED]


def test_no_benchmark_imports_a_sibling_script() -> None:
    siblings = {p.stem for p in scripts()}
    found = []
    for path in [*scripts(), *(BENCH / f"{s}.py" for s in SHARED)]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in siblings]
    assert not found, found


def test_every_benchmark_takes_json() -> None:
    """``add_json(parser)`` (the harness's flag), or a ``--json`` of its own (the peers, whose output is a
    JSON line anyway, and perplexity_anchor's ``--json FILE``)."""
    assert len(scripts()) >= 20
    missing = []
    for path in scripts():
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        own = any(isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument" and c.args
                  and isinstance(c.args[0], ast.Constant) and c.args[0].value == "--json" for c in calls)
        shared = any(isinstance(c.func, ast.Name) and c.func.id == "add_json" for c in calls)
        if not (own or shared):
            missing.append(path.name)
    assert not missing, f"benchmarks without --json: {missing}"


def test_interleaved_rounds_rotate_and_time_every_contender() -> None:
    order: list[str] = []
    clock = iter(range(1000))
    timed = harness.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b"),
                                 "c": lambda: order.append("c")}, 3, warmup=1, clock=lambda: float(next(clock)))
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]  # warm-up, then rotated rounds
    assert {k: len(t.seconds) for k, t in timed.items()} == {"a": 3, "b": 3, "c": 3}
    assert timed["a"].best == 1.0 and timed["a"].median == 1.0 and timed["a"].ms()["best_ms"] == 1000.0
    assert harness.fraction(30_000_000, 0.001, 60.0) == pytest.approx(0.5)
    assert harness.fraction(1, 1.0, None) is None


def test_json_prints_one_line_with_revision_and_cpu_and_keeps_it(tmp_path: Path) -> None:
    parser = harness.add_json(argparse.ArgumentParser())
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(["--json", "--results", str(tmp_path), "--rounds", "2"])
    out = io.StringIO()
    with redirect_stdout(out), harness.recording("probe", args):
        print("a table line")  # goes to stderr under --json
        harness.add_row(batch=1, best_ms=2.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["benchmark"] == "probe" and record["rows"] == [{"batch": 1, "best_ms": 2.0}]
    assert record["lines"] == ["a table line"] and record["args"] == {"rounds": 2} and record["status"] == 0
    for key in ("revision", "cpu", "flags", "python", "time"):
        assert key in record
    kept = list(tmp_path.glob("*.jsonl"))
    assert len(kept) == 1 and json.loads(kept[0].read_text().splitlines()[-1]) == record


def test_without_json_the_output_is_unchanged(tmp_path: Path) -> None:
    args = harness.add_json(argparse.ArgumentParser()).parse_args(["--results", str(tmp_path)])
    out = io.StringIO()
    with redirect_stdout(out), harness.recording("probe", args):
        print("a table line")
    assert out.getvalue() == "a table line\n" and not list(tmp_path.iterdir())
