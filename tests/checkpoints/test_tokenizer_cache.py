"""A GGUF's own tokenizer: converted by transformers once, cached by the file's sha256, and what ``infer`` prints
(`` Paris``, not ``#7042`` or BPE's ``ĠParis``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtvocab.base.safe_read import sha256_file
from trtvocab.checkpoints import hf_loader
from trtvocab.checkpoints.hidden_states import decoder, token_text


class _Tok:
    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def decode(self, ids: list[int]) -> str:
        return self.texts[ids[0]]


def test_token_text_is_readable_and_quoted_at_whitespace() -> None:
    tok = _Tok({1: "paris", 2: " Paris", 3: "\n", 4: "", 5: "##b"})
    assert [token_text(tok, i) for i in range(1, 6)] == ["paris", "' Paris'", "'\\n'", "''", "##b"]


def test_decoder_without_a_tokenizer_prints_ids(tmp_path: Path) -> None:
    assert decoder(None)(7042) == "#7042"
    assert decoder(tmp_path / "nothere.gguf")(7) == "#7"  # no such file: ids, not an error
    assert decoder(tmp_path)(7) == "#7"  # a folder without tokenizer files


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(hf_loader.CACHE_ENV_VAR, str(tmp_path / "c"))
    assert hf_loader.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(hf_loader.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert hf_loader.cache_dir() == tmp_path / "x" / "trtvocab"


@pytest.mark.model
def test_gguf_tokenizer_is_converted_once_and_cached(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(hf_loader.CACHE_ENV_VAR, str(tmp_path))
    transformers = hf_loader.quiet_transformers()
    conversions: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(where: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "gguf_file" in kwargs:
            conversions.append(kwargs["gguf_file"])
        return real(where, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    first = hf_loader.gguf_tokenizer(smollm2)
    entry = tmp_path / "tokenizers" / sha256_file(smollm2)
    assert conversions == [smollm2.name] and (entry / "tokenizer.json").is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no staging folder left behind
    again = hf_loader.gguf_tokenizer(smollm2)
    assert conversions == [smollm2.name], "the second load converted the GGUF again"
    texts = ["The capital of France is", "def f(x):\n    return x  # ünïcode 日本"]
    assert [again(t)["input_ids"] for t in texts] == [first(t)["input_ids"] for t in texts]
    assert again.chat_template == first.chat_template and len(again) == len(first)
    assert again.eos_token_id == first.eos_token_id

    (entry / "tokenizer_config.json").write_text("{not json")  # a damaged entry is converted again
    assert hf_loader.gguf_tokenizer(smollm2)("Paris")["input_ids"] == first("Paris")["input_ids"]
    assert len(conversions) == 2
    assert decoder(smollm2)(7042) == "' Paris'"
