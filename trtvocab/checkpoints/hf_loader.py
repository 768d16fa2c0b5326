"""The one way trtvocab loads a Hugging Face model through ``transformers`` (``hidden`` and ``generate``).

Offline (``local_files_only``, ``HF_HUB_OFFLINE``), and never from a pickle: a model folder
is checked before transformers looks at it (a ``config.json``, a tokenizer file, and
``*.safetensors`` weights -- a folder with only ``pytorch_model.bin`` / ``*.pt`` is refused,
since unpickling can run code), and it is loaded with ``use_safetensors=True`` so that
transformers cannot fall back to a pickle either. A ``.gguf`` file must be a regular file
with GGUF's magic. :func:`load_causal_lm` also refuses, by name, a model that is not a
causal LM (an encoder such as BERT / MiniLM has no next-token head to decode with).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trtvocab.base.safe_read import open_regular, sha256_file
from trtvocab.errors import CheckpointError, ConfigError, first_line

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
CONFIG_MAX_BYTES = 16 << 20  # a config.json larger than this is not read for its architectures


def quiet_transformers() -> Any:
    """``transformers``, offline, without progress bars or warnings (a :class:`ConfigError` when missing)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ConfigError(f"loading a model needs transformers (pip install 'trtvocab[generate]'): {exc}") from None
    transformers.utils.logging.disable_progress_bar()  # a weight-loading bar per call is noise in CLI output
    transformers.utils.logging.set_verbosity_error()
    return transformers


def check_model_dir(model_dir: str | Path) -> Path:
    """Refuse, before transformers looks at it, a model folder that cannot be loaded safely: not a
    folder, no ``config.json``, no tokenizer file, or weights only as pickles (``pytorch_model.bin``,
    ``*.pt``: loading a pickle can run code, so trtvocab never does)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model folder (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: has no config.json (expected a Hugging Face model directory)")
    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise CheckpointError(f"{path}: has no tokenizer (none of {', '.join(TOKENIZER_MARKERS)})")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in path.glob(pattern))
        found = f"only pickle weights ({', '.join(pickles)}), which" if pickles else "no weights; pickles"
        raise CheckpointError(f"{path}: has {found} trtvocab never loads; convert it to safetensors")
    return path


def check_gguf_file(path: str | Path) -> Path:
    """Refuse a ``.gguf`` path that is not a regular file with GGUF's magic, before transformers opens it."""
    path = Path(path)
    with open_regular(path, "GGUF model", CheckpointError) as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return path


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def model_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model folder as a dict (``{}`` when it is missing, unreadable or not an object)."""
    try:
        with open_regular(Path(path) / "config.json", "config.json", CheckpointError) as fh:
            raw = fh.read(CONFIG_MAX_BYTES + 1)
        config = json.loads(raw) if len(raw) <= CONFIG_MAX_BYTES else None
    except (CheckpointError, OSError, ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def architectures(path: str | Path) -> list[str]:
    """The architecture names a model folder's ``config.json`` lists (strings only)."""
    archs = model_config(path).get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def is_causal(path: str | Path) -> bool:
    """A ``.gguf`` (llama.cpp files are causal LMs), or a folder whose ``config.json`` names a
    ``*ForCausalLM`` architecture."""
    return is_gguf(path) or any(a.endswith("ForCausalLM") for a in architectures(path))


@contextlib.contextmanager
def quiet_load() -> Iterator[None]:
    """transformers' GGUF loader draws its own tqdm bar ("de-quantizing GGUF tensors") on stderr, which no
    transformers setting turns off: the load's stderr goes nowhere (its errors still raise)."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF path parses the whole file three times (config, tokenizer, weights: every
    metadata field, 49k-entry vocab arrays included) and builds gguf's tensor-name map once per
    tensor: about 25 s of a 35 s load of SmolLM2 here. During one load, one reader per file and one
    name map per (architecture, layers) serve every call; both are only read. Restored afterwards."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def load(path: str | Path, *, causal: bool, dtype: torch.dtype | None = None, label: str = "") -> tuple[Any, Any]:
    """``(tokenizer, model)`` of an HF model folder or a ``.gguf`` file, offline, never from a pickle.

    ``causal`` loads ``AutoModelForCausalLM`` (with its head), else ``AutoModel``; ``dtype`` is
    passed on when given. ``label`` prefixes messages (``"MODEL"``). Errors: :class:`CheckpointError`.
    """
    transformers = quiet_transformers()
    path = Path(path)
    prefix = f"{label} {path}" if label else str(path)
    if is_gguf(path):
        check_gguf_file(path)
        where, kwargs = str(path.parent), {"gguf_file": path.name}
    else:
        check_model_dir(path)
        where, kwargs = str(path), {"use_safetensors": True}
    with _gguf_parsed_once():
        return _load(transformers, path, where, kwargs, prefix, causal, dtype)


CACHE_ENV_VAR = "TRTVOCAB_CACHE_DIR"  # default: $XDG_CACHE_HOME/trtvocab, else ~/.cache/trtvocab


def cache_dir() -> Path:
    """trtvocab's cache folder (converted tokenizers): ``$TRTVOCAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtvocab``,
    else ``~/.cache/trtvocab``."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtvocab"


def gguf_tokenizer(path: str | Path, transformers: Any = None) -> Any:
    """The tokenizer of a ``.gguf`` file: transformers converts it once (seconds: the whole vocabulary and
    merges are read from the file's metadata), and the result is kept in ``cache_dir()/tokenizers/SHA256``
    (the file's sha256: another file, or the same name rewritten, is another entry), published by a rename
    so that a reader never sees half an entry. A cache that cannot be written or read is skipped."""
    transformers = transformers or quiet_transformers()
    path = Path(path)
    entry = cache_dir() / "tokenizers" / sha256_file(path, what="GGUF model", error=CheckpointError)
    if (entry / "tokenizer_config.json").is_file():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(entry), local_files_only=True,
                                                              trust_remote_code=False)
        except Exception:  # a damaged entry: convert again (the new entry replaces it below)
            pass
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                     trust_remote_code=False)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}.", dir=entry.parent))
    except OSError:
        return tok
    try:
        tok.save_pretrained(str(stage))
        if entry.exists():  # damaged (or written meanwhile by another process): ours replaces it
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(stage, entry)
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
    return tok


def load_tokenizer(path: str | Path, transformers: Any = None) -> Any:
    """The tokenizer of an HF model folder or a ``.gguf`` file (:func:`gguf_tokenizer`, cached), offline and
    without remote code; transformers' own exception when it has none."""
    transformers = transformers or quiet_transformers()
    with quiet_load():
        if is_gguf(path):
            return gguf_tokenizer(path, transformers)
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def _load(transformers: Any, path: Path, where: str, kwargs: dict[str, Any], prefix: str, causal: bool,
          dtype: torch.dtype | None) -> tuple[Any, Any]:
    try:
        tok = load_tokenizer(path, transformers)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        raise CheckpointError(f"{prefix}: cannot load its tokenizer ({type(exc).__name__}: {first_line(exc)})") \
            from None
    extra: dict[str, Any] = {}
    if dtype is not None:
        extra["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    try:
        cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
        with quiet_load():
            model = cls.from_pretrained(where, local_files_only=True, trust_remote_code=False, **kwargs,
                                        **extra).eval()
    except Exception as exc:
        what = "GGUF file" if is_gguf(path) else "safetensors weights"
        raise CheckpointError(f"{prefix}: cannot load the model{' as a causal LM' if causal else ''} from its "
                              f"{what} ({type(exc).__name__}: {first_line(exc)})") from None
    return tok, model


def load_causal_lm(path: str | Path, *, dtype: torch.dtype | None = None, label: str = "MODEL") -> tuple[Any, Any]:
    """:func:`load` of a causal LM; a folder whose ``config.json`` names no ``*ForCausalLM``
    architecture (an encoder: ``BertModel``, MiniLM) is refused by name before anything is loaded."""
    path = Path(path)
    if not is_gguf(path):
        check_model_dir(path)
        if not is_causal(path):
            archs = architectures(path)
            kind = model_config(path).get("model_type")
            named = f"names architectures {archs}" if archs else "names no architectures"
            raise CheckpointError(
                f"{label} {path}: its config.json {named}"
                f"{f' (model_type {kind!r})' if isinstance(kind, str) else ''}, not a causal LM "
                "(expected a decoder-only *ForCausalLM model; an encoder such as BERT or MiniLM has no "
                "next-token head)")
    return load(path, causal=True, dtype=dtype, label=label)


__all__ = ["CACHE_ENV_VAR", "PICKLE_PATTERNS", "TOKENIZER_MARKERS", "architectures", "cache_dir", "check_gguf_file",
           "check_model_dir", "gguf_tokenizer", "is_causal", "is_gguf", "load", "load_causal_lm", "load_tokenizer",
           "model_config", "quiet_load", "quiet_transformers"]
