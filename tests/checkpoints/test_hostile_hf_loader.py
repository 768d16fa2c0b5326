"""Hostile HF folders and tokenizers (``trtvocab/checkpoints/hf_loader.py``): a folder without a tokenizer, or
with only pickle weights, is refused (nothing is unpickled); a GGUF's tokenizer is converted and cached
without running remote code or asking about it.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import model_config
from tests.hostile import H, V, assert_cli_error, cli


def test_cli_hidden_refuses_folders_without_tokenizer_or_with_only_pickles(tmp_path: Path) -> None:
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps(model_config(V, H)))
    save_file({"lm_head.weight": torch.randn(V, H)}, str(no_tok / "model.safetensors"))
    assert_cli_error(*cli("hidden", str(no_tok), "--out", str(tmp_path / "h.safetensors")), "CheckpointError",
                     str(no_tok), "has no tokenizer")
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text(json.dumps(model_config(V, H)))
    (pickles / "vocab.txt").write_text("[PAD]\nhello\n")
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")
    assert_cli_error(*cli("hidden", str(pickles), "--out", str(tmp_path / "h.safetensors")), "CheckpointError",
                     "only pickle weights (pytorch_model.bin)")
    assert not (tmp_path / "h.safetensors").exists()


def test_low_the_tokenizer_cache_never_asks_about_remote_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted ``auto_map`` made transformers print its y/N prompt on stdout: every load passes
    ``trust_remote_code=False`` (no prompt, no code)."""
    from trtvocab.checkpoints import hf_loader

    calls: list[dict] = []

    class Tok:
        @staticmethod
        def from_pretrained(where: str, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return types.SimpleNamespace(save_pretrained=lambda d: (Path(d) / "tokenizer_config.json").write_text("{}"))

    fake = types.SimpleNamespace(AutoTokenizer=Tok)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("TRTVOCAB_CACHE_DIR", str(tmp_path / "cache"))
    hf_loader.gguf_tokenizer(model, fake)  # converts
    hf_loader.gguf_tokenizer(model, fake)  # reads the cached entry
    assert len(calls) == 2 and all(c.get("trust_remote_code") is False for c in calls), calls
