"""Docs that hold: every repository path the code, its comments and the docs name exists; the design
doc keeps the design and ``docs/kernels.md`` / ``docs/generate.md`` the numbers; ``benchmarks/`` cites
no issue tracker (docs/testing.md, "tests/project/")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the repository tracks and names (ignored folders such as .venv/, artifacts/ and
# benchmarks/results/ are outputs, not references).
FOLDERS = ("trtvocab", "tests", "docs", "benchmarks", "tools", "builders", "examples")
ROOT_FILES = ("README.md", "Makefile", "pyproject.toml", ".ci/run")
SKIP_PARTS = {"__pycache__", "results", "data"}
TEXT = re.compile(r"\.(py|md|cpp|h|toml)$|(^|/)(Makefile|run)$")

# A path with a folder: `tests/parallel/rank_fns.py`, `quant/gguf_blocks.GGUFConfig`, `csrc/`. Not part of a
# URL, an absolute path or a glob (`tests/*/test_*.py`, `rank{r}/...`).
SLASHED = re.compile(r"(?<![\w./:~$<*-])((?:[A-Za-z_][\w-]*/)+[\w.-]*\w/?)(?![\w/(<*{-])")
# A bare file name of the package's own kinds, outside tests/ (whose strings are test data: `r.toml`).
BARE = re.compile(r"(?<![\w./:~$<*-])(\w+\.(?:py|cpp|h))\b(?![\w/(<*{-])")

# Named on purpose though not here: other projects' files, and a folder a doc says does not exist yet.
EXTERNAL = {"tools/perplexity/perplexity.cpp", "llama.cpp", "tests/backends"}
# Stale references in files another change owns ("FILE: REF"); remove each entry when its file is fixed.
KNOWN_STALE: set[str] = set()


def tracked_files(root: Path = ROOT) -> list[Path]:
    files = [root / f for f in ROOT_FILES if (root / f).is_file()]
    for folder in FOLDERS:
        files += [p for p in sorted((root / folder).rglob("*"))
                  if p.is_file() and not SKIP_PARTS & set(p.relative_to(root).parts[:-1])]
    return files


def _exists(root: Path, where: Path, ref: str, rel: list[str]) -> bool:
    """``ref`` names a file or folder from ``where``'s folder or one above it, with or without a module
    attribute (``build.verify_export``) or ``.py``; or a repository path ends with it (``quant/x.py``)."""
    stem = re.sub(r"\.\w+$", "", ref)
    for cand in (ref, ref + ".py", stem, stem + ".py"):
        for folder in (where.parent, *where.parent.parents):
            if folder.is_relative_to(root) and (folder / cand).exists():
                return True
        if any(r.endswith("/" + cand) for r in rel):
            return True
    return False


def stale_references(root: Path = ROOT) -> list[str]:
    """``file:line: reference`` for every path named in ``root``'s files that names nothing there."""
    files = tracked_files(root)
    rel = [str(p.relative_to(root)) for p in files]
    names = {p.name for p in files}
    folders = {part for r in rel for part in Path(r).parts[:-1]} | set(FOLDERS)
    found = []
    for path, name in zip(files, rel, strict=True):
        if not TEXT.search(name) or path == Path(__file__).resolve():  # this file's examples are test data
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            refs = [r for r in (m.rstrip("/") for m in SLASHED.findall(line)) if r.split("/")[0] in folders]
            if not name.startswith("tests/"):
                refs += [b for b in BARE.findall(line) if b not in names]
            for ref in refs:
                if ref in EXTERNAL or ref.endswith("llama.cpp") or f"{name}: {ref}" in KNOWN_STALE:
                    continue
                if "/" not in ref or not _exists(root, path, ref, rel):
                    found.append(f"{name}:{i}: {ref}")
    return found


def test_every_repository_path_named_in_code_and_docs_exists() -> None:
    stale = stale_references()
    assert not stale, "paths that do not exist (moved or renamed?):\n" + "\n".join(stale)


def test_the_path_check_catches_a_moved_file(tmp_path: Path) -> None:
    """The checker itself, on a small tree: a moved test, a missing folder and a deleted module are found;
    a module attribute, a path relative to the package, a URL and another project's file pass."""
    (tmp_path / "trtvocab" / "quant").mkdir(parents=True)
    (tmp_path / "trtvocab" / "quant" / "gguf_blocks.py").write_text("")
    (tmp_path / "tests" / "kernels").mkdir(parents=True)
    (tmp_path / "tests" / "kernels" / "test_fused_kernels.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "`quant/gguf_blocks.GGUFConfig` and tests/kernels/test_fused_kernels.py and `trtvocab/quant/`\n"
        "see https://x.org/trtvocab/b.py, llama.cpp's tools/perplexity/perplexity.cpp, `tests/*/test_*.py`\n"
        "tests/test_fused_kernels.py, trtvocab/gone/, and `reference_ops.py`\n")
    assert stale_references(tmp_path) == ["docs/a.md:3: tests/test_fused_kernels.py", "docs/a.md:3: trtvocab/gone",
                                          "docs/a.md:3: reference_ops.py"]


# The design doc's measurements live in docs/kernels.md (kernels, with their kernel_ab.py commands) and
# docs/generate.md (end to end); architecture.md keeps at most a handful of numbers in its prose.
MEASUREMENT = re.compile(r"[0-9] ?(ms|us|GB/s|MAC/ns)|[0-9]\.[0-9]+x")
MAX_MEASUREMENT_LINES = 10


def test_architecture_keeps_the_design_and_the_numbers_live_elsewhere() -> None:
    lines = [f"{i}: {line}" for i, line in enumerate((ROOT / "docs" / "architecture.md").read_text().splitlines(), 1)
             if MEASUREMENT.search(line)]
    assert len(lines) <= MAX_MEASUREMENT_LINES, (
        f"{len(lines)} measurement lines in docs/architecture.md (at most {MAX_MEASUREMENT_LINES}): move them to "
        "docs/kernels.md or docs/generate.md\n" + "\n".join(lines))


ISSUE = re.compile(r"issue ?#?[0-9]+", re.IGNORECASE)


def test_benchmarks_cite_no_issue_numbers() -> None:
    """A benchmark says what it measures; the tracker is outside a clone (the rule of test_architecture.py's
    docstring checks, extended to every line of benchmarks/)."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*"))
            if p.is_file() and p.suffix in {".py", ".md", ".txt"} and "results" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not hits, hits


def test_docs_name_no_path_of_the_machine_that_wrote_them() -> None:
    """A user's clone has no /tmp/<run>, /work or /home of ours: docs name paths inside the clone (generated
    tables too: tools/model_zoo.py cuts its temporary folder from the messages it records)."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"(?<![\w.])/(tmp|work|home)/", line)]
    assert not found, f"machine paths in the docs: {found}"
