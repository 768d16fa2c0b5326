"""The hidden-states file: what ``trtvocab hidden`` writes and ``infer`` / ``compare`` / ``quantize``'s ``calib`` read.

A ``.safetensors`` file with ``hidden_states [T, H]`` and, optionally, ``seq_lens [B]`` (int32),
``input_ids [T]`` and ``next_token_ids [T]`` (int64; -1: no next token) and, in its metadata,
``last_tokens`` (a JSON list of strings). Written atomically; read from a regular file only, every
tensor checked, the teacher-forced relation of the two id tensors included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from trtvocab.base.inputs import check_hidden_states
from trtvocab.base.publish import atomic_write_bytes
from trtvocab.base.safe_read import open_regular
from trtvocab.base.safetensors_header import read_safetensors_header
from trtvocab.errors import InputError, first_line


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
                         f"({type(exc).__name__}: {first_line(exc)})") from None
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


__all__ = ["HiddenFile", "check_next_token_ids", "load_hidden", "load_hidden_file", "load_last_tokens", "save_hidden"]
