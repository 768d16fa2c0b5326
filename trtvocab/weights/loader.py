"""checkpoint -> gating -> shard load: what a head needs from a checkpoint, before it exists.

:func:`open_head` reads headers only: which tensor holds the head, what the gating rule
(:func:`~trtvocab.quant.config.resolve_lm_head_quant`) decided, and ``(V, H)``. The
returned :class:`ProbedHead` then hands out lazy readers of exactly one shard's rows
(:meth:`ProbedHead.shard_tensors`), dequantizing a stored-quantized head that must run dense
(a stored scale is never ignored). ``LMHead.from_checkpoint`` builds the head from it;
nothing here knows the head class. :func:`open_embedding` does the same for the input embedding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trtvocab.base.family import EmbeddingOps, Family
from trtvocab.base.formats import Activation, CheckpointFormat, Granularity, WeightFormat
from trtvocab.checkpoints.checkpoint import Checkpoint, open_checkpoint
from trtvocab.checkpoints.families import family_of
from trtvocab.checkpoints.names import EMBEDDING_NAMES, find_embedding
from trtvocab.errors import CheckpointError, QuantizationError
from trtvocab.parallel.mapping import Mapping
from trtvocab.parallel.sharding import VocabShard
from trtvocab.quant import compressed_tensors as ct
from trtvocab.quant.config import HeadQuantDecision, QuantAlgo, QuantConfig, resolve_lm_head_quant
from trtvocab.quant.gguf_blocks import BLOCK_TYPES as GGUF_BLOCKS
from trtvocab.quant.gguf_blocks import GGUFConfig
from trtvocab.weights import FP8Weight, NVFP4Weight
from trtvocab.weights.base import TENSOR_KEYS, source_shape
from trtvocab.weights.quantized import QuantizedWeight

# What a head's bias may be stored as: values, never integer codes (converted they would be silently wrong).
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _where(ckpt: Any) -> str:
    """``"FILE: "`` of a single-file checkpoint (a .gguf), else ``""``: a prefix for messages."""
    return f"{ckpt.path}: " if getattr(ckpt, "metadata", None) is not None else ""


def _source(ckpt: Any, key: str) -> str:
    """Where the checkpoint's ``key`` came from (the file and the field), for messages."""
    source = getattr(ckpt, "config_source", None)
    return source(key) if callable(source) else f"config.json {key}"


def head_shape(ckpt: Checkpoint, decision: HeadQuantDecision) -> tuple[int, int]:
    """``(V, H)`` of the head, checked against config.json where it says."""
    info = ckpt.info(decision.tensor_name)
    if len(info.shape) != 2:
        raise CheckpointError(f"{decision.tensor_name}: expected a 2-D [V, H] tensor, got {list(info.shape)}")
    vocab, cols = info.shape
    hidden = cols * 2 if decision.stored is WeightFormat.NVFP4 else cols
    cfg_vocab, cfg_hidden = ckpt.config_int("vocab_size"), ckpt.config_int("hidden_size")
    if cfg_vocab is not None and cfg_vocab != vocab:
        raise CheckpointError(f"{decision.tensor_name}: has {vocab} rows but {_source(ckpt, 'vocab_size')} is "
                              f"{cfg_vocab}")
    # A head narrower or wider than the body (ELECTRA's embedding_size, RemBERT's output_embedding_size,
    # Reformer's two concatenated streams) is named by its own config field.
    widths = {ckpt.config_int(k) for k in ("embedding_size", "output_embedding_size", "input_embedding_size")}
    if ckpt.config_value("model_type") == "reformer" and cfg_hidden is not None:
        widths.add(2 * cfg_hidden)
    if cfg_hidden is not None and cfg_hidden != hidden and hidden not in widths:
        raise CheckpointError(
            f"{decision.tensor_name}: holds hidden size {hidden} but {_source(ckpt, 'hidden_size')} is {cfg_hidden}"
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


def dequantize_stored(stored: WeightFormat, tensors: dict[str, Any], shard: VocabShard, hidden: int) -> torch.Tensor:
    """Exact float32 ``[shard.size, H]`` of this shard's rows of a head stored as ``stored`` (FP8 or NVFP4).

    Used when a quantized head must run dense (tied, excluded, ``quant="none"``): the stored scales are
    applied, never dropped, and the same validation as a quantized load runs.
    """
    method: QuantizedWeight
    if stored is WeightFormat.FP8:
        scale = tensors.get("weight_scale")
        granularity = Granularity.of_scale(source_shape(scale)) if scale is not None else Granularity.PER_TENSOR
        config = QuantConfig(quant_algo=QuantAlgo.FP8, activation=Activation.NONE, granularity=granularity)
        method = FP8Weight(shard, hidden, torch.float32, config)
    elif stored is WeightFormat.NVFP4:
        method = NVFP4Weight(shard, hidden, torch.float32,
                             QuantConfig(quant_algo=QuantAlgo.NVFP4, activation=Activation.NONE))
    else:
        raise QuantizationError(f"cannot dequantize a head stored as {stored}; supported: FP8, NVFP4")
    method.load({k: v for k, v in tensors.items() if k != "input_scale"})
    return method.dense_weight()[: shard.size]


@dataclass(frozen=True)
class ProbedHead:
    """A checkpoint's head, probed but not read (:func:`open_head`): the ``checkpoint``, the gating
    ``decision``, ``shape`` ``(V, H)``, the quantization it runs with (``quant_config``: the decision's,
    or a GGUF head's stored blocks), what its ``family`` computes beyond ``x @ W.T``, and a ``note`` on
    how it loads. :meth:`shard_tensors` hands out one shard's rows."""

    checkpoint: Any  # Checkpoint | GGUFCheckpoint
    decision: HeadQuantDecision
    shape: tuple[int, int]
    quant_config: QuantConfig | GGUFConfig | None
    family: Family | None = None
    note: str = ""

    @property
    def vocab_size(self) -> int:
        return self.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.shape[1]

    @property
    def weight_format(self) -> WeightFormat:
        return WeightFormat.DENSE if self.quant_config is None else self.quant_config.weight_format

    def shard_tensors(self, shard: VocabShard) -> dict[str, Any]:
        """What ``load_weights`` of a head with ``shard`` takes: lazy row readers or dense rows of the
        checkpoint (with the family's bias, when it has one)."""
        tensors = self._weight_tensors(shard)
        if self.family is not None and self.family.bias_tensor is not None:
            tensors = {**tensors, "bias": self.checkpoint.get_slice(self.family.bias_tensor)}
        return tensors

    def _weight_tensors(self, shard: VocabShard) -> dict[str, Any]:
        if self.decision.notice:
            warnings.warn(self.decision.notice, stacklevel=3)
        if self.decision.checkpoint_format is CheckpointFormat.COMPRESSED_TENSORS:
            # compressed-tensors: dequantized lazily as its decompress does, or renamed to ModelOpt's tensors.
            if self.decision.dequantize:
                warnings.warn(self.decision.warning or "dequantizing the stored LM head", stacklevel=3)
            config = self.decision.config
            return ct.head_tensors(
                self.checkpoint, self.decision.tensor_name,
                self.decision.stored,
                dequantize=self.decision.dequantize,
                granularity=config.granularity if config is not None else Granularity.PER_TENSOR,
                static=config is not None and config.activation is Activation.STATIC, hidden=self.hidden_size)
        tensors = head_tensors(self.checkpoint, self.decision.tensor_name, self.vocab_size)
        if self.decision.dequantize:
            assert self.decision.stored is not None
            warnings.warn(self.decision.warning or "dequantizing the stored LM head", stacklevel=3)
            return {"weight": dequantize_stored(self.decision.stored, tensors, shard, self.hidden_size)}
        if self.decision.config is None:
            return {"weight": tensors["weight"]}
        return tensors


def gguf_head_format(ckpt: Any, decision: HeadQuantDecision, *, gguf_blocks: bool = True,
                     quant: str = "auto") -> tuple[GGUFConfig | None, str]:
    """``(config, note)`` for a GGUF head: Q8_0 / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q4_K stay in their blocks
    (unless ``gguf_blocks`` is False or ``quant="none"``); other block types are dequantized to float32,
    said in ``note``."""
    info = ckpt.info(decision.tensor_name)
    qtype = getattr(getattr(info, "ggml_type", None), "name", None)
    if qtype is None or info.native or decision.config is not None:
        return None, ""
    if qtype in GGUF_BLOCKS and gguf_blocks and quant != "none":
        return GGUFConfig(block_type=qtype), f"{info.gguf_name}: kept in its stored GGUF {qtype} blocks"
    why = ("gguf_blocks=False" if qtype in GGUF_BLOCKS and not gguf_blocks
           else "quant='none'" if qtype in GGUF_BLOCKS
           else f"no stored-format kernel for {qtype}; stored formats: {', '.join(GGUF_BLOCKS)}")
    return None, f"{info.gguf_name}: GGUF {qtype} dequantized to float32 (gguf.quants), then the head dtype ({why})"


def open_head(path: str | Path, *, mapping: Mapping | None = None, tensor_name: str | None = None,
              quant: str = "auto", weight_only: bool = False, gguf_blocks: bool = True) -> ProbedHead:
    """Probe ``path`` (a path or an opened checkpoint; headers only) and apply the gating rule; a GGUF
    head's format: :func:`gguf_head_format`."""
    ckpt = open_checkpoint(path) if not hasattr(path, "info") else path
    decision = resolve_lm_head_quant(ckpt, mapping=mapping, tensor_name=tensor_name, quant=quant,
                                     weight_only=weight_only)
    vocab, hidden = head_shape(ckpt, decision)
    blocks, note = gguf_head_format(ckpt, decision, gguf_blocks=gguf_blocks, quant=quant)
    family = family_of(ckpt, head_tensor=decision.tensor_name, hidden_size=hidden, need_embedding=False)
    if family.bias_tensor is not None:
        bias_shape = list(ckpt.info(family.bias_tensor).shape)
        if bias_shape != [vocab]:
            raise CheckpointError(f"{family.bias_tensor}: the head's bias must be [{vocab}], got {bias_shape}")
        bias_dtype = ckpt.info(family.bias_tensor).torch_dtype
        if bias_dtype not in BIAS_DTYPES:  # an int32 output.bias (llama.cpp requires F32) is not converted silently
            raise CheckpointError(f"{_where(ckpt)}{family.bias_tensor}: the head's bias is stored as {bias_dtype}; "
                                  "expected float32, bfloat16 or float16 values")
        ckpt.get_slice(family.bias_tensor)
    # Validate the tensor's byte range against the file now (one stat, nothing read): a tiny
    # file whose header claims 32 GiB is refused before the head allocates its shard.
    ckpt.get_slice(decision.tensor_name)
    return ProbedHead(checkpoint=ckpt, decision=decision, shape=(vocab, hidden),
                      quant_config=blocks if blocks is not None else decision.config, family=family, note=note)


# ---- the input embedding ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingSource:
    """A checkpoint's input embedding, probed but not read: the tensor, ``(V, H)``, the lazy readers
    ``load_weights`` takes and the table's quantization (None: dense)."""

    checkpoint: Any
    tensor_name: str
    vocab_size: int
    hidden_size: int
    tensors: dict[str, Any]
    quant_config: QuantConfig | GGUFConfig | None
    notice: str | None = None
    embedding_ops: EmbeddingOps = field(default_factory=EmbeddingOps)  # what the family's embedding does to rows
    family: Family | None = None


def embedding_tensor_name(ckpt: Any, tensor_name: str | None = None) -> str:
    """The checkpoint's input-embedding tensor: ``tensor_name``, or the first known name present
    (``<module>.weight``, or compressed-tensors' NVFP4 ``<module>.weight_packed``)."""
    if tensor_name is not None:
        ckpt.info(tensor_name)  # raises naming the checkpoint when absent
        return tensor_name
    found = find_embedding(ckpt)
    if found is not None:
        return found
    raise CheckpointError(f"checkpoint {ckpt.path}: no input embedding among {list(EMBEDDING_NAMES)}; "
                          "pass tensor_name= to name it")


def open_embedding(path: Any, tensor_name: str | None = None, gguf_blocks: bool = True) -> EmbeddingSource:
    """Probe the input embedding of ``path`` (a path or an opened checkpoint; headers only).

    ModelOpt / plain files: a ``float8_e4m3fn`` table with its float32 ``weight_scale`` loads as
    FP8 (per tensor, or per row when the scale has more than one value), a GGUF Q8_0 / Q6_K table in its
    blocks (``gguf_blocks``), anything else dense.
    compressed-tensors files: :func:`trtvocab.quant.compressed_tensors.embedding_tensors` (the
    config and tensors must agree; an NVFP4 table is decompressed exactly, with a notice).
    """
    ckpt = open_checkpoint(path) if not hasattr(path, "info") else path
    name = embedding_tensor_name(ckpt, tensor_name)
    section = getattr(ckpt, "config", {}).get("quantization_config")
    if ct.is_compressed_tensors(section):
        got = ct.embedding_tensors(ckpt, section, f"{ckpt.path / 'config.json'} quantization_config", name)
        config = None if got.weight_format is None else QuantConfig(
            quant_algo=QuantAlgo.FP8, activation=Activation.NONE, granularity=got.granularity)
        family = family_of(ckpt, hidden_size=got.hidden_size, need_head=False)
        return EmbeddingSource(ckpt, got.tensor_name, got.vocab_size, got.hidden_size, got.tensors, config,
                               got.notice, family.embedding, family)
    info = ckpt.info(name)
    if len(info.shape) != 2:
        raise CheckpointError(f"{name}: expected a 2-D [V, H] table, got {list(info.shape)}")
    module = name.rsplit(".", 1)[0]
    tensors: dict[str, Any] = {"weight": ckpt.get_slice(name)}
    config: QuantConfig | GGUFConfig | None = None
    qtype = getattr(getattr(info, "ggml_type", None), "name", None)
    if gguf_blocks and qtype in GGUF_BLOCKS:  # a stored GGUF block type stays so (dequantized at lookup)
        config = GGUFConfig(block_type=qtype)
    if info.dtype == "F8_E4M3":
        scale_name = f"{module}.weight_scale"
        if not ckpt.has(scale_name):
            raise CheckpointError(f"{name} is float8_e4m3fn but {scale_name} is missing")
        granularity = Granularity.of_scale(ckpt.info(scale_name).shape)
        per_row = granularity is Granularity.PER_ROW
        tensors["weight_scale"] = ckpt.get_slice(scale_name) if per_row else ckpt.read(scale_name)
        config = QuantConfig(quant_algo=QuantAlgo.FP8, activation=Activation.NONE, granularity=granularity)
    family = family_of(ckpt, hidden_size=info.shape[1], need_head=False)
    return EmbeddingSource(ckpt, name, info.shape[0], info.shape[1], tensors, config,
                           embedding_ops=family.embedding, family=family)
