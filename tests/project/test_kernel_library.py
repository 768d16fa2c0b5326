"""The kernels as one library (docs/kernels.md): one GGUF block-type table, one set of ISA tiers and helpers
under csrc/, one ABI table, a small facade. Source scans: no library is built here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import trtvocab.kernels as kernels
from trtvocab.kernels import compile as kcompile

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trtvocab"
CSRC = kcompile.CSRC


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_a_gguf_block_type_is_named_in_code_only_in_its_table() -> None:
    names = {"Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q4_K"}
    hits = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if names & set(_code_strings(p)))
    assert hits == ["trtvocab/quant/gguf_blocks.py"]


def test_no_string_test_for_a_gguf_format() -> None:
    hits = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if 'startswith("GGUF_")' in p.read_text()]
    assert hits == []


def test_gguf_cpp_names_its_kinds_and_uses_the_fused_tiers() -> None:
    source = (CSRC / "gguf.cpp").read_text()
    assert not re.search(r"KIND == \d", source)
    assert "GGUF_AVX" not in source
    assert '#include "fused/contract.h"' in source and '#include "fused/vec8.h"' in source


def test_the_shared_helpers_have_one_definition_under_csrc() -> None:
    sources = {p: p.read_text() for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h")}
    for pattern in (r"\binline float half_to_float\(", r"\binline float tree8\(", r"#define TRTVOCAB_AVX2 1"):
        where = [str(p.relative_to(CSRC)) for p, text in sources.items() for _ in re.finditer(pattern, text)]
        assert len(where) == 1, (pattern, where)


def test_the_abi_is_one_table_of_every_exported_symbol() -> None:
    exported = set()
    for unit in kcompile.UNITS:
        text = unit.read_text()
        body = text[text.index('extern "C" {'):]
        exported |= set(re.findall(r"^\w[\w\s\*]*?\b(trtvocab_\w+)\(", body, re.M))
    assert exported == {name for name, *_ in kcompile.SYMBOLS}
    assert all(kcompile.OLDEST_ABI <= since <= kcompile.ABI for *_, since in kcompile.SYMBOLS)
    assert max(since for *_, since in kcompile.SYMBOLS) == kcompile.ABI  # a new symbol bumps the ABI
    assert f"int trtvocab_fused_abi() {{ return {kcompile.ABI}; }}" in (CSRC / "fused.cpp").read_text()
    assert "hasattr(lib" not in Path(kcompile.__file__).read_text()
    assert set(kcompile.UNITS) == set(CSRC.glob("*.cpp"))  # every unit is built


def test_the_facade_is_what_the_heads_and_the_sampler_call() -> None:
    assert len(kernels.__all__) <= 15  # review 4 §6.3: the facade is what callers need; internals by module
    assert not {"read_probe", "mul_probe", "gguf_chain_probe", "build_name", "load_isa"} & set(kernels.__all__)


def test_one_tile_driver_and_no_preprocessor_inside_a_kernel_body() -> None:
    fused = (CSRC / "fused.cpp").read_text()
    assert fused.count("#if") <= 12  # includes, the dispatch's tier tests and the extern "C" functions
    start = fused.index("void wide_batched(const F& f")
    body = fused[start : fused.index("\n}\n", start)]
    assert "#if" not in body
    # the tile x pass x row loop of the kernels that keep a tile's chains in memory is row_tiles (contract.h)
    for header, kernel in (("lanes8.h", "void direct("), ("avx512.h", "void wide_nvfp4("),
                           ("avx512_bf16.h", "void wide_nvfp4_lanes_bf16(")):
        text = (CSRC / "fused" / header).read_text()
        start = text.index(kernel)
        body = text[start : text.index("\n}\n", start)]
        assert "row_tiles<" in body and "at::parallel_for(0, tiles" not in body, kernel
