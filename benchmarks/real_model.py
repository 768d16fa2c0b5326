"""The model file a benchmark runs: a real model's name as ``trtvocab models`` knows it, or a ``.gguf`` path."""

from __future__ import annotations

from pathlib import Path

from trtvocab.checkpoints.real_models import model_path
from trtvocab.errors import TrtVocabError


def model_file(name: str) -> Path:
    """``smollm2`` / ``gemma3`` (installed, Gemma 3 assembled) or a path to a ``.gguf``; exits naming
    the install command when the model is not there."""
    if name.endswith(".gguf"):
        return Path(name)
    try:
        return Path(model_path(name))
    except TrtVocabError as exc:
        raise SystemExit(f"{name}: {exc}") from exc
