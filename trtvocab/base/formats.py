"""Names that files, graphs and peer ranks share: one enum or constant per concept.

* :class:`WeightFormat`: how one rank's ``[V, H]`` shard is stored (dense, FP8, NVFP4, GGUF blocks).
  Manifests, ONNX metadata, engine records and the cross-rank handshake all use it.
* :class:`Activation` and :class:`Granularity`: the two knobs of a quantized head.
* :class:`Runtime`: what computed a result (reports, manifests and ``ran_on`` fields say it).
* :class:`CheckpointFormat`: whose conventions a checkpoint's quantized head follows (the toolchain that
  wrote it: ModelOpt or compressed-tensors), or dense.
* The ONNX graph's input and output names, which the exporter writes and every backend
  (onnxruntime, ``onnx.reference``, TensorRT) feeds and reads.

They are ``str`` enums: ``WeightFormat.FP8 == "FP8"``, and JSON holds the plain string.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class NameEnum(str, enum.Enum):
    """A str enum that prints as its value (what files and messages hold)."""

    def __str__(self) -> str:
        return self.value


GGUF_PREFIX = "GGUF_"  # a GGUF block type's format is this plus its GGML name (trtvocab.quant.gguf_blocks)


class WeightFormat(NameEnum):
    """Storage format of a head shard. The values are what manifests and graph metadata hold.

    The GGUF members are the rows of ``trtvocab.quant.gguf_blocks.BLOCK_TYPES`` (one member a row, a test
    holds them equal); what each block type is lives in that table, not here."""

    DENSE = "dense"
    FP8 = "FP8"
    NVFP4 = "NVFP4"
    GGUF_Q8_0 = "GGUF_Q8_0"  # llama.cpp's blocks, kept as stored (trtvocab.weights.gguf)
    GGUF_Q6_K = "GGUF_Q6_K"
    GGUF_Q4_0 = "GGUF_Q4_0"
    GGUF_Q4_1 = "GGUF_Q4_1"
    GGUF_Q5_0 = "GGUF_Q5_0"
    GGUF_Q4_K = "GGUF_Q4_K"

    @property
    def is_gguf(self) -> bool:
        """A GGUF block type kept as stored (its row: ``trtvocab.quant.gguf_blocks.of_format``)."""
        return self.value.startswith(GGUF_PREFIX)


class Activation(NameEnum):
    """How a quantized head treats its input.

    ``STATIC``: quantized with the checkpoint's ``input_scale`` (FP8 W8A8, NVFP4 W4A4);
    ``DYNAMIC``: FP8 with a per-tensor scale computed at run time (as TensorRT-LLM does);
    ``NONE``: kept in the head dtype (FP8 W8A16, NVFP4 W4A16).
    """

    STATIC = "static"
    DYNAMIC = "dynamic"
    NONE = "none"


class Granularity(NameEnum):
    """FP8 weight-scale granularity: one scale per tensor (ModelOpt's format) or per vocab row."""

    PER_TENSOR = "per_tensor"
    PER_ROW = "per_row"

    @classmethod
    def of_scale(cls, shape: Iterable[int]) -> Granularity:
        """The granularity of an FP8 ``weight_scale`` of ``shape`` (a header's or a tensor's): PER_ROW
        when it holds more than one value (one per vocab row), else PER_TENSOR (``[]``, ``[1]``, ``[1, 1]``)."""
        count = 1
        for dim in shape:
            count *= int(dim)
        return cls.PER_ROW if count > 1 else cls.PER_TENSOR


class CheckpointFormat(NameEnum):
    """Whose tensor names and scale conventions a checkpoint's head follows: the toolchain that quantized it
    (``quantize_checkpoint``'s ``checkpoint_format``, ``compare``'s ``variant_specs``
    ``TOOLCHAIN:...``), or ``DENSE`` (not quantized)."""

    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"
    DENSE = "dense"


# The toolchains that write a quantized head, in the order options and messages list them.
QUANTIZED_FORMATS = (CheckpointFormat.MODELOPT, CheckpointFormat.COMPRESSED_TENSORS)


class Runtime(NameEnum):
    """What computed a result: the PyTorch fallback, onnxruntime, ``onnx.reference`` (the ONNX
    reference evaluator: FP4 and bf16 graphs, which onnxruntime CPU cannot run) or a TensorRT engine.

    ``Runtime("reference")`` is :attr:`ONNX_REFERENCE`: the name manifests written before this
    enum hold (``VerifyRecord.backend``) and the ONNX backend's runner choice still accepts.
    """

    TORCH = "torch"
    ONNXRUNTIME = "onnxruntime"
    ONNX_REFERENCE = "onnx.reference"
    TENSORRT = "tensorrt"

    @classmethod
    def _missing_(cls, value: object) -> Runtime | None:
        return cls.ONNX_REFERENCE if value == "reference" else None


# The exported graph's inputs and output (see trtvocab.export.onnx for the graph itself).
HIDDEN = "hidden_states"  # [T, H] in the head dtype
SEQ_LENS = "seq_lens"  # [B] int32; absent in context-logits graphs
LOGITS = "logits"  # [B, V_local] (or [T, V_local]) float32
# The exported embedding graph's input and output (see trtvocab.export.embedding).
EMBED_IDS = "input_ids"  # [T] int64
EMBED_ROWS = "rows"  # [T, H] in the table dtype: this rank's partial rows
