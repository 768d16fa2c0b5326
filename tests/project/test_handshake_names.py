"""What the ranks compare in a handshake is written once: the module's values in
``VocabParallelModule.handshake_identity`` (a subclass extends it through ``super()``; the chunked head reads
it), the layout field's name in ``parallel.sharding.LAYOUT_FIELD`` with its value ``layout_code``, the weight
formats as the enum itself (``D.Field`` takes it), one ``_meet``; and a call's pending verdict is a value
its handshake returns, never state left on the module for its first collective. An AST and text scan of the
package (review 4, rows 25, 37 and 38)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "trtvocab").rglob("*.py"))


def _definitions(source: str, name: str) -> list[ast.AST]:
    """The functions (methods included) named ``name`` and the assignments to a variable ``name``."""
    found: list[ast.AST] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            found.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend(node for t in targets if isinstance(t, ast.Name) and t.id == name)
    return sorted(found, key=lambda node: node.lineno)  # type: ignore[attr-defined]


def _where(name: str) -> list[str]:
    """The files defining ``name``, once per definition."""
    return [str(path.relative_to(ROOT)) for path in SOURCES for _ in _definitions(path.read_text(), name)]


def _calls_super(function: ast.AST, name: str) -> bool:
    """Whether ``function`` calls ``super().<name>()``."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
               and isinstance(n.func.value, ast.Call) and isinstance(n.func.value.func, ast.Name)
               and n.func.value.func.id == "super" for n in ast.walk(function))


def test_the_scan_finds_definitions() -> None:
    source = "X = 1\nclass A:\n    def f(self):\n        return super().f()\ndef f():\n    pass\n"
    assert [n.lineno for n in _definitions(source, "f")] == [3, 5]  # type: ignore[attr-defined]
    assert [n.lineno for n in _definitions(source, "X")] == [1]  # type: ignore[attr-defined]
    assert _calls_super(_definitions(source, "f")[0], "f") and not _calls_super(_definitions(source, "f")[1], "f")


def test_each_handshake_name_is_defined_once() -> None:
    assert _where("_meet") == ["trtvocab/vocab_parallel.py"]
    assert _where("LAYOUT_FIELD") == ["trtvocab/parallel/sharding.py"]
    # The copies the one definition replaced: three _identity, four tuples of the weight formats.
    assert _where("_identity") == [] and _where("_FORMATS") == []


def test_handshake_identity_has_one_home() -> None:
    """Defined by VocabParallelModule; every other definition extends it (``super()`` first)."""
    homes: list[str] = []
    overrides: list[str] = []
    for path in SOURCES:
        for node in _definitions(path.read_text(), "handshake_identity"):
            (overrides if _calls_super(node, "handshake_identity") else homes).append(str(path.relative_to(ROOT)))
    assert homes == ["trtvocab/vocab_parallel.py"], homes
    assert overrides, "the head and the embedding extend it"


def test_handshake_texts_are_written_once() -> None:
    text = {path: path.read_text() for path in SOURCES}
    layout = [str(p.relative_to(ROOT)) for p, s in text.items() for _ in range(s.count("vocab layout (0 = uneven"))]
    assert layout == ["trtvocab/parallel/sharding.py"], layout
    recomputed = [str(p.relative_to(ROOT)) for p, s in text.items() for _ in range(s.count('== "uneven" else'))]
    assert recomputed == ["trtvocab/parallel/sharding.py"], "use layout_code: " + ", ".join(recomputed)
    tuples = [str(p.relative_to(ROOT)) for p, s in text.items() if "tuple(WeightFormat)" in s]
    assert tuples == [], "D.Field takes the enum class: " + ", ".join(tuples)


def test_the_pending_verdict_is_no_mailbox() -> None:
    found = [f"{p.relative_to(ROOT)}: {word}" for p in SOURCES for word in ("handshake_state.pending", "take_pending")
             if word in p.read_text()]
    assert found == [], "hand the Pending that handshake / open_call return to the first collective: " + str(found)
