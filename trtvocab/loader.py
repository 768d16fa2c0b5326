"""checkpoint -> gating -> shard load -> LMHead: what ``LMHead.from_checkpoint`` does."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from trtvocab import distributed as D
from trtvocab.checkpoint import Checkpoint
from trtvocab.errors import CheckpointError
from trtvocab.lm_head import LMHead
from trtvocab.mapping import Mapping
from trtvocab.quant.config import HeadQuantDecision, resolve_lm_head_quant
from trtvocab.sharding import VocabLayout
from trtvocab.weights.base import TENSOR_KEYS


def head_shape(ckpt: Checkpoint, decision: HeadQuantDecision) -> tuple[int, int]:
    """``(V, H)`` of the head, checked against config.json where it says."""
    info = ckpt.info(decision.tensor_name)
    if len(info.shape) != 2:
        raise CheckpointError(f"{decision.tensor_name}: expected a 2-D [V, H] tensor, got {list(info.shape)}")
    vocab, cols = info.shape
    hidden = cols * 2 if decision.stored is not None and decision.stored.value == "NVFP4" else cols
    cfg_vocab, cfg_hidden = ckpt.config_int("vocab_size"), ckpt.config_int("hidden_size")
    if cfg_vocab is not None and cfg_vocab != vocab:
        raise CheckpointError(f"{decision.tensor_name}: has {vocab} rows but config.json vocab_size is {cfg_vocab}")
    if cfg_hidden is not None and cfg_hidden != hidden:
        raise CheckpointError(
            f"{decision.tensor_name}: holds hidden size {hidden} but config.json hidden_size is {cfg_hidden}"
        )
    return vocab, hidden


def head_tensors(ckpt: Checkpoint, tensor_name: str, vocab: int) -> dict[str, Any]:
    """Lazy readers for the head and its scales: per-row tensors stay lazy, scalars are read."""
    module = tensor_name.rsplit(".", 1)[0]
    out: dict[str, Any] = {"weight": ckpt.get_slice(tensor_name)}
    for key in TENSOR_KEYS:
        name = f"{module}.{key}"
        if key == "weight" or not ckpt.has(name):
            continue
        info = ckpt.info(name)
        out[key] = ckpt.get_slice(name) if info.shape and info.shape[0] == vocab and len(info.shape) > 1 \
            else ckpt.read(name)
    return out


def load_lm_head(
    path: str | Path,
    *,
    mapping: Mapping | None = None,
    gather_output: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    quant: str = "auto",
    tensor_name: str | None = None,
    vocab_layout: VocabLayout = "uneven",
    pad_to: int = 64,
    process_group: Any = None,
    weight_only: bool = False,
) -> LMHead:
    """Build this rank's head. When the head is split and a process group exists, the ranks
    meet once after loading: a rank that failed (a truncated file only it reads, a missing
    shard file) makes every rank raise now, instead of leaving its peers waiting in the
    first forward's handshake until the collective timeout."""
    split = mapping is not None and mapping.lm_head_is_split and D.is_initialized()
    head: LMHead | None = None
    error: Exception | None = None
    try:
        head = _load(path, mapping=mapping, gather_output=gather_output, dtype=dtype, quant=quant,
                     tensor_name=tensor_name, vocab_layout=vocab_layout, pad_to=pad_to,
                     process_group=process_group, weight_only=weight_only)
    except Exception as exc:
        if not split:
            raise
        error = exc
    if split:
        signature = [head.vocab_size, head.hidden_size, _FORMATS.index(head.format_name)] if head else [0, 0, 0]
        table = D.agree(signature, error, process_group, torch.device("cpu"), what=f"LMHead.from_checkpoint({path})")
        D.check_same(table, [0, 1, 2], ["vocab_size", "hidden_size", f"weight format (index into {_FORMATS})"],
                     f"LMHead.from_checkpoint({path})")
    assert head is not None
    return head


_FORMATS = ["dense", "FP8", "NVFP4"]


def _load(
    path: str | Path,
    *,
    mapping: Mapping | None,
    gather_output: bool,
    dtype: torch.dtype,
    quant: str,
    tensor_name: str | None,
    vocab_layout: VocabLayout,
    pad_to: int,
    process_group: Any,
    weight_only: bool,
) -> LMHead:
    ckpt = Checkpoint(path)
    decision = resolve_lm_head_quant(ckpt, mapping=mapping, tensor_name=tensor_name, quant=quant,
                                     weight_only=weight_only)
    vocab, hidden = head_shape(ckpt, decision)
    head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping, gather_output=gather_output,
                  quant_config=decision.config, vocab_layout=vocab_layout, pad_to=pad_to,
                  process_group=process_group)
    tensors = head_tensors(ckpt, decision.tensor_name, vocab)
    if decision.dequantize:
        from trtvocab.quant.methods import dequantize_stored

        warnings.warn(decision.warning or "dequantizing the stored LM head", stacklevel=3)
        tensors = {"weight": dequantize_stored(decision.stored, tensors, head.shard, hidden)}
    elif decision.config is None:
        tensors = {"weight": tensors["weight"]}
    head.load_weights(tensors)
    head.quant_decision = decision
    return head
