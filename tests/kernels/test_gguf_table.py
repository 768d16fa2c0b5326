"""The GGUF block-type table: one row per type in Python (:data:`trtvocab.quant.gguf_blocks.BLOCK_TYPES`) and
one traits entry per kind in C++ (``csrc/gguf.cpp``: ``enum Kind``, ``TRAITS``), held equal; and the facts every
consumer derives from the row (the weight format, the kernel's kind and row bytes, the ONNX graph formats)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from trtvocab import kernels
from trtvocab.base.formats import WeightFormat
from trtvocab.export import contract, onnx
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import library
from trtvocab.quant import gguf_blocks as gb

GGUF_CPP = (kcompile.CSRC / "gguf.cpp").read_text()


def cpp_table() -> list[tuple[str, str, int, int]]:
    """``(enum name, GGML name, values, bytes)`` per kind of gguf.cpp, in enum order (parsed from the source)."""
    enum = re.search(r"enum Kind : int \{([^}]*)\}", GGUF_CPP)
    traits = re.search(r"constexpr BlockTraits TRAITS\[KINDS\] = \{(.*?)\n\};", GGUF_CPP, re.S)
    assert enum and traits, "gguf.cpp: enum Kind or TRAITS not found"
    names = [n.strip() for n in enum.group(1).split(",")]
    assert names[-1] == "KINDS"
    rows = re.findall(r'\{"(\w+)", (\d+), (\d+),', traits.group(1))
    assert len(rows) == len(names) - 1
    return [(e, n, int(v), int(b)) for e, (n, v, b) in zip(names[:-1], rows, strict=True)]


def test_python_rows_equal_the_cpp_enum_and_traits_in_the_source() -> None:
    cpp = cpp_table()
    assert [(t.name, t.name, t.values, t.bytes) for t in gb.BLOCK_TYPES.values()] == cpp
    assert [t.kind for t in gb.BLOCK_TYPES.values()] == list(range(len(cpp)))


def test_python_kinds_equal_the_built_library() -> None:
    loaded = kernels.load()
    if loaded is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    values, size = ctypes.c_int64(0), ctypes.c_int64(0)
    for t in gb.BLOCK_TYPES.values():
        assert loaded.lib.trtvocab_gguf_kind(t.name.encode(), ctypes.byref(values), ctypes.byref(size)) == t.kind
        assert (values.value, size.value) == (t.values, t.bytes), t.name
    assert loaded.lib.trtvocab_gguf_kind(b"Q5_1", None, None) == -1  # not in the table yet (docs/kernels.md)
    # a kind past the table is refused (status 2), not read
    x, blocks = torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8)
    out = torch.empty(1, 1)
    kinds = len(gb.BLOCK_TYPES)
    assert loaded.lib.trtvocab_gguf_logits(x.data_ptr(), 1, 32, 32, kinds, blocks.data_ptr(), 1, 34,
                                           out.data_ptr(), 1) == 2


def test_every_gguf_weight_format_is_a_row_and_consumers_derive_from_the_table() -> None:
    gguf = [f for f in WeightFormat if f.is_gguf]
    assert gguf == list(gb.FORMATS) == [gb.of_format(f).weight_format for f in gguf]
    assert not any(f.is_gguf for f in (WeightFormat.DENSE, WeightFormat.FP8, WeightFormat.NVFP4))
    exportable = tuple(t.weight_format for t in gb.BLOCK_TYPES.values() if t.onnx_codes)
    assert onnx.GGUF_GRAPH_FORMATS == exportable
    assert all(onnx.MIN_OPSET[f] == 21 for f in exportable)
    assert set(contract._GGUF_CODES) == set(exportable)
    for t in gb.BLOCK_TYPES.values():
        assert gb.GGUFConfig(block_type=t.name).weight_format is t.weight_format
        assert gb.GGUFConfig(block_type=t.name).row_bytes(t.values * 3) == 3 * t.bytes
        raw = torch.zeros(2, t.bytes, dtype=torch.uint8)
        assert t.dequantize(raw).shape == (2, t.values)


def test_a_gguf_head_runs_the_kernel_of_its_row() -> None:
    """gguf_logits passes the row's kind: each type against its own torch chain (a wrong kind reads other bytes)."""
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(3)
    for t in gb.BLOCK_TYPES.values():
        raw = torch.randint(0, 256, (5, 2, t.bytes), dtype=torch.uint8, generator=g)
        for _, at in t.scales:
            raw[..., at : at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        raw = raw.reshape(5, -1)
        x = torch.randn(2, 2 * t.values, generator=g)
        want = gb.chain_logits(x, t.dequantize(raw))
        assert torch.equal(library.gguf_logits(x, 2 * t.values, t.name, raw).view(torch.int32),
                           want.view(torch.int32)), t.name
