"""Reading HF-style checkpoints without reading more than needed.

* :meth:`Checkpoint.info` answers name / shape / dtype questions from the
  safetensors *headers* only (8-byte length + JSON); no tensor byte is read.
* :meth:`Checkpoint.get_slice` hands out lazy row readers, so a rank
  that indexes ``slice[start:end]`` reads only its own rows.
* Pickled checkpoints (``*.bin``, ``*.pt``) are refused: they would run code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtvocab.errors import CheckpointError

LM_HEAD_NAME = "lm_head.weight"
EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "embeddings.word_embeddings.weight",
    "transformer.wte.weight",
    "bert.embeddings.word_embeddings.weight",
    "model.embeddings.word_embeddings.weight",
)
INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype tags -> torch dtypes
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
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header: where its bytes are, and what they hold (no data read)."""

    name: str
    dtype: str  # safetensors tag, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset of the tensor's data in ``file``
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return ST_DTYPES[self.dtype]
        except KeyError:
            raise CheckpointError(f"{self.file}: tensor {self.name} has unsupported dtype {self.dtype}") from None


class LazyRows:
    """A safetensors tensor that reads only the rows it is indexed with.

    ``LazyRows[a:b]`` reads exactly rows ``a..b`` with one positioned read into a
    fresh tensor: no mmap, so a rank's resident memory grows by its shard only.
    """

    def __init__(self, info: TensorInfo) -> None:
        self.info = info

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def get_dtype(self) -> str:
        return self.info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:  # a row slice, or ... for all
        shape = self.info.shape
        if not shape:
            return self._read(0, 1).reshape(())
        if index is Ellipsis:
            index = slice(None)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise CheckpointError(f"{self.info.name}: only contiguous row slices can be read lazily")
        start, stop, _ = index.indices(shape[0])
        return self._read(start, max(start, stop))

    def _read(self, start: int, stop: int) -> torch.Tensor:
        dtype = self.info.torch_dtype
        row_elems = 1
        for d in self.info.shape[1:]:
            row_elems *= d
        rows = stop - start
        out = torch.empty((rows, *self.info.shape[1:]), dtype=dtype)
        itemsize = out.element_size()
        want = rows * row_elems * itemsize
        if want:
            buf = out.view(torch.uint8).reshape(-1).numpy()
            with open(self.info.file, "rb") as fh:
                fh.seek(self.info.offset + start * row_elems * itemsize)
                got = fh.readinto(memoryview(buf))
            if got != want:
                raise CheckpointError(f"{self.info.file}: {self.info.name} is truncated "
                                      f"(wanted {want} bytes at row {start}, got {got})")
        return out


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: reads 8 + header-length bytes, nothing else."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header length {length} is implausible")
            raw = fh.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    if len(raw) != length:
        raise CheckpointError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: safetensors header is not JSON ({exc})") from exc
    header.pop("__metadata__", None)
    return header


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _tensor_info(file: Path, name: str, meta: Any, data_start: int) -> TensorInfo:
    """Validate one header entry: a corrupt header must not make a reader return another tensor's bytes."""
    try:
        dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file}: header entry {name!r} lacks dtype/shape/data_offsets") from None
    info = TensorInfo(name, dtype, shape, file, data_start + int(begin), int(end) - int(begin))
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty(0, dtype=info.torch_dtype).element_size()
    if info.nbytes != count * itemsize or begin < 0:
        raise CheckpointError(f"{file}: {name} spans {info.nbytes} bytes, but {dtype} {list(shape)} "
                              f"needs {count * itemsize}")
    # A truncated data region is reported when rows are read (LazyRows), not here: probing
    # must work from the header alone, whatever state the data is in.
    return info


class Checkpoint:
    """An HF directory (config.json, optional hf_quant_config.json, safetensors with or
    without an index) or a single ``.safetensors`` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path}: no such file or directory")
        self.config: dict[str, Any] = {}
        self.hf_quant_config: dict[str, Any] | None = None
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise CheckpointError(
                    f"checkpoint {self.path}: only .safetensors files are read (pickles are never loaded)"
                )
            self.directory = self.path.parent
            files = [self.path]
        else:
            self.directory = self.path
            if (self.path / "config.json").exists():
                self.config = _load_json(self.path / "config.json")
            if (self.path / "hf_quant_config.json").exists():
                self.hf_quant_config = _load_json(self.path / "hf_quant_config.json")
            index = self.path / INDEX_NAME
            if index.exists():
                weight_map = _load_json(index).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index}: no 'weight_map' object")
                files = sorted({self.path / f for f in weight_map.values()})
                missing = [str(f) for f in files if not f.exists()]
                if missing:
                    raise CheckpointError(f"{index}: names shard files that do not exist: {missing}")
            else:
                files = sorted(self.path.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in self.path.glob(pattern))
                hint = f" (found pickles {pickles}, which are never loaded)" if pickles else ""
                raise CheckpointError(f"checkpoint {self.path}: no .safetensors files{hint}")
        self.files: list[Path] = files
        self._infos: dict[str, TensorInfo] = {}
        for f in files:
            header = read_safetensors_header(f)
            data_start = 8 + self._header_len(f)
            for name, meta in header.items():
                self._infos[name] = _tensor_info(f, name, meta, data_start)

    @staticmethod
    def _header_len(path: Path) -> int:
        with open(path, "rb") as fh:
            return int(struct.unpack("<Q", fh.read(8))[0])

    # ---- header-only probes ----------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._infos)

    def has(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path}: no tensor {name!r}") from None

    def config_value(self, key: str, default: Any = None) -> Any:
        """``key`` of config.json, or of its ``text_config`` (multimodal models keep the LM's there)."""
        return self.config.get(key, self.config.get("text_config", {}).get(key, default))

    @property
    def tie_word_embeddings(self) -> bool:
        # transformers' PretrainedConfig defaults tie_word_embeddings to True.
        return bool(self.config_value("tie_word_embeddings", True))

    def lm_head_name(self, tensor_name: str | None = None) -> tuple[str, bool]:
        """``(name, tied)`` of the tensor that holds the head's ``[V, H]`` matrix."""
        if tensor_name is not None:
            self.info(tensor_name)
            return tensor_name, tensor_name != LM_HEAD_NAME and not tensor_name.endswith(LM_HEAD_NAME)
        if self.has(LM_HEAD_NAME):
            return LM_HEAD_NAME, False
        if self.tie_word_embeddings:
            for name in EMBEDDING_NAMES:
                if self.has(name):
                    return name, True
        raise CheckpointError(
            f"checkpoint {self.path}: no {LM_HEAD_NAME!r}"
            + (f" and no tied embedding among {list(EMBEDDING_NAMES)}" if self.tie_word_embeddings
               else " and config.json says tie_word_embeddings=false")
            + "; pass tensor_name= to name it"
        )

    def config_int(self, key: str) -> int | None:
        value = self.config_value(key)
        return int(value) if isinstance(value, int) else None

    # ---- data --------------------------------------------------------------------------------
    def get_slice(self, name: str) -> LazyRows:
        """A lazy slice: ``get_slice(n)[a:b]`` reads only rows a..b."""
        return LazyRows(self.info(name))

    def read(self, name: str) -> torch.Tensor:
        lazy = self.get_slice(name)
        return lazy[:]
