"""Reading HF-style checkpoints without reading more than needed.

* :meth:`Checkpoint.info` answers name / shape / dtype questions from the safetensors
  *headers* only (:mod:`trtvocab.base.safetensors_header`); no tensor byte is read.
* :meth:`Checkpoint.get_slice` hands out lazy row readers, so a rank that indexes
  ``slice[start:end]`` reads only its own rows.
* Pickled checkpoints (``*.bin``, ``*.pt``) are refused: they would run code.
* :func:`open_checkpoint` is how every path is opened: a llama.cpp ``.gguf`` file becomes a
  :class:`~trtvocab.checkpoints.gguf.GGUFCheckpoint` (the same interface), anything else a
  :class:`Checkpoint`.

What a checkpoint may hold, and what is refused: the section "what a checkpoint may hold" below.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trtvocab.base.safe_read import as_path, file_kind, open_regular, parse_json, read_regular
from trtvocab.base.safetensors_header import is_count, json_name, parse_header
from trtvocab.checkpoints.lazy_rows import RowReader, read_span
from trtvocab.checkpoints.names import EMBEDDING_NAMES, HEAD_NAMES, LM_HEAD_NAME, find_embedding, names_tied_head
from trtvocab.errors import CheckpointError

if TYPE_CHECKING:
    from trtvocab.checkpoints.gguf import GGUFCheckpoint

INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
GGUF_SUFFIX = ".gguf"  # llama.cpp files: opened by trtvocab.checkpoints.gguf (any case of the suffix)

# safetensors dtype tags -> torch dtypes (the ones read here)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, hf_quant_config.json, the index


# ---- what a checkpoint may hold (anything else is a CheckpointError naming the file) ------------------------
# * The path is a non-empty ``str`` or ``os.PathLike`` (``None``, an int, which ``open`` would
#   take as a file descriptor, or bytes are refused). Only regular files are opened
#   (:func:`trtvocab.base.safe_read.open_regular`), so a FIFO, a device or a socket never blocks a reader.
# * A safetensors file is what the format says (:mod:`trtvocab.base.safetensors_header`), checked
#   before anything is allocated. A data region *shorter* than the header declares (a truncated
#   copy) still answers header probes, but no tensor of that file is read: ``get_slice`` and every
#   read check the file's size against the header first (a tiny file claiming 32 GiB is an
#   error, not a 32 GiB buffer).
# * ``model.safetensors.index.json`` is an object whose ``weight_map`` maps tensor names to
#   *plain file names*: a non-empty string ending in ``.safetensors`` with no ``/`` or ``\``,
#   not ``.``/``..``, no NUL. The shard is that name inside the checkpoint folder; the entry
#   there may be a symlink (an HF cache snapshot links its files to ``../../blobs/<sha>``),
#   whose target must be a regular file. Every listed tensor is in the file the index names,
#   and no tensor is in two shard files (with or without an index).
# * ``config.json`` (and ``text_config`` inside it) hold ``tie_word_embeddings`` as a JSON bool
#   (absent: true, transformers' default), ``vocab_size`` / ``hidden_size`` as positive ints
#   (absent or null: not stated), ``text_config`` / ``quantization_config`` as objects (or null).
# * Error messages never quote bytes of a file that did not parse as a safetensors header
#   (e.g. a header length that does not fit the file is "implausible", not a number).


def checkpoint_path(path: Any) -> Path:
    """``path`` as a :class:`Path` (see :func:`trtvocab.base.safe_read.as_path`), else a CheckpointError."""
    return as_path(path, "checkpoint path", "a file or folder", CheckpointError)


def _stat(path: Path, what: str) -> os.stat_result:
    """``os.stat`` (symlinks followed) of ``path``; errors name ``what`` and the path."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path}: no such file or directory") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what} {path}: cannot stat ({getattr(exc, 'strerror', None) or exc})") from None


def _regular_size(path: Path, what: str) -> int:
    """The size of ``path``, which must be a regular file (checked before anything opens it)."""
    st = _stat(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what} {path}: is {file_kind(st.st_mode)}, expected a regular file")
    return st.st_size


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header: where its bytes are, and what they hold (no data read).

    ``file_bytes`` is the size the file's header declares for the whole file (``8 + n +``
    the end of the last span); a read refuses a file of any other size before it allocates.
    """

    name: str
    dtype: str  # safetensors tag, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset of the tensor's data in ``file``
    nbytes: int
    file_bytes: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return ST_DTYPES[self.dtype]
        except KeyError:
            raise CheckpointError(f"{self.file}: tensor {self.name} has unsupported dtype {self.dtype}") from None


class LazyRows(RowReader):
    """A safetensors tensor that reads only the rows it is indexed with.

    ``LazyRows[a:b]`` reads exactly rows ``a..b`` with one positioned read into a
    fresh tensor: no mmap, so a rank's resident memory grows by its shard only. Before
    anything is allocated, the file must still be a regular file of the size its header
    declares (a truncated copy is refused here, naming the file).
    """

    info: TensorInfo

    def __getitem__(self, index: Any) -> torch.Tensor:  # a row slice, or ... for all
        if not self.info.shape:
            return self._read(0, 1).reshape(())
        return self._read(*self.row_range(index))

    def check_file(self) -> None:
        """Raise unless the file is still a regular file of the size its header declares (one ``stat``)."""
        info = self.info
        size = _regular_size(info.file, "safetensors file")
        if info.file_bytes is None or size == info.file_bytes:
            return
        if size < info.file_bytes:
            raise CheckpointError(f"{info.file}: {info.name} is truncated (the header declares a "
                                  f"{info.file_bytes}-byte file, it holds {size} bytes)")
        raise CheckpointError(f"{info.file}: changed since it was opened (it holds {size} bytes, its header "
                              f"declares {info.file_bytes}); open the checkpoint again")

    def _read(self, start: int, stop: int) -> torch.Tensor:
        dtype = self.info.torch_dtype
        self.check_file()  # before allocating: a header's claim is bounded by the file
        row_elems = 1
        for d in self.info.shape[1:]:
            row_elems *= d
        rows = stop - start
        out = torch.empty((rows, *self.info.shape[1:]), dtype=dtype)
        itemsize = out.element_size()
        want = rows * row_elems * itemsize
        if want:
            view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
            try:
                with open_regular(self.info.file, "safetensors file", CheckpointError) as fh:
                    got = read_span(fh, self.info.offset + start * row_elems * itemsize, view)
            except OSError as exc:
                raise CheckpointError(f"{self.info.file}: cannot read {self.info.name} "
                                      f"({exc.strerror or exc})") from None
            if got != want:
                raise CheckpointError(f"{self.info.file}: {self.info.name} is truncated "
                                      f"(wanted {want} bytes at row {start}, got {got})")
        return out


# ---- JSON ----------------------------------------------------------------------------------------------
def _parse_json(raw: bytes, where: str, *, unique_keys: bool = False) -> Any:
    return parse_json(raw, where, CheckpointError, unique_keys=unique_keys)


def _load_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a checkpoint folder: regular, at most MAX_JSON_BYTES, UTF-8."""
    try:
        raw = read_regular(path, "checkpoint file", max_bytes=MAX_JSON_BYTES, error=CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    data = _parse_json(raw, str(path))
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a JSON {json_name(data)}")
    return data


def _optional_json(path: Path) -> dict[str, Any] | None:
    """``_load_json(path)``, or None when nothing (not even a dangling symlink) is there."""
    return _load_json(path) if os.path.lexists(path) else None


def _checked_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the keys trtvocab reads type-checked (bools are not ints, strings are not bools)."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{path}: text_config must be a JSON object, got a JSON {json_name(text)} "
                              f"{text!r:.80}")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise CheckpointError(f"{path}: quantization_config must be a JSON object, got a JSON {json_name(quant)} "
                              f"{quant!r:.80}")
    for prefix, section in (("", config), ("text_config.", text or {})):
        if "tie_word_embeddings" in section and not isinstance(section["tie_word_embeddings"], bool):
            value = section["tie_word_embeddings"]
            raise CheckpointError(f"{path}: {prefix}tie_word_embeddings must be true or false (a JSON bool; "
                                  f"absent means true), got a JSON {json_name(value)} {value!r:.80}")
        for key in ("vocab_size", "hidden_size"):
            value = section.get(key)
            if value is not None and not (is_count(value) and value > 0):
                raise CheckpointError(f"{path}: {prefix}{key} must be a positive integer, got a JSON "
                                      f"{json_name(value)} {value!r:.80}")
    return config


# ---- safetensors headers (parsed by trtvocab.base.safetensors_header) -------------------------------------
def _tensor_infos(path: Path) -> list[TensorInfo]:
    """Every tensor of a safetensors file, from its validated header (8 + n bytes read, nothing else).

    A data region shorter than the header declares (a truncated copy) is reported when rows are
    read (LazyRows, before allocating), not here: probes work from the header alone."""
    header = parse_header(path, "safetensors file", CheckpointError)
    return [TensorInfo(e.name, e.dtype, e.shape, path, header.data_start + e.begin, e.end - e.begin, header.data_end)
            for e in header.entries]


def _shard_name(index: Path, tensor: str, name: Any) -> str:
    """A ``weight_map`` value: a plain ``.safetensors`` file name (it names a file inside the folder)."""
    if not isinstance(name, str):
        raise CheckpointError(f"{index}: weight_map[{tensor!r:.100}] must be a shard file name (a string), "
                              f"got a JSON {json_name(name)} {name!r:.80}")
    if (name in (".", "..") or not name.endswith(SAFETENSORS_SUFFIX) or "/" in name or "\\" in name
            or "\0" in name):
        raise CheckpointError(f"{index}: weight_map[{tensor!r:.100}] = {name!r:.200} is not a plain "
                              f"{SAFETENSORS_SUFFIX} file name in the checkpoint folder (no path separators, "
                              "no '..', no absolute path)")
    return name


class Checkpoint:
    """An HF directory (config.json, optional hf_quant_config.json, safetensors with or
    without an index) or a single ``.safetensors`` file; what each may hold: the module's
    section "what a checkpoint may hold"."""

    def __init__(self, path: str | Path) -> None:
        self.path = checkpoint_path(path)
        mode = _stat(self.path, "checkpoint").st_mode
        self.config: dict[str, Any] = {}
        self.hf_quant_config: dict[str, Any] | None = None
        weight_map: dict[str, str] = {}
        index = self.path / INDEX_NAME
        if stat.S_ISREG(mode):
            if self.path.suffix != SAFETENSORS_SUFFIX:
                raise CheckpointError(
                    f"checkpoint {self.path}: only .safetensors files are read (pickles are never loaded)"
                )
            self.directory = self.path.parent
            files = [self.path]
        elif stat.S_ISDIR(mode):
            self.directory = self.path
            config = _optional_json(self.path / "config.json")
            if config is not None:
                self.config = _checked_config(self.path / "config.json", config)
            self.hf_quant_config = _optional_json(self.path / "hf_quant_config.json")
            if os.path.lexists(index):
                raw_map = _load_json(index).get("weight_map")
                if not isinstance(raw_map, dict):
                    raise CheckpointError(f"{index}: no 'weight_map' object")
                weight_map = {tensor: _shard_name(index, tensor, name) for tensor, name in raw_map.items()}
                files = sorted({self.path / name for name in weight_map.values()})
                missing = [str(f) for f in files if not f.exists()]
                if missing:
                    raise CheckpointError(f"{index}: names shard files that do not exist: {missing}")
            else:
                files = sorted(self.path.glob("*" + SAFETENSORS_SUFFIX))
            if not files:
                pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in self.path.glob(pattern))
                hint = f" (found pickles {pickles}, which are never loaded)" if pickles else ""
                raise CheckpointError(f"checkpoint {self.path}: no .safetensors files{hint}")
        else:
            raise CheckpointError(f"checkpoint {self.path}: is {file_kind(mode)}, expected an HF folder or a "
                                  "regular .safetensors file")
        self.files: list[Path] = files
        self._infos: dict[str, TensorInfo] = {}
        for f in files:
            for info in _tensor_infos(f):
                if info.name in self._infos:
                    raise CheckpointError(f"checkpoint {self.path}: tensor {info.name!r:.100} is in two shard files, "
                                          f"{self._infos[info.name].file.name} and {f.name}")
                self._infos[info.name] = info
        for tensor, name in weight_map.items():
            held = self._infos.get(tensor)
            if held is None or held.file.name != name:
                where = f"in {held.file.name}" if held is not None else "in no shard file"
                raise CheckpointError(f"{index}: weight_map puts {tensor!r:.100} in {name}, but it is {where}")

    # ---- header-only probes ----------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._infos)

    def has(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except (KeyError, TypeError):
            raise CheckpointError(f"checkpoint {self.path}: no tensor {name!r}") from None

    def config_value(self, key: str, default: Any = None) -> Any:
        """``key`` of config.json, or of its ``text_config`` (multimodal models keep the LM's there)."""
        text = self.config.get("text_config")
        return self.config.get(key, (text if isinstance(text, dict) else {}).get(key, default))

    @property
    def tie_word_embeddings(self) -> bool:
        # transformers' PretrainedConfig defaults tie_word_embeddings to True; config.json's
        # value was checked to be a bool when it was read.
        return self.config_value("tie_word_embeddings", True) is not False

    def lm_head_name(self, tensor_name: str | None = None) -> tuple[str, bool]:
        """``(name, tied)`` of the tensor that holds the head's ``[V, H]`` matrix."""
        if tensor_name is not None:
            if not isinstance(tensor_name, str):
                raise CheckpointError(f"checkpoint {self.path}: tensor_name must be a string, "
                                      f"got {type(tensor_name).__name__} {tensor_name!r:.80}")
            self.info(tensor_name)
            return tensor_name, names_tied_head(tensor_name)
        # A stored head is the head whatever tie_word_embeddings says (a quantized one included:
        # it is never replaced by the tied embedding).
        for name in HEAD_NAMES:
            if self.has(name):
                return name, False
        if self.tie_word_embeddings:
            name = find_embedding(self)
            if name is not None and not name.endswith("_packed"):
                return name, True
        raise CheckpointError(
            f"checkpoint {self.path}: no {LM_HEAD_NAME!r}"
            + (f" and no tied embedding among {list(EMBEDDING_NAMES)}" if self.tie_word_embeddings
               else " and config.json says tie_word_embeddings=false")
            + "; pass tensor_name= to name it"
        )

    def config_int(self, key: str) -> int | None:
        value = self.config_value(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def config_source(self, key: str) -> str:
        """Where ``config_value(key)`` came from, for messages: ``config.json KEY`` (the folder's)."""
        return f"config.json {key}"

    # ---- data --------------------------------------------------------------------------------
    def get_slice(self, name: str) -> LazyRows:
        """A lazy slice: ``get_slice(n)[a:b]`` reads only rows a..b. Refuses at once (one ``stat``,
        nothing read or allocated) a file shorter or longer than its header declares, so a caller
        can check a tensor's bytes exist before it allocates anything for them."""
        lazy = LazyRows(self.info(name))
        lazy.check_file()
        return lazy

    def read(self, name: str) -> torch.Tensor:
        lazy = self.get_slice(name)
        return lazy[:]


def open_checkpoint(path: str | Path) -> Checkpoint | GGUFCheckpoint:
    """The checkpoint at ``path``: a ``.gguf`` file -> :class:`~trtvocab.checkpoints.gguf.GGUFCheckpoint`,
    anything else (an HF directory, even one named ``*.gguf``; a ``.safetensors`` file) -> :class:`Checkpoint`.
    ``path`` must be a non-empty ``str`` or ``os.PathLike`` (:func:`checkpoint_path`)."""
    path = checkpoint_path(path)
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        from trtvocab.checkpoints.gguf import GGUFCheckpoint

        return GGUFCheckpoint(path)
    return Checkpoint(path)
