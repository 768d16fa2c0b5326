"""The one parser of safetensors headers (checkpoints, artifact rank files, hidden-state files).

:func:`parse_header` reads ``8 + n`` bytes of a regular file and nothing else, and validates
what the format says before anything is allocated: an 8-byte little-endian length ``n`` with
``n <=`` :data:`MAX_HEADER_BYTES` and ``8 + n <=`` the file size; a UTF-8 JSON object (no
duplicate keys, ``__metadata__`` a string-to-string object); per tensor a known ``dtype``, a
``shape`` of at most :data:`MAX_DIMS` non-negative ints (no floats, no bools) and
``data_offsets`` ``[begin, end]`` whose span is ``prod(shape) * itemsize``; sorted, the spans
start at 0 and are contiguous, and the data region holds no byte after the last one (it may be
*shorter*: a truncated copy still answers header probes; readers check the size before reading).
Errors are of the caller's type, name the file and never quote its bytes.
:func:`read_safetensors_header` is the plain-dict view of the same parse.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtvocab.base.safe_read import ErrorType, as_path, open_regular, parse_json
from trtvocab.errors import ArtifactError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit on the JSON header (100 MB)
MAX_DIMS = 64  # dims per tensor shape: bounds the work a header entry can ask for
MAX_FILE_BYTES = 2**63 - 1  # no file (off_t) holds more: data offsets past it are nonsense
# every dtype tag the safetensors format defines -> bits per element (a span is validated for all of them)
ST_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "bool", int: "integer", float: "number",
               type(None): "null"}


def json_name(value: Any) -> str:
    """What JSON calls the type of a parsed ``value`` (for messages)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


def is_count(value: Any) -> bool:
    """A JSON integer >= 0 (bools are not integers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a header: its dtype tag, shape and ``[begin, end)`` in the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: the raw JSON entries (``__metadata__`` apart), the validated entries sorted
    by offset, the length field and the file's size when it was read."""

    path: Path
    tensors: dict[str, Any]
    metadata: dict[str, str] | None
    entries: list[HeaderEntry]
    length: int
    file_size: int

    @property
    def data_start(self) -> int:
        """Byte offset of the data region in the file."""
        return 8 + self.length

    @property
    def data_end(self) -> int:
        """Where the last tensor's data ends: the size the header declares for the whole file."""
        return self.data_start + (self.entries[-1].end if self.entries else 0)


def _entry(where: str, name: str, meta: Any, error: ErrorType) -> HeaderEntry:
    """One header entry, each field checked as the format requires."""
    where = f"{where}: tensor {name!r:.100}"
    if not isinstance(meta, dict):
        raise error(f"{where}: header entry is a JSON {json_name(meta)}, expected an object with "
                         "dtype, shape and data_offsets")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in meta]
    if missing:
        raise error(f"{where}: header entry lacks {'/'.join(missing)}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_DTYPE_BITS:
        raise error(f"{where}: dtype {dtype!r:.40} is not a safetensors dtype "
                         f"(expected one of {sorted(ST_DTYPE_BITS)})")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_count(d) for d in shape):
        raise error(f"{where}: shape must be a list of at most {MAX_DIMS} non-negative integers, "
                         f"got {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= MAX_FILE_BYTES):
        raise error(f"{where}: data_offsets must be [begin, end], integers with 0 <= begin <= end, "
                         f"got {offsets!r:.80}")
    count = 1
    for d in shape:
        count *= d
    bits = count * ST_DTYPE_BITS[dtype]
    begin, end = offsets
    if bits % 8 or end - begin != bits // 8:
        raise error(f"{where} spans {end - begin} bytes, but {dtype} {shape} needs "
                         f"{bits / 8 if bits % 8 else bits // 8}")
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def _entries(where: str, tensors: dict[str, Any], length: int, size: int, error: ErrorType) -> list[HeaderEntry]:
    """Every entry, validated together: sorted by offset, the spans start at 0, are contiguous and
    do not overlap; the data region holds no byte after the last one."""
    entries = sorted((_entry(where, name, meta, error) for name, meta in tensors.items()),
                     key=lambda e: (e.begin, e.end))
    at, last = 0, ("", 0, 0)  # the end so far; the tensor that reached it: (name, begin, end)
    for e in entries:
        if e.begin < at:
            raise error(f"{where}: tensor {e.name!r:.100} data [{e.begin}, {e.end}) overlaps tensor "
                             f"{last[0]!r:.100} [{last[1]}, {last[2]})")
        if e.begin > at:
            raise error(f"{where}: {e.begin - at} bytes at data offset {at} before tensor {e.name!r:.100} "
                             f"belong to no tensor (spans must be contiguous from offset 0)")
        at, last = e.end, (e.name, e.begin, e.end)
    data_size = size - 8 - length
    if data_size > at:
        raise error(f"{where}: {data_size - at} bytes after the last tensor's data belong to no tensor "
                         f"(the header accounts for {at} of the {data_size}-byte data region)")
    return entries


def parse_header(path: str | Path, what: str, error: ErrorType = ArtifactError) -> SafetensorsHeader:
    """The validated header of the safetensors file ``path`` (see the module docstring); ``error``
    names ``what`` and the path."""
    path = as_path(path, what, "a safetensors file", error)
    where = f"{what} {path}"
    with open_regular(path, what, error) as fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) != 8:
                raise error(f"{where}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or length > size - 8:  # never printed: it may be any file's bytes
                raise error(f"{where}: not a safetensors file (implausible header length)")
            raw = fh.read(length)
        except OSError as exc:
            raise error(f"{where}: cannot read ({exc.strerror or exc})") from None
    if len(raw) != length:
        raise error(f"{where}: truncated safetensors header (the file shrank while being read)")
    tensors = parse_json(raw, f"{where}: safetensors header", error, unique_keys=True)
    if not isinstance(tensors, dict):
        raise error(f"{where}: safetensors header is a JSON {json_name(tensors)}, expected an object")
    meta = tensors.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise error(f"{where}: safetensors __metadata__ must be an object of strings")
    return SafetensorsHeader(path, tensors, meta, _entries(where, tensors, length, size, error), length, size)


def read_safetensors_header(path: str | Path, what: str, error: ErrorType = ArtifactError) -> dict[str, Any]:
    """The header as a dict, ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``
    (``__metadata__`` only where the file has one), validated by :func:`parse_header`."""
    header = parse_header(path, what, error)
    out = dict(header.tensors)
    if header.metadata is not None:
        out["__metadata__"] = header.metadata
    return out
