"""The package's shape: an acyclic import graph, one home per concept, docs a clone can read."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph
_spec.loader.exec_module(import_graph)


def test_import_graph_has_no_cycle_counting_lazy_imports() -> None:
    graph = import_graph.edges(ROOT)
    assert "trtvocab.weights.loader" in graph["trtvocab.lm_head"]  # the scan sees imports
    assert import_graph.cycles(graph) == []


def test_cycle_detection_finds_a_lazy_cycle(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is reported."""
    pkg = tmp_path / "trtvocab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from trtvocab import b\n")
    (pkg / "b.py").write_text("def f():\n    from trtvocab.a import x\n")
    assert import_graph.cycles(import_graph.edges(tmp_path)) == [["trtvocab.a", "trtvocab.b"]]


def test_no_module_imports_a_layer_above_its_own() -> None:
    """The layer order of tools/import_graph.py holds for every module, lazy imports included."""
    graph = import_graph.edges(ROOT)
    assert import_graph.upward(graph) == []
    # Every folder and top-level module has a layer (a new folder must be placed in the order).
    for mod in graph:
        import_graph.layer_of(mod)


def test_the_layer_rule_catches_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "trtvocab"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    for d in (pkg, pkg / "low", pkg / "high"):
        (d / "__init__.py").write_text("")
    (pkg / "high" / "h.py").write_text("from trtvocab.low import l\n")  # downward: allowed
    (pkg / "low" / "l.py").write_text("def f():\n    from trtvocab.high.h import x\n")  # upward, lazily
    layers = [("low",), ("high",)]
    assert import_graph.upward(import_graph.edges(tmp_path), layers) == [
        "trtvocab.low.l (low) -> trtvocab.high.h (high)"]


def test_imports_inside_functions_are_only_where_a_reason_is_listed(tmp_path: Path) -> None:
    """A ``trtvocab`` import inside a function sits only in a module of ``LOCAL_REASONS`` (CLI start-up,
    optional dependencies); the scan itself sees one in a nested function."""
    found = import_graph.local_imports(ROOT)
    assert found and {m for m, _, _ in found} <= set(import_graph.LOCAL_REASONS)
    pkg = tmp_path / "trtvocab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import trtvocab\n\ndef f():\n    def g():\n        from trtvocab import b\n")
    (pkg / "b.py").write_text("")
    assert import_graph.local_imports(tmp_path) == [("trtvocab.a", 5, "trtvocab")]


def test_only_the_command_line_is_a_program() -> None:
    """``commands/`` is the CLI: the library, the examples and the benchmarks never import it."""
    graph = import_graph.edges(ROOT)
    users = sorted(m for m, deps in graph.items() if not m.startswith("trtvocab.commands")
                   and any(d.startswith("trtvocab.commands") for d in deps))
    assert users == [], users
    for folder in ("examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not any(n.startswith("trtvocab.commands") for n in names), f"{path.relative_to(ROOT)}"


def test_writers_never_import_runners() -> None:
    graph = import_graph.edges(ROOT)
    for writer in ("trtvocab.export.onnx", "trtvocab.export.tensorrt"):
        assert not any(dep.startswith("trtvocab.backends") for dep in graph[writer]), writer


def test_every_public_class_has_a_docstring() -> None:
    missing = []
    for path in sorted((ROOT / "trtvocab").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and not ast.get_docstring(node):
                missing.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not missing, missing


def test_readme_and_docs_link_only_inside_the_repository() -> None:
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(doc.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue  # a web page, not a file
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
            assert resolved.exists(), f"{doc.name} links to a missing file: {target}"


def test_dense_head_exposes_its_weight_read_only() -> None:
    from trtvocab import LMHead, Mapping

    w = torch.randn(10, 8)
    head = LMHead(10, 8, dtype=torch.float32, mapping=Mapping(world_size=3, rank=1, tp_size=3))
    head.load_weights({"weight": w})
    assert torch.equal(head.weight, w[4:7])  # rank 1 of 3 owns [4, 7)
    assert head.weight.data_ptr() == head.weights.weight.data_ptr()  # a view, no copy
    try:
        head.weight = torch.zeros(3, 8)
    except AttributeError:
        pass
    else:
        raise AssertionError("LMHead.weight must have no setter")


MAX_MODULE_DOCSTRING_LINES = 18  # a summary and a pointer into docs/; the details live there
# Text that points outside the repository (a design file, the issue tracker) or reads as a work diary: a reader
# of a clone has neither the file nor the session. Say the property, or link a file under docs/.
OUTSIDE = re.compile(r"DESIGN(\.md| §)|\.\./shared|\bissues? #?\d+", re.IGNORECASE)
DIARY = re.compile(r"this session|first version|measured on this machine", re.IGNORECASE)


def test_module_docstrings_are_short_and_point_inside_the_repository() -> None:
    long, outside, diary = [], [], []
    for path in sorted((ROOT / "trtvocab").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        name = str(path.relative_to(ROOT))
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{name}: {len(doc.splitlines())} lines")
        if OUTSIDE.search(doc):
            outside.append(name)
        if DIARY.search(doc):
            diary.append(name)
    assert not long, long
    assert not outside, f"docstrings citing files outside the repository: {outside}"
    assert not diary, f"diary text in docstrings: {diary}"


def text_hits(texts: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The places (``where``) of ``(where, text)`` pairs whose text cites outside the repository, and
    those with diary text."""
    outside, diary = [], []
    for where, text in texts:
        if OUTSIDE.search(text):
            outside.append(where)
        if DIARY.search(text):
            diary.append(where)
    return outside, diary


def test_docs_point_inside_the_repository_and_keep_no_diary() -> None:
    """The same rule for the README and docs/: each hit is named with its line."""
    outside, diary = text_hits((f"{doc.relative_to(ROOT)}:{i}", line)
                               for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                               for i, line in enumerate(doc.read_text().splitlines(), 1))
    assert not outside, f"docs citing files or trackers outside the repository: {outside}"
    assert not diary, f"diary text in docs: {diary}"


def prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of a Python file's docstrings (module, class, function) and comments, in order."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.append((first.lineno, first.value.value))
    return sorted(found)


def test_tests_say_what_they_test_not_which_issue_asked() -> None:
    """The same rule for the docstrings and comments of tests/ (its test data, in strings, is free)."""
    outside, diary = text_hits((f"{path.relative_to(ROOT)}:{line}", text)
                               for path in sorted((ROOT / "tests").rglob("*.py")) for line, text in prose(path))
    assert not outside, f"test docstrings or comments citing issues or files outside the repository: {outside}"
    assert not diary, f"diary text in test docstrings or comments: {diary}"


def test_the_text_rules_catch_what_they_name(tmp_path: Path) -> None:
    """The checker itself, on lines it must refuse and lines it must let through."""
    assert OUTSIDE.search("fixed in issue 37") and OUTSIDE.search("see DESIGN §9") and OUTSIDE.search("../shared/x")
    assert DIARY.search("Measured on this machine") and DIARY.search("this session's first version")
    assert not OUTSIDE.search("tissue 3 of the issues list") and not DIARY.search("measured by benchmarks/compare.py")
    sample = tmp_path / "test_x.py"
    sample.write_text('"""Module doc."""\n\n\ndef test_a() -> None:\n    """Issue 19: a case."""\n'
                      '    x = "issue 20"  # the comment\n')
    assert prose(sample) == [(1, "Module doc."), (5, "Issue 19: a case."), (6, "# the comment")]


def test_sampling_defines_each_public_name_once() -> None:
    """One name per entry (review 4 §6.1): no public top-level name defined in two ``sampling/`` modules,
    no ``head: Any`` there, and the package's ``__init__`` defines no function."""
    import ast

    root = Path(__file__).resolve().parents[2] / "trtvocab" / "sampling"
    where: dict[str, list[str]] = {}
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(path.name)
        if path.name == "__init__.py":
            assert not [n for n in tree.body if isinstance(n, ast.FunctionDef)], "sampling/__init__.py: a function"
        assert "head: Any" not in path.read_text(), f"{path.name}: head: Any"
    assert {n: f for n, f in where.items() if len(f) > 1} == {}


def test_no_pipeline_function_is_over_60_lines() -> None:
    """The programs' library layer reads as short named steps (review 4 §6.4): a longer function there is
    split, as ``make_plan`` / ``build_rank`` / ``open_vocab_ends`` were."""
    long = {}
    for path in sorted((ROOT / "trtvocab" / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"pipeline functions over 60 lines: {long}"
