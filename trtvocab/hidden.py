"""Real hidden states from a real model, offline: the input side of examples and the main job.

``hidden_states_from_text(model_dir, texts)`` runs the checkpoint's transformer body
(``transformers.AutoModel``, no hub access) over a few texts and returns the packed
final hidden states ``[T, H]`` with ``seq_lens [B]``, the way an engine hands them to
the LM head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trtvocab.errors import CheckpointError, InputError
from trtvocab.fsutil import atomic_write_bytes, open_regular, read_safetensors_header
from trtvocab.inputs import check_hidden_states

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


def hidden_states_from_text(model_dir: str | Path, texts: list[str], *, layer: int = -1) -> HiddenStates:
    """Packed hidden states ``[T, H]``, ``seq_lens [B]`` and last tokens of ``texts`` at ``layer``.

    No special tokens are added, so each sequence's last row is its last real token.
    ``layer`` indexes ``output_hidden_states`` (0 = embeddings, -1 = final layer).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight-loading bar per call is noise in CLI output
    if not texts or any(not t.strip() for t in texts):
        raise InputError("texts: need at least one non-empty text")
    check_model_dir(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        raise CheckpointError(f"{model_dir}: cannot load its tokenizer ({type(exc).__name__}: {_first_line(exc)})") \
            from None
    try:
        # safetensors only: a pickle (pytorch_model.bin) can run code when loaded.
        model = AutoModel.from_pretrained(str(model_dir), local_files_only=True, use_safetensors=True).eval()
    except Exception as exc:
        raise CheckpointError(f"{model_dir}: cannot load the model from its safetensors weights "
                              f"({type(exc).__name__}: {_first_line(exc)})") from None
    rows, lens, last = [], [], []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt", add_special_tokens=False)
            states = model(**enc, output_hidden_states=True).hidden_states
            if not -len(states) <= layer < len(states):
                raise InputError(f"layer: the model has hidden states 0..{len(states) - 1}, got {layer}")
            rows.append(states[layer][0])
            lens.append(rows[-1].shape[0])
            last.append(tok.convert_ids_to_tokens(int(enc.input_ids[0, -1])))
    return HiddenStates(torch.cat(rows).float(), torch.tensor(lens, dtype=torch.int32), last)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def check_model_dir(model_dir: str | Path) -> Path:
    """Refuse, before transformers looks at it, a model folder that cannot give hidden states
    safely: not a folder, no ``config.json``, no tokenizer file, or weights only as pickles
    (``pytorch_model.bin``, ``*.pt``: loading a pickle can run code, so trtvocab never does)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a model folder (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: has no config.json (expected a Hugging Face model directory)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(pattern))
        found = f"only pickle weights ({', '.join(pickles)}), which" if pickles else "no weights; pickles"
        raise CheckpointError(f"{path}: has {found} trtvocab never loads; convert it to safetensors")
    return path


def decoder(model_dir: str | Path | None) -> Any:
    """A token-id -> text function from the checkpoint's tokenizer, or plain ids when there is none."""
    if model_dir is not None and Path(model_dir).is_dir():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
            return lambda i: tok.convert_ids_to_tokens(int(i))
        except Exception:  # no tokenizer files or transformers missing: fall back to ids
            pass
    return lambda i: f"#{int(i)}"


def save_hidden(path: str | Path, hidden: torch.Tensor, seq_lens: torch.Tensor | None,
                last_tokens: list[str] | None = None) -> None:
    """Write ``hidden_states`` (+ ``seq_lens``) atomically; ``last_tokens`` go to the metadata."""
    from safetensors.torch import save

    tensors = {"hidden_states": hidden.contiguous()}
    if seq_lens is not None:
        tensors["seq_lens"] = seq_lens.to(torch.int32).contiguous()
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


def load_hidden(path: str | Path, *, finite: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden_states [T, H], seq_lens [B] or None)`` from a ``.safetensors`` file.

    Only a regular file is opened (a FIFO would block the reader forever); NaN / inf are
    refused naming the first bad row unless ``finite=False``; ``seq_lens`` must be a 1-D
    integer tensor (checked against T where it is used).
    """
    read_safetensors_header(path, "hidden states", InputError)  # a regular file, a header of the right shape
    try:
        with open_regular(path, "hidden states", InputError) as fh:
            from safetensors.torch import load

            data = load(fh.read())
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: cannot read hidden states ({type(exc).__name__}: {_first_line(exc)})") from None
    if "hidden_states" not in data:
        raise InputError(f"{path}: expected a tensor named 'hidden_states' [T, H], found {sorted(data)}")
    hidden = check_hidden_states(data["hidden_states"], what=f"{path}: hidden_states", finite=finite)
    lens = data.get("seq_lens")
    if lens is not None and (lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool):
        raise InputError(f"{path}: seq_lens must be a 1-D integer tensor [B], got {lens.dtype} {list(lens.shape)}")
    return hidden, lens


__all__ = ["DEFAULT_TEXTS", "HiddenStates", "decoder", "hidden_states_from_text", "load_hidden", "save_hidden"]
