"""Real hidden states from a real model, offline: the input side of examples, the main job and compare.

``text_hidden_states(model, texts)`` runs the transformer body of an HF model folder or a
llama.cpp ``.gguf`` (transformers, no hub access) over some texts and returns the packed
hidden states ``[T, H]`` with ``seq_lens [B]``, the way an engine hands them to the LM
head, and the text itself: ``input_ids [T]`` and, for a causal LM, ``next_token_ids [T]``
(the teacher-forced targets ``trtvocab compare`` scores).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trtvocab.base.safe_read import open_regular
from trtvocab.checkpoints import hf_loader
from trtvocab.errors import InputError

DEFAULT_TEXTS = [
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Quantization trades a little accuracy for a lot of memory bandwidth.",
    "She sold sea shells by the sea shore on a sunny Sunday morning.",
]


class TextHidden(NamedTuple):
    """Packed hidden states of some texts, as an engine hands them to the LM head, and the text itself: each
    row's token and the token after it."""

    states: torch.Tensor  # float32 [T, H]
    seq_lens: torch.Tensor  # int32 [B]
    last_tokens: list[str]
    input_ids: torch.Tensor  # int64 [T]: the token each row was computed at
    next_token_ids: torch.Tensor | None  # int64 [T]: the token after it, -1 at each sequence's last row;
    #                                      None for a model that does not predict the next token (an encoder)
    causal: bool


ProgressFn = Callable[[int, int], None]  # (documents done, documents total)


def load_text_model(model: str | Path) -> tuple[Any, Any, bool]:
    """``(tokenizer, model, causal)`` of an HF model folder or a llama.cpp ``.gguf`` file, offline.

    A causal LM (a ``.gguf``, or a folder whose ``config.json`` names a ``*ForCausalLM``
    architecture) loads with its head (``AutoModelForCausalLM``); anything else as
    ``AutoModel``. Weights come from safetensors or GGUF only, never from a pickle
    (:mod:`trtvocab.checkpoints.hf_loader`, the loader ``generate`` uses too).
    """
    causal = hf_loader.is_causal(model)
    tok, net = hf_loader.load(model, causal=causal)
    return tok, net, causal


def _windows(ids: list[int], max_len: int | None) -> list[list[int]]:
    if not max_len or len(ids) <= max_len:
        return [ids]
    return [ids[i:i + max_len] for i in range(0, len(ids), max_len)]


def text_hidden_states(
    model: str | Path,
    texts: list[str],
    *,
    layer: int = -1,
    max_tokens: int | None = None,
    max_len: int | None = None,
    progress: ProgressFn | None = None,
) -> TextHidden:
    """Hidden states of ``texts`` (one document each) with their token ids, packed.

    For a causal LM at ``layer=-1`` the rows are the states its LM head consumes (the
    decoder's ``last_hidden_state``, after the final norm), and ``next_token_ids`` is the
    token that follows each row in its text (-1 at a sequence's last row). A document
    longer than ``max_len`` tokens (default: the model's ``max_position_embeddings``) is
    split into consecutive sequences; ``max_tokens`` stops after that many rows in all,
    cutting the last sequence short. The one special token added is the BOS the tokenizer itself puts
    first (Gemma's, as llama.cpp's perplexity does; none for SmolLM2, no [CLS] / [SEP] for MiniLM).
    """
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise InputError("texts: need at least one non-empty text")
    for option, value in (("max_tokens", max_tokens), ("max_len", max_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"`{option}`: must be a positive integer, got {value!r}")
    tok, net, causal = load_text_model(model)
    body = net.base_model if causal else net
    if max_len is None:
        limit = getattr(net.config, "max_position_embeddings", None)
        max_len = int(limit) if isinstance(limit, int) and limit > 0 else None
    rows, lens, last, ids_out = [], [], [], []
    total = 0
    with torch.no_grad():
        for d, text in enumerate(texts):
            ids = tok(text, add_special_tokens=False).input_ids
            bos = getattr(tok, "bos_token_id", None)
            if bos is not None and tok(text).input_ids[:1] == [bos] and ids[:1] != [bos]:
                ids = [bos, *ids]  # a model trained with a BOS (Gemma) is off-distribution without it
            for window in _windows(list(ids), max_len):
                if max_tokens is not None:
                    window = window[:max_tokens - total]
                if not window:
                    break
                input_ids = torch.tensor([window], dtype=torch.int64)
                out = body(input_ids=input_ids, output_hidden_states=layer != -1 or not causal)
                if layer == -1 and causal:
                    states = out.last_hidden_state
                else:
                    hs = out.hidden_states
                    if not -len(hs) <= layer < len(hs):
                        raise InputError(f"layer: the model has hidden states 0..{len(hs) - 1}, got {layer}")
                    states = hs[layer]
                rows.append(states[0].float())
                lens.append(len(window))
                ids_out.append(input_ids[0])
                last.append(token_text(tok, window[-1]))
                total += len(window)
            if progress is not None:
                progress(d + 1, len(texts))
            if max_tokens is not None and total >= max_tokens:
                break
    if not rows:
        raise InputError("texts: no tokens (every text tokenized to nothing)")
    input_ids = torch.cat(ids_out)
    next_ids = None
    if causal:
        next_ids = torch.cat([torch.cat([seq[1:], torch.tensor([-1])]) for seq in ids_out])
    return TextHidden(torch.cat(rows), torch.tensor(lens, dtype=torch.int32), last, input_ids, next_ids, causal)


def read_text_file(path: str | Path) -> list[str]:
    """Documents of a UTF-8 text file, one per non-empty line (a regular file only)."""
    with open_regular(path, "text file", InputError) as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    docs = [line.strip() for line in text.splitlines() if line.strip()]
    if not docs:
        raise InputError(f"{path}: holds no text (one document per line expected)")
    return docs


def token_text(tok: Any, token_id: int) -> str:
    """One token as a reader sees it: its decoded text (`` Paris``, not BPE's ``ĠParis``), quoted when it
    starts or ends with whitespace or is not printable (``' Paris'``, ``'\\n'``)."""
    text = tok.decode([int(token_id)])
    return text if text and text == text.strip() and text.isprintable() else repr(text)


def decoder(checkpoint: str | Path | None) -> Any:
    """A token-id -> text function (:func:`token_text`) from the checkpoint's tokenizer: a model folder's, or a
    ``.gguf`` file's (converted once, then cached: :func:`trtvocab.checkpoints.hf_loader.gguf_tokenizer`); plain
    ids (``#7042``) when there is none."""
    if checkpoint is not None and (Path(checkpoint).is_dir() or hf_loader.is_gguf(checkpoint)):
        try:
            tok = hf_loader.load_tokenizer(checkpoint)
            return lambda i: token_text(tok, i)
        except Exception:  # no tokenizer files, no such file, or transformers missing: fall back to ids
            pass
    return lambda i: f"#{int(i)}"


__all__ = ["DEFAULT_TEXTS", "TextHidden", "decoder", "load_text_model",
           "read_text_file", "text_hidden_states", "token_text"]
