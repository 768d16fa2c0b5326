"""Real hidden states from a real model, offline: the input side of examples, the main job and compare.

``text_hidden_states(model, texts)`` runs the transformer body of an HF model folder or a
llama.cpp ``.gguf`` (transformers, no hub access) over some texts and returns the packed
hidden states ``[T, H]`` with ``seq_lens [B]``, the way an engine hands them to the LM
head, and the text itself: ``input_ids [T]`` and, for a causal LM, ``next_token_ids [T]``
(the teacher-forced targets ``trtvocab compare`` scores). ``hidden_states_from_text`` is
the older three-field form.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trtvocab.base.fsutil import atomic_write_bytes, open_regular
from trtvocab.base.inputs import check_hidden_states
from trtvocab.base.safetensors_header import read_safetensors_header
from trtvocab.commands import hf_loader
from trtvocab.errors import InputError

DEFAULT_TEXTS = [
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Quantization trades a little accuracy for a lot of memory bandwidth.",
    "She sold sea shells by the sea shore on a sunny Sunday morning.",
]


class HiddenStates(NamedTuple):
    """Packed hidden states of some texts, as an engine hands them to the LM head."""

    states: torch.Tensor  # float32 [T, H]
    seq_lens: torch.Tensor  # int32 [B]
    last_tokens: list[str]  # each text's last input token (for display)


class TextHidden(NamedTuple):
    """:class:`HiddenStates` plus the text itself: each row's token and the token after it."""

    states: torch.Tensor  # float32 [T, H]
    seq_lens: torch.Tensor  # int32 [B]
    last_tokens: list[str]
    input_ids: torch.Tensor  # int64 [T]: the token each row was computed at
    next_token_ids: torch.Tensor | None  # int64 [T]: the token after it, -1 at each sequence's last row;
    #                                      None for a model that does not predict the next token (an encoder)
    causal: bool


ProgressFn = Callable[[int, int], None]  # (documents done, documents total)


def hidden_states_from_text(model_dir: str | Path, texts: list[str], *, layer: int = -1) -> HiddenStates:
    """Packed hidden states ``[T, H]``, ``seq_lens [B]`` and last tokens of ``texts`` at ``layer``.

    No special tokens are added after the text (only the BOS a tokenizer such as Gemma's puts first), so each
    sequence's last row is its last real token.
    ``layer`` indexes ``output_hidden_states`` (0 = embeddings, -1 = final layer).
    """
    out = text_hidden_states(model_dir, texts, layer=layer)
    return HiddenStates(out.states, out.seq_lens, out.last_tokens)


def load_text_model(model: str | Path) -> tuple[Any, Any, bool]:
    """``(tokenizer, model, causal)`` of an HF model folder or a llama.cpp ``.gguf`` file, offline.

    A causal LM (a ``.gguf``, or a folder whose ``config.json`` names a ``*ForCausalLM``
    architecture) loads with its head (``AutoModelForCausalLM``); anything else as
    ``AutoModel``. Weights come from safetensors or GGUF only, never from a pickle
    (:mod:`trtvocab.commands.hf_loader`, the loader ``generate`` uses too).
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
    for option, value in (("--max-tokens", max_tokens), ("--max-len", max_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{option}: must be a positive integer, got {value!r}")
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


TOKENIZER_FILES = hf_loader.TOKENIZER_FILES
check_model_dir = hf_loader.check_model_dir
check_gguf_file = hf_loader.check_gguf_file


def token_text(tok: Any, token_id: int) -> str:
    """One token as a reader sees it: its decoded text (`` Paris``, not BPE's ``ĠParis``), quoted when it
    starts or ends with whitespace or is not printable (``' Paris'``, ``'\\n'``)."""
    text = tok.decode([int(token_id)])
    return text if text and text == text.strip() and text.isprintable() else repr(text)


def decoder(checkpoint: str | Path | None) -> Any:
    """A token-id -> text function (:func:`token_text`) from the checkpoint's tokenizer: a model folder's, or a
    ``.gguf`` file's (converted once, then cached: :func:`trtvocab.commands.hf_loader.gguf_tokenizer`); plain
    ids (``#7042``) when there is none."""
    if checkpoint is not None and (Path(checkpoint).is_dir() or hf_loader.is_gguf(checkpoint)):
        try:
            if Path(checkpoint).is_dir():
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
            else:
                with hf_loader.quiet_load():
                    tok = hf_loader.gguf_tokenizer(checkpoint)
            return lambda i: token_text(tok, i)
        except Exception:  # no tokenizer files, no such file, or transformers missing: fall back to ids
            pass
    return lambda i: f"#{int(i)}"


def save_hidden(path: str | Path, hidden: torch.Tensor, seq_lens: torch.Tensor | None,
                last_tokens: list[str] | None = None, *, input_ids: torch.Tensor | None = None,
                next_token_ids: torch.Tensor | None = None) -> None:
    """Write ``hidden_states`` (+ ``seq_lens``, ``input_ids``, ``next_token_ids`` as int64) atomically;
    ``last_tokens`` go to the metadata."""
    from safetensors.torch import save

    tensors = {"hidden_states": hidden.contiguous()}
    if seq_lens is not None:
        tensors["seq_lens"] = seq_lens.to(torch.int32).contiguous()
    for name, ids in (("input_ids", input_ids), ("next_token_ids", next_token_ids)):
        if ids is not None:
            tensors[name] = ids.to(torch.int64).reshape(-1).contiguous()
    meta = {"last_tokens": json.dumps(last_tokens)} if last_tokens else None
    atomic_write_bytes(Path(path), save(tensors, metadata=meta))


def load_last_tokens(path: str | Path) -> list[str] | None:
    """The last input token of each sequence, when the file records them (metadata
    ``last_tokens``: a JSON list of strings; anything else is an :class:`InputError`)."""
    meta = read_safetensors_header(path, "hidden states", InputError).get("__metadata__", {})
    raw = meta.get("last_tokens")
    if not raw:
        return None
    try:
        tokens = json.loads(raw)
    except (ValueError, RecursionError):
        raise InputError(f"{path}: metadata last_tokens is not JSON (expected a list of strings)") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise InputError(f"{path}: metadata last_tokens must be a JSON list of strings, got {type(tokens).__name__}")
    return tokens


class HiddenFile(NamedTuple):
    """Everything a hidden-states file holds (``None`` where the file has no such tensor)."""

    states: torch.Tensor
    seq_lens: torch.Tensor | None
    input_ids: torch.Tensor | None
    next_token_ids: torch.Tensor | None


def load_hidden(path: str | Path, *, finite: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden_states [T, H], seq_lens [B] or None)`` from a ``.safetensors`` file.

    Only a regular file is opened (a FIFO would block the reader forever); NaN / inf are
    refused naming the first bad row unless ``finite=False``; ``seq_lens`` must be a 1-D
    integer tensor (checked against T where it is used).
    """
    out = load_hidden_file(path, finite=finite)
    return out.states, out.seq_lens


def load_hidden_file(path: str | Path, *, finite: bool = True) -> HiddenFile:
    """:func:`load_hidden` plus ``input_ids`` / ``next_token_ids`` (1-D integers, one per row;
    token ids >= 0, next ids >= -1; upper bounds are the vocabulary's, checked where it is known).
    A file with both holds the teacher-forced relation (:func:`check_next_token_ids`)."""
    read_safetensors_header(path, "hidden states", InputError)  # a regular file, a header of the right shape
    try:
        with open_regular(path, "hidden states", InputError) as fh:
            from safetensors.torch import load

            data = load(fh.read())
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: cannot read hidden states "
                         f"({type(exc).__name__}: {hf_loader.first_line(exc)})") from None
    if "hidden_states" not in data:
        raise InputError(f"{path}: expected a tensor named 'hidden_states' [T, H], found {sorted(data)}")
    hidden = check_hidden_states(data["hidden_states"], what=f"{path}: hidden_states", finite=finite)
    lens = data.get("seq_lens")
    if lens is not None and (lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool):
        raise InputError(f"{path}: seq_lens must be a 1-D integer tensor [B], got {lens.dtype} {list(lens.shape)}")
    ids: dict[str, torch.Tensor | None] = {}
    for name, low in (("input_ids", 0), ("next_token_ids", -1)):
        t = data.get(name)
        if t is not None:
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise InputError(f"{path}: {name} must be a 1-D integer tensor [T], got {t.dtype} {list(t.shape)}")
            if t.shape[0] != hidden.shape[0]:
                raise InputError(f"{path}: {name} has {t.shape[0]} entries for {hidden.shape[0]} rows of hidden_states")
            t = t.to(torch.int64)
            if t.numel() and int(t.min()) < low:
                bad = int(torch.nonzero(t < low)[0, 0])
                raise InputError(f"{path}: {name}[{bad}] = {int(t[bad])}; ids must be >= {low}")
        ids[name] = t
    if ids["input_ids"] is not None and ids["next_token_ids"] is not None:
        check_next_token_ids(path, ids["input_ids"], ids["next_token_ids"], lens)
    return HiddenFile(hidden, lens, ids["input_ids"], ids["next_token_ids"])


def check_next_token_ids(path: str | Path, input_ids: torch.Tensor, next_ids: torch.Tensor,
                         seq_lens: torch.Tensor | None) -> None:
    """The teacher-forced relation of a hidden file: inside a sequence ``next_token_ids[t]`` is
    ``input_ids[t + 1]`` (or -1: a row without a target, not scored), and each sequence's last row is
    -1 (the token after it is not in the file; pointing at the next sequence's first id would score a
    target the row never preceded). ``seq_lens`` that do not tile the rows are left to the reader that
    uses them (which refuses them); no ``seq_lens`` is one sequence. :class:`InputError` naming the row."""
    total = int(input_ids.shape[0])
    if total == 0:
        return
    if seq_lens is None:
        lens = [total]
    else:
        lens = [int(n) for n in seq_lens.tolist()]
        if any(n < 1 for n in lens) or sum(lens) != total:
            return
    ends = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1
    last = torch.zeros(total, dtype=torch.bool)
    last[ends] = True
    bad = torch.nonzero(last & (next_ids != -1))
    if bad.numel():
        t = int(bad[0, 0])
        b = int(torch.searchsorted(ends, t))
        start = t - lens[b] + 1
        raise InputError(f"{path}: next_token_ids[{t}] = {int(next_ids[t])} at the last row of sequence {b} "
                         f"(rows [{start}, {t + 1})); expected -1 there: the token after a sequence's last row "
                         "is not in the file (the next row belongs to another sequence)")
    inner = ~last[:-1] & (next_ids[:-1] != -1) & (next_ids[:-1] != input_ids[1:])
    bad = torch.nonzero(inner)
    if bad.numel():
        t = int(bad[0, 0])
        raise InputError(f"{path}: next_token_ids[{t}] = {int(next_ids[t])} but input_ids[{t + 1}] = "
                         f"{int(input_ids[t + 1])} (the next row of the same sequence); expected each next id to be "
                         "the input id of the row after it, or -1")


__all__ = ["DEFAULT_TEXTS", "HiddenFile", "HiddenStates", "TextHidden", "check_gguf_file", "check_model_dir",
           "check_next_token_ids", "decoder", "hidden_states_from_text", "load_hidden", "load_hidden_file",
           "load_text_model", "read_text_file", "save_hidden", "text_hidden_states"]
