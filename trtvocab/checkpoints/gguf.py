"""llama.cpp ``.gguf`` files as checkpoints: header probes and lazy, dequantized row reads.

A GGUF file is a little-endian header (magic ``GGUF``, version, tensor and key/value counts, the
key/value metadata, one record per tensor: name, dims, GGML type, offset) followed by the aligned
tensor data. :class:`GGUFCheckpoint` parses that header itself (no tensor byte is read for names,
shapes or the config) and offers the interface of
:class:`~trtvocab.checkpoints.checkpoint.Checkpoint`: HF names for the head and the embedding
(``output.weight`` is ``lm_head.weight``, ``token_embd.weight`` is ``model.embed_tokens.weight``;
the GGUF names are accepted too), shapes in torch order ``[V, H]``, ``info(name).dtype`` as a
read returns it (F32 / F16 / BF16 and the integer types as stored, every block type
``gguf.quants`` dequantizes as ``"F32"``), and ``get_slice(name)[a:b]``: one positioned read of
rows ``a..b`` (quant blocks run along H), dequantized in bounded row chunks. This module sits
below ``checkpoint.py``, which opens it through ``open_checkpoint``.
"""

from __future__ import annotations

import functools
import itertools
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import torch

from trtvocab.base.safe_read import as_path, open_regular
from trtvocab.checkpoints.lazy_rows import RowReader, read_span
from trtvocab.checkpoints.names import EMBEDDING_NAMES, LM_HEAD_NAME, names_tied_head
from trtvocab.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit counts; 3 added big-endian files (refused here)
MAX_DIMS = 4  # GGML_MAX_DIMS
HF_LM_HEAD = LM_HEAD_NAME
HF_EMBEDDING = EMBEDDING_NAMES[0]  # model.embed_tokens.weight
# GGUF tensor name -> the HF name trtvocab's gating and loading look for.
HF_NAMES = {"output.weight": HF_LM_HEAD, "token_embd.weight": HF_EMBEDDING, "output.bias": "lm_head.bias"}
# Types read as stored: GGML type -> (safetensors-style tag, torch dtype).
NATIVE_TYPES: dict[gguf.GGMLQuantizationType, tuple[str, torch.dtype]] = {
    gguf.GGMLQuantizationType.F32: ("F32", torch.float32),
    gguf.GGMLQuantizationType.F16: ("F16", torch.float16),
    gguf.GGMLQuantizationType.BF16: ("BF16", torch.bfloat16),
    gguf.GGMLQuantizationType.F64: ("F64", torch.float64),
    gguf.GGMLQuantizationType.I8: ("I8", torch.int8),
    gguf.GGMLQuantizationType.I16: ("I16", torch.int16),
    gguf.GGMLQuantizationType.I32: ("I32", torch.int32),
    gguf.GGMLQuantizationType.I64: ("I64", torch.int64),
}
DEQUANTIZED = ("F32", torch.float32)
# Metadata arrays up to this length are kept in ``metadata``; longer ones (the vocabulary,
# merges, scores) only have their length recorded in ``array_lengths``.
MAX_KEPT_ARRAY = 1024
MAX_ARRAY_DEPTH = 8  # arrays of arrays: at most this many levels (deeper files are refused, not recursed into)
READ_CHUNK = 64 * 1024  # header read size: a probe reads at most this far past the header
DEQUANT_CHUNK_BYTES = 2**20  # float32 output per gguf.quants.dequantize call
# scalar GGUF value types -> struct format (little-endian)
_SCALARS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_STRING = int(gguf.GGUFValueType.STRING)
_ARRAY = int(gguf.GGUFValueType.ARRAY)
_T = gguf.GGUFValueType
_INTS = frozenset(int(t) for t in (_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64,
                                   _T.INT64))
_NUMBERS = _INTS | {int(_T.FLOAT32), int(_T.FLOAT64)}
# config.json keys derived from ``<arch>.<key>`` metadata (beyond vocab / hidden / tying).
_ARCH_CONFIG = {
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_TOKEN_CONFIG = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                 "padding_token_id": "pad_token_id"}


@functools.cache
def dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype`` (probed once on one zero block)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF header: where its bytes are and what a read returns (no data read).

    The same fields as :class:`trtvocab.checkpoints.checkpoint.TensorInfo`, plus the GGUF record.

    Args:
        name: the name trtvocab uses (HF for the head / embedding, else the GGUF name).
        dtype: safetensors-style tag of what a read returns (``"F32"`` for block-quantized types).
        shape: torch order, slowest dim first (``[V, H]`` for a head).
        file: the ``.gguf`` file.
        offset: absolute byte offset of the tensor's data in ``file``.
        nbytes: stored (quantized) bytes.
        gguf_name: the name in the file (``output.weight``, ``token_embd.weight``, ...).
        ggml_type: the stored GGML type.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int
    gguf_name: str
    ggml_type: gguf.GGMLQuantizationType

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype a read returns."""
        return self._read_as[1]

    @property
    def native(self) -> bool:
        """Read as stored (no dequantization)."""
        return self.ggml_type in NATIVE_TYPES

    @property
    def _read_as(self) -> tuple[str, torch.dtype]:
        return NATIVE_TYPES.get(self.ggml_type, DEQUANTIZED)

    @property
    def line_bytes(self) -> int:
        """Stored bytes of one run of the fastest dim (``H`` values of a ``[V, H]`` head)."""
        block, type_size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return (self.shape[-1] // block) * type_size if self.shape else type_size

    @property
    def row_bytes(self) -> int:
        """Stored bytes of one row along the slowest dim (``shape[0]``)."""
        lines = 1
        for d in self.shape[1:-1]:
            lines *= d
        return lines * self.line_bytes if len(self.shape) > 1 else self.line_bytes


class _HeaderReader:
    """Sequential little-endian reads of a GGUF header, in chunks, with bounds checks naming the file."""

    def __init__(self, fh: BinaryIO, path: Path, size: int) -> None:
        self.fh, self.path, self.size = fh, path, size
        self.buf = b""
        self.base = 0  # absolute offset of buf[0]
        self.pos = 0  # position inside buf
        self.bytes_read = 0

    def tell(self) -> int:
        return self.base + self.pos

    def _need(self, n: int, what: str) -> None:
        at = self.tell()
        if n < 0 or at + n > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header: {what} needs {n} bytes "
                                  f"at offset {at}, but the file has {self.size}")
        have = len(self.buf) - self.pos
        if have >= n:
            return
        want = min(max(n - have, READ_CHUNK), self.size - (self.base + len(self.buf)))
        data = self.fh.read(want)
        self.bytes_read += len(data)
        self.buf = self.buf[self.pos:] + data
        self.base, self.pos = at, 0
        if len(self.buf) < n:
            raise CheckpointError(f"{self.path}: GGUF header ends early: {what} needs {n} bytes at offset {at}")

    def take(self, n: int, what: str) -> bytes:
        self._need(n, what)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int, what: str) -> None:
        at = self.tell()
        if n < 0 or at + n > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header: {what} needs {n} bytes "
                                  f"at offset {at}, but the file has {self.size}")
        if self.pos + n <= len(self.buf):
            self.pos += n
            return
        self.fh.seek(at + n)
        self.buf, self.base, self.pos = b"", at + n, 0

    def string(self, what: str, keep: bool = True) -> str:
        length = self.unpack("<Q", what)
        if length > self.size:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} claims a {length}-byte string")
        if not keep:
            self.skip(length, what)
            return ""
        return self.take(length, what).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, keep: bool = True, depth: int = 0) -> Any:
        """One value of ``vtype``; ``depth`` is how many arrays it sits in (bounded by :data:`MAX_ARRAY_DEPTH`)."""
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.unpack(fmt, what)
        if vtype == _STRING:
            return self.string(what, keep)
        if vtype == _ARRAY:
            return self.array(self.unpack("<I", f"{what} item type"), what, keep, depth + 1)
        raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} has unknown value type {vtype}")

    def array(self, item_type: int, what: str, keep: bool = True, depth: int = 1) -> tuple[int, list[Any] | None]:
        """``(length, items)`` of an array of ``item_type`` (its type field already read); items only
        when ``keep`` and at most :data:`MAX_KEPT_ARRAY` of them. ``depth`` counts this array: arrays of
        arrays nest at most :data:`MAX_ARRAY_DEPTH` deep (a loop, not Python's recursion limit, decides)."""
        if item_type == _ARRAY and depth >= MAX_ARRAY_DEPTH:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} nests arrays more than "
                                  f"{MAX_ARRAY_DEPTH} deep (the limit, MAX_ARRAY_DEPTH; llama.cpp reads no "
                                  "nested arrays at all)")
        count = self.unpack("<Q", f"{what} length")
        if count > self.size:
            raise CheckpointError(f"{self.path}: corrupt GGUF header: {what} claims {count} items")
        keep = keep and count <= MAX_KEPT_ARRAY
        fmt = _SCALARS.get(item_type)
        if fmt is not None and not keep:
            self.skip(count * struct.calcsize(fmt), what)
            return count, None
        if item_type == _STRING and not keep:
            for _ in range(count):  # each string has its own length: walk them without decoding
                self.skip(self.unpack("<Q", what), what)
            return count, None
        items = [self.value(item_type, what, keep, depth) for _ in range(count)]
        return count, items if keep else None


def _regular_file(path: Path) -> int:
    """The size of ``path``, which must be a regular file (a FIFO or device is never opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file or directory") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot stat ({exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"checkpoint {path}: expected a regular .gguf file")
    return st.st_size


def _size_bound(file_size: int) -> int:
    """The most header records (each at least 8 bytes) a file of ``file_size`` bytes can hold."""
    return file_size // 8


def _ggml_type(path: Path, name: str, type_id: int) -> gguf.GGMLQuantizationType:
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported GGML type id {type_id} "
                              f"(known: {[t.name for t in gguf.GGMLQuantizationType]})") from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise CheckpointError(f"{path}: tensor {name!r} has GGML type {qtype.name} of unknown block size")
    return qtype


class GGUFCheckpoint:
    """A llama.cpp ``.gguf`` file, read like a :class:`~trtvocab.checkpoints.checkpoint.Checkpoint`.

    Opening it parses the header only (metadata and tensor records; the file's size bounds
    every record, so truncated data is reported here, without reading it). ``config`` is
    derived from the metadata: ``vocab_size`` (the length of ``tokenizer.ggml.tokens``, else
    ``<arch>.vocab_size``, else the embedding's rows), ``hidden_size``
    (``<arch>.embedding_length``, else the embedding's columns) and
    ``tie_word_embeddings`` (true when the file has no ``output.weight``). Every metadata key
    the config reads must have its GGUF type (``general.architecture`` a STRING,
    ``general.alignment`` / ``<arch>.vocab_size`` / ``<arch>.embedding_length`` / token ids
    integers, the sizes positive, ``tokenizer.ggml.tokens`` an ARRAY of STRING, the other
    ``<arch>.*`` keys numbers), else a :class:`CheckpointError` names the file and the key; a key
    that appears twice is refused too. ``metadata`` holds
    the key/value pairs (arrays longer than :data:`MAX_KEPT_ARRAY` only by their length, in
    ``array_lengths``); ``header_bytes_read`` counts what the probe read (the header plus at
    most one :data:`READ_CHUNK` read-ahead).

    Args:
        path: the ``.gguf`` file: a non-empty ``str`` or ``os.PathLike`` naming a regular file (it is
            ``stat``-ed before it is opened, and opened non-blocking, so a FIFO never blocks).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = as_path(path, "GGUF checkpoint path", "a .gguf file", CheckpointError)
        size = _regular_file(self.path)
        self.directory = self.path.parent
        self.files: list[Path] = [self.path]
        self.hf_quant_config: dict[str, Any] | None = None
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        self.value_types: dict[str, tuple[int, int | None]] = {}  # key -> (GGUF value type, array item type)
        self._tensors: dict[str, GGUFTensorInfo] = {}  # by trtvocab name
        self._aliases: dict[str, str] = {}  # GGUF name -> trtvocab name, for renamed tensors
        self.version = 0
        self.data_offset = 0
        try:
            with open_regular(self.path, "checkpoint", CheckpointError, buffering=0) as fh:
                reader = _HeaderReader(fh, self.path, size)
                self._parse(reader)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read ({exc})") from exc
        self.header_bytes_read = reader.bytes_read
        self.config: dict[str, Any] = self._derive_config()

    # ---- header ------------------------------------------------------------------------------
    def _parse(self, r: _HeaderReader) -> None:
        path = self.path
        if r.size < 4 or r.take(4, "magic") != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (expected magic {MAGIC!r} in the first 4 bytes)")
        raw_version = r.take(4, "version")
        version = struct.unpack("<I", raw_version)[0]
        if version not in VERSIONS:
            if struct.unpack(">I", raw_version)[0] in VERSIONS:
                raise CheckpointError(f"{path}: big-endian GGUF is not supported (expected a little-endian file)")
            raise CheckpointError(f"{path}: unsupported GGUF version {version} (expected one of {list(VERSIONS)})")
        self.version = version
        n_tensors = r.unpack("<Q", "tensor count")
        n_kv = r.unpack("<Q", "metadata count")
        if n_tensors > _size_bound(r.size) or n_kv > _size_bound(r.size):
            raise CheckpointError(f"{path}: corrupt GGUF header: {n_tensors} tensors / {n_kv} metadata entries "
                                  f"cannot fit in {r.size} bytes")
        for i in range(n_kv):
            key = r.string(f"metadata key #{i}")
            if key in self.value_types:
                raise CheckpointError(f"{path}: metadata key {key!r} appears twice in the GGUF header")
            vtype = r.unpack("<I", f"type of metadata {key!r}")
            item_type = r.unpack("<I", f"metadata {key!r} item type") if vtype == _ARRAY else None
            self.value_types[key] = (vtype, item_type)
            if item_type is not None:
                count, items = r.array(item_type, f"metadata {key!r}")
                self.array_lengths[key] = count
                if items is not None:
                    self.metadata[key] = items
            else:
                self.metadata[key] = r.value(vtype, f"metadata {key!r}")
        self._typed("general.alignment", _INTS, "an integer (UINT32)")
        alignment = self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
        records = []
        for i in range(n_tensors):
            name = r.string(f"tensor #{i} name")
            n_dims = r.unpack("<I", f"tensor {name!r} dim count")
            if n_dims > MAX_DIMS:
                raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dims (GGUF allows {MAX_DIMS})")
            dims = [r.unpack("<Q", f"tensor {name!r} dims") for _ in range(n_dims)]
            type_id = r.unpack("<I", f"tensor {name!r} type")
            offset = r.unpack("<Q", f"tensor {name!r} offset")
            records.append((name, dims, type_id, offset))
        data_start = -(-r.tell() // alignment) * alignment
        self.data_offset = data_start
        for name, dims, type_id, offset in records:
            self._add_tensor(name, dims, _ggml_type(path, name, type_id), data_start, offset, alignment, r.size)
        self._check_data_section(data_start, alignment, r.size)

    def _check_data_section(self, data_start: int, alignment: int, file_size: int) -> None:
        """The tensors tile the data section as llama.cpp writes (and requires) it.

        Every tensor's bytes lie inside ``[data_start, file size)`` and start aligned (checked
        per tensor in :meth:`_add_tensor`); here, over all tensors in offset order: no two byte
        ranges overlap; each tensor starts where the previous one ends, padded to
        ``general.alignment`` (the first at offset 0), so no byte of the section is unowned; and
        the file ends with the last tensor's data (plus at most its alignment padding). A file
        whose offsets were moved, shared or shifted inside the data is refused, naming the
        tensors, instead of reading another tensor's bytes as the head.
        """
        spans = sorted((info.offset, info.offset + info.nbytes, info.gguf_name) for info in self._tensors.values())
        path = self.path

        def rel(at: int) -> int:
            return at - data_start

        for (b0, e0, n0), (b1, e1, n1) in itertools.pairwise(spans):
            if b1 < e0:
                raise CheckpointError(
                    f"{path}: GGUF tensor data overlap: {n0!r} occupies [{rel(b0)}, {rel(e0)}) and {n1!r} "
                    f"[{rel(b1)}, {rel(e1)}) of the data section (offsets relative to byte {data_start}); "
                    "every tensor must have bytes of its own")
        expected, previous = data_start, None
        for begin, end, name in spans:
            if begin != expected:
                after = f"the end of {previous!r}, padded to {alignment}" if previous else "the start of the section"
                raise CheckpointError(
                    f"{path}: GGUF tensor {name!r} data starts at offset {rel(begin)} of the data section; "
                    f"expected {rel(expected)} ({after}): the data section must hold the tensors back to back "
                    "(as llama.cpp writes and requires it), with no unowned bytes")
            expected, previous = -(-end // alignment) * alignment, name
        if spans and file_size > expected:
            last_end = spans[-1][1]
            raise CheckpointError(
                f"{path}: GGUF data section size does not match the file: the tensors end at byte {last_end} "
                f"(padded: {expected}), but the file has {file_size} bytes ({file_size - last_end} after the "
                "last tensor's data)")

    def _add_tensor(self, name: str, dims: list[int], qtype: gguf.GGMLQuantizationType, data_start: int,
                    offset: int, alignment: int, file_size: int) -> None:
        path = self.path
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))  # GGUF lists ne[0] (the fastest, hidden) first
        if shape and shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {name!r} of type {qtype.name} has {shape[-1]} values per row, "
                                  f"not a multiple of its block size {block}")
        count = 1
        for d in shape[:-1]:
            count *= d
        nbytes = count * ((shape[-1] // block) * type_size if shape else type_size)
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} data offset {offset} is not aligned to {alignment}")
        begin = data_start + offset
        if begin + nbytes > file_size:
            raise CheckpointError(f"{path}: tensor {name!r} data [{begin}, {begin + nbytes}) lies past the end "
                                  f"of the file ({file_size} bytes): truncated GGUF?")
        public = HF_NAMES.get(name, name)
        if public in self._tensors or name in self._aliases:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the GGUF header")
        tag = NATIVE_TYPES.get(qtype, DEQUANTIZED)[0]
        self._tensors[public] = GGUFTensorInfo(public, tag, shape, path, begin, nbytes, name, qtype)
        if public != name:
            self._aliases[name] = public

    def _typed(self, key: str, allowed: frozenset[int], expected: str, items: frozenset[int] = frozenset()) -> bool:
        """Whether the metadata holds ``key``; a value whose GGUF type is not in ``allowed`` (an
        ARRAY in ``allowed``: whose items' type is not in ``items``) raises, naming the key."""
        types = self.value_types.get(key)
        if types is None:
            return False
        vtype, item_type = types
        if vtype not in allowed or (vtype == _ARRAY and item_type not in items):
            got = _T(vtype).name + (f" of {_T(item_type).name}" if item_type is not None else "")
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} must be {expected}, got {got}")
        return True

    def _size_key(self, key: str) -> int | None:
        """A positive integer of the metadata (None when absent)."""
        if not self._typed(key, _INTS, "an integer (UINT32 / UINT64)"):
            return None
        value = self.metadata[key]
        if value <= 0:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} must be positive, got {value}")
        return int(value)

    def _derive_config(self) -> dict[str, Any]:
        """config.json's keys from the metadata; every key read is type-checked first."""
        meta = self.metadata
        arch = meta["general.architecture"] if self._typed("general.architecture", frozenset({_STRING}),
                                                            "a STRING") else ""
        has_tokens = self._typed("tokenizer.ggml.tokens", frozenset({_ARRAY}), "an ARRAY of STRING",
                                 frozenset({_STRING}))
        vocab_key, hidden = self._size_key(f"{arch}.vocab_size"), self._size_key(f"{arch}.embedding_length")
        for key in _ARCH_CONFIG:
            self._typed(f"{arch}.{key}", _NUMBERS | {_ARRAY}, "a number (or an ARRAY of numbers)", _NUMBERS)
        for key in _TOKEN_CONFIG:
            self._typed(f"tokenizer.ggml.{key}", _INTS, "an integer (a token id)")
        embed = self._tensors.get(HF_EMBEDDING) or self._tensors.get(HF_LM_HEAD)
        config: dict[str, Any] = {"model_type": arch} if arch else {}
        vocab = self.array_lengths["tokenizer.ggml.tokens"] if has_tokens else vocab_key
        if vocab is None and embed is not None and len(embed.shape) == 2:
            vocab = embed.shape[0]
        if hidden is None and embed is not None and len(embed.shape) == 2:
            hidden = embed.shape[1]
        if vocab is not None:
            config["vocab_size"] = vocab
        if hidden is not None:
            config["hidden_size"] = hidden
        config["tie_word_embeddings"] = HF_LM_HEAD not in self._tensors
        for key, hf_key in _ARCH_CONFIG.items():
            if f"{arch}.{key}" in meta:
                config[hf_key] = meta[f"{arch}.{key}"]
        for key, hf_key in _TOKEN_CONFIG.items():
            if f"tokenizer.ggml.{key}" in meta:
                config[hf_key] = meta[f"tokenizer.ggml.{key}"]
        return config

    # ---- header-only probes ----------------------------------------------------------------
    def _canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def names(self) -> list[str]:
        """Every tensor, by the name trtvocab uses (HF names for the head and the embedding)."""
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        """Whether the file holds ``name`` (an HF name or a GGUF one)."""
        return self._canonical(name) in self._tensors

    def info(self, name: str) -> GGUFTensorInfo:
        """Shape (torch order), read dtype and byte range of ``name``; refuses types nothing can read."""
        try:
            info = self._tensors[self._canonical(name)]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path}: no tensor {name!r}") from None
        if not info.native and not dequantizable(info.ggml_type):
            raise CheckpointError(f"{self.path}: tensor {info.gguf_name!r} has GGML type {info.ggml_type.name}, "
                                  "which gguf.quants cannot dequantize (expected F32/F16/BF16 or a "
                                  "dequantizable block type such as Q4_0, Q8_0, Q4_K, Q6_K)")
        return info

    def config_value(self, key: str, default: Any = None) -> Any:
        """``key`` of the config derived from the GGUF metadata."""
        return self.config.get(key, default)

    def config_int(self, key: str) -> int | None:
        value = self.config_value(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    def config_source(self, key: str) -> str:
        """Where ``config[key]`` came from, for messages: the file and the metadata key (a GGUF file has no
        config.json)."""
        arch = self.config.get("model_type", "")
        if key == "vocab_size" and "tokenizer.ggml.tokens" in self.array_lengths:
            return f"{self.path}: its token list (tokenizer.ggml.tokens) length"
        meta = {"vocab_size": f"{arch}.vocab_size", "hidden_size": f"{arch}.embedding_length"}.get(key)
        if meta is not None and meta in self.metadata:
            return f"{self.path}: metadata {meta}"
        return f"{self.path}: the embedding's shape" if meta is not None else f"{self.path}: {key}"

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config["tie_word_embeddings"])

    def lm_head_name(self, tensor_name: str | None = None) -> tuple[str, bool]:
        """``(name, tied)`` of the tensor that holds the head's ``[V, H]`` matrix (HF names)."""
        if tensor_name is not None:
            name = self.info(tensor_name).name
            return name, names_tied_head(name)
        if HF_LM_HEAD in self._tensors:
            return HF_LM_HEAD, False
        if HF_EMBEDDING in self._tensors:
            return HF_EMBEDDING, True
        raise CheckpointError(f"checkpoint {self.path}: no output.weight ({HF_LM_HEAD!r}) and no "
                              f"token_embd.weight ({HF_EMBEDDING!r}); pass tensor_name= to name it")

    # ---- data --------------------------------------------------------------------------------
    def get_slice(self, name: str) -> GGUFRows:
        """A lazy slice: ``get_slice(n)[a:b]`` reads only rows a..b (dequantized to float32 if quantized)."""
        return GGUFRows(self.info(name))

    def read(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


class GGUFRows(RowReader):
    """A GGUF tensor that reads only the rows it is indexed with.

    ``GGUFRows[a:b]`` reads the stored bytes of rows ``a..b`` (one contiguous range: quant
    blocks run along the fastest dim) with one positioned read into a fresh buffer, then
    dequantizes them with ``gguf.quants.dequantize`` into a fresh float32 tensor. Native
    F32 / F16 / BF16 rows are read straight into the returned tensor.

    Args:
        info: the tensor's header record.
    """

    info: GGUFTensorInfo

    def __getitem__(self, index: Any) -> torch.Tensor:  # a row slice, or ... for all
        shape = self.info.shape
        if len(shape) <= 1:  # a 0-d or 1-d tensor is one line of blocks: read it whole
            start, stop = self.row_range(index)
            whole = self._read_lines(0, 1).reshape(shape)
            return whole if not shape else whole[start:stop].clone()
        start, stop = self.row_range(index)
        lines_per_row = self.info.row_bytes // self.info.line_bytes
        out = self._read_lines(start * lines_per_row, stop * lines_per_row)
        return out.reshape(stop - start, *shape[1:])

    def raw_rows(self, start: int, stop: int) -> torch.Tensor:
        """The stored bytes of rows ``start..stop`` as uint8 ``[rows, row_bytes]``: one positioned
        read, no dequantization (what a head kept in its GGUF blocks holds)."""
        info = self.info
        if len(info.shape) != 2 or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(f"{info.file}: {info.gguf_name}: rows [{start}, {stop}) of {list(info.shape)}")
        row_bytes = info.row_bytes
        out = torch.empty((stop - start, row_bytes), dtype=torch.uint8)
        if stop > start:
            offset = info.offset + start * row_bytes
            size = _regular_file(info.file)
            if offset + out.numel() > size:
                raise CheckpointError(f"{info.file}: {info.gguf_name} is truncated (wanted {out.numel()} "
                                      f"bytes at offset {offset}, the file holds {size})")
            self._pread(offset, out.reshape(-1).numpy())
        return out

    def _read_lines(self, first: int, end: int) -> torch.Tensor:
        """Lines ``first..end`` (runs of the fastest dim) as a ``[lines, shape[-1]]`` tensor."""
        info = self.info
        width = info.shape[-1] if info.shape else 1
        lines, line_bytes = end - first, info.line_bytes
        offset = info.offset + first * line_bytes
        if lines:  # before allocating: the file (checked at open) may have shrunk or been swapped since
            size = _regular_file(info.file)
            if offset + lines * line_bytes > size:
                raise CheckpointError(f"{info.file}: {info.gguf_name} is truncated (wanted {lines * line_bytes} "
                                      f"bytes at offset {offset}, the file holds {size})")
        out = torch.empty((lines, width), dtype=info.torch_dtype)
        if not lines:
            return out
        if info.native:
            self._pread(offset, out.view(torch.uint8).reshape(-1).numpy())
            return out
        raw = np.empty((lines, line_bytes), dtype=np.uint8)
        self._pread(offset, raw.reshape(-1))
        dest = out.numpy()
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * width))
        for a in range(0, lines, step):
            b = min(lines, a + step)
            dest[a:b] = gguf.quants.dequantize(raw[a:b], info.ggml_type).reshape(b - a, width)
        return out

    def _pread(self, offset: int, buf: np.ndarray) -> None:
        want = buf.nbytes
        view = memoryview(buf).cast("B")
        try:
            with open_regular(self.info.file, "checkpoint", CheckpointError, buffering=0) as fh:
                got = read_span(fh, offset, view)
        except OSError as exc:
            raise CheckpointError(f"{self.info.file}: cannot read {self.info.gguf_name} ({exc})") from exc
        if got != want:
            raise CheckpointError(f"{self.info.file}: {self.info.gguf_name} is truncated "
                                  f"(wanted {want} bytes at offset {offset}, got {got})")
