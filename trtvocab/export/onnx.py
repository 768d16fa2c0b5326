"""One rank's LM head as an ONNX graph: the graph TensorRT parses, and the CPU backends check.

Every graph has the same frame (``hidden_states``, for the last-token graph ``seq_lens`` and a
Gather of the last rows, then the weight path, then float32 ``logits [B, V_local]``); only the
weight and activation path differs by format: dense, FP8 W8A16 / W8A8 static / W8A8 dynamic,
NVFP4 W4A4 / W4A16, and the ``dequantize_fp4`` variant for Hopper. Weight-only half heads
dequantize exactly in the head dtype under a power-of-two prescale (:func:`exact_prescale`), and
:func:`gemm_rounding` names the dtype a graph's 16-bit GEMM rounds each logit to.

The node layout of each graph and why it is built that way (the ``[V, H]`` weight and its
Transpose, no ``seq_lens`` in the context graph, dynamic FP8's scale outside the Q/DQ pair, the
16-bit GEMMs and the rounding they cost, the IR version): docs/architecture.md, "Engines",
"The head graph".
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, external_data_helper, helper, numpy_helper
from pydantic import BaseModel, ConfigDict

from trtvocab.base.dtypes import HEAD_DTYPES, dtype_name
from trtvocab.base.formats import HIDDEN, LOGITS, SEQ_LENS, Activation, Granularity, WeightFormat
from trtvocab.base.publish import fsync_file
from trtvocab.base.safe_read import sha256_file
from trtvocab.errors import ArtifactError, CheckpointError, ConfigError, QuantizationError
from trtvocab.export.gguf_onnx import int4_proto, q4_tensors, q8_0_tensors
from trtvocab.quant import gguf_blocks
from trtvocab.quant.fp8 import FP8_MAX
from trtvocab.quant.nvfp4 import BLOCK as FP4_BLOCK
from trtvocab.version import __version__

if TYPE_CHECKING:
    from trtvocab.lm_head import LMHead

TOKENS_DIM, BATCH_DIM = "num_tokens", "batch"
TRT_DOMAIN = "trt"
FP4_QUANTIZE_OP = "TRT_FP4DynamicQuantize"
# The protobuf limit is 2 GiB for the whole file; leave room for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
DEFAULT_OPSET = 23
# FP8 Q/DQ: opset 19; FLOAT4E2M1 in DequantizeLinear: 23.
# GGUF Q8_0 / Q4_0 / Q4_1: blocked DequantizeLinear (block_size) and INT4: 21.
GGUF_GRAPH_FORMATS = gguf_blocks.ONNX_FORMATS  # the block types whose row says onnx_codes
MIN_OPSET = {WeightFormat.DENSE: 19, WeightFormat.FP8: 19, WeightFormat.NVFP4: 23,
             **dict.fromkeys(GGUF_GRAPH_FORMATS, 21)}
GGUF_BLOCK = 32  # the Q8_0 / Q4_0 / Q4_1 block along H
WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE = (
    "lm_head.weight", "lm_head.weight_scale", "lm_head.weight_scale_2", "lm_head.input_scale")
BIAS = "lm_head.bias"
# A GGUF head's blocks as DequantizeLinear's operands: codes (int8; Q4 as int4 q - 8), scales d; Q4_1's 8 d
# and m (added after the dequantize: TensorRT refuses non-zero zero points).
GGUF_Q, GGUF_D, GGUF_D8, GGUF_M = "lm_head.weight_q", "lm_head.weight_d", "lm_head.weight_d8", "lm_head.weight_m"
GEMM_LOGITS = "lm_head/gemm_logits"  # x @ W.T, before the family's ops (when it has any)
LORA_A, LORA_B = "lm_head.lora_A_t", "lm_head.lora_B_t"  # a baked-in adapter: A^T [H, r], s * B^T [r, V_local]
BASE_LOGITS = "lm_head/base_logits"  # x @ W.T before a baked-in adapter's delta is added
_META = "trtvocab."

_ONNX_FLOAT = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
_TYPE_NAMES = {
    TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT32: "int32", TensorProto.INT64: "int64", TensorProto.UINT8: "uint8",
    TensorProto.FLOAT8E4M3FN: "float8_e4m3fn", TensorProto.FLOAT4E2M1: "float4_e2m1",
    TensorProto.INT8: "int8", TensorProto.INT4: "int4",
}


@dataclass(frozen=True)
class GraphSpec:
    """Everything that shapes the graph; stored in the model's metadata as ``trtvocab.*``."""

    weight_format: WeightFormat
    dtype: str  # hidden_states' dtype (the head's): "bfloat16" | "float16" | "float32"
    hidden_size: int
    local_vocab_size: int
    activation: Activation = Activation.NONE
    granularity: Granularity = Granularity.PER_TENSOR  # FP8 weight scale
    block_size: int = FP4_BLOCK
    context_logits: bool = False
    dequantize_fp4: bool = False
    float32_logits: bool = False  # a dense half-precision head with output_dtype=float32
    deterministic: bool = False  # the head's deterministic=True (TensorRT: distributive independence)
    # The family's ops after x @ W.T (trtvocab.base.family.HeadOps), in float32: Add, Mul, Div, Tanh.
    head_bias: bool = False
    logit_scale: float = 1.0
    logit_divisor: float = 1.0
    softcap: float = 0.0  # 0: none
    lora_rank: int = 0  # a LoRA adapter baked in (export_onnx(adapter=k)): two float32 MatMuls; 0: none
    opset: int = DEFAULT_OPSET
    # Where the shard sits (provenance; does not change the graph).
    vocab_start: int = 0
    vocab_end: int = 0
    vocab_size: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    def metadata(self) -> dict[str, str]:
        return {_META + k: str(v) for k, v in asdict(self).items()}  # str(enum) is its value

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> GraphSpec:
        props = {p.key[len(_META):]: p.value for p in model.metadata_props if p.key.startswith(_META)}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in props and f.name in _OPTIONAL_FIELDS:
                continue  # graphs written before the field existed: its default
            if f.name not in props:
                raise ArtifactError(f"ONNX model has no '{_META}{f.name}' metadata: not written by trtvocab export")
            raw = props[f.name]
            parse = _FIELD_PARSERS.get(f.type, str)
            try:
                values[f.name] = parse(raw)
            except ValueError:
                raise ArtifactError(f"ONNX metadata '{_META}{f.name}' = {raw!r} is not a valid {f.type}") from None
        return cls(**values)


_OPTIONAL_FIELDS = frozenset({"lora_rank"})
_FIELD_PARSERS: dict[str, Any] = {"bool": lambda raw: raw == "True", "int": int, "float": float,
                                  "WeightFormat": WeightFormat,
                                  "Activation": Activation, "Granularity": Granularity}


class GraphTensor(BaseModel):
    """A graph input or output: its name, element type and shape (symbolic dims as names)."""

    model_config = ConfigDict(frozen=True)

    name: str
    dtype: str
    shape: list[int | str]


class ExportInfo(BaseModel):
    """What :func:`export_onnx` wrote (everything a manifest or a runtime needs to know)."""

    model_config = ConfigDict(frozen=True)

    path: str
    data_path: str | None  # external data file (same folder), None when the weights are inline
    sha256: dict[str, str]  # file name -> digest, for every file written
    total_bytes: int
    inputs: list[GraphTensor]
    outputs: list[GraphTensor]
    opset: int
    ir_version: int
    weight_format: WeightFormat
    activation: Activation
    granularity: Granularity
    context_logits: bool
    dequantize_fp4: bool
    hidden_size: int
    local_vocab_size: int
    vocab_start: int
    vocab_end: int
    ops: list[str]  # op types used ("trt::TRT_FP4DynamicQuantize" for the custom op)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


# ---- tensors ------------------------------------------------------------------------------
def tensor_proto(name: str, tensor: torch.Tensor) -> TensorProto:
    """A torch tensor as a raw-data initializer, bit for bit (bf16 and fp8 included)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(t.shape), t.view(torch.int16).numpy().tobytes(),
                                  raw=True)
    if t.dtype == torch.float8_e4m3fn:
        return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(t.shape),
                                  t.view(torch.uint8).numpy().tobytes(), raw=True)
    if t.dtype in (torch.float16, torch.float32, torch.int32, torch.int64):
        return numpy_helper.from_array(t.numpy(), name)
    raise QuantizationError(f"{name}: no ONNX initializer for dtype {t.dtype}")


def fp4_proto(name: str, packed: torch.Tensor) -> TensorProto:
    """Packed uint8 ``[V, H/2]`` (element 2k in the low nibble) as FLOAT4E2M1 ``[V, H]``.

    ONNX packs 4-bit tensors the same way (element 2k low, 2k+1 high, row-major), so the
    checkpoint bytes are the raw data as they are.
    """
    p = packed.detach().cpu().contiguous()
    return helper.make_tensor(name, TensorProto.FLOAT4E2M1, [p.shape[0], p.shape[1] * 2], p.numpy().tobytes(),
                              raw=True)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise CheckpointError(f"{name}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")


def _scalar(name: str, tensor: torch.Tensor | None) -> TensorProto:
    if tensor is None:
        raise QuantizationError(f"{name} is required by this quantization but the head has none")
    if tensor.numel() != 1:
        raise QuantizationError(f"{name}: expected a scalar scale, got shape {list(tensor.shape)}")
    return tensor_proto(name, tensor.detach().reshape(()).float())


def head_tensors(head: LMHead, spec: GraphSpec, adapter: int | None = None) -> dict[str, TensorProto]:
    """This rank's shard as initializers under canonical names, validated against ``spec`` (``adapter``:
    the LoRA adapter baked in, when ``spec.lora_rank``)."""
    t = head.weights.export_tensors()
    v, h = spec.local_vocab_size, spec.hidden_size
    if "weight" not in t:
        raise CheckpointError(f"{head.weight_format} head exported no 'weight' (got {sorted(t)})")
    out: dict[str, TensorProto] = {}
    if spec.weight_format is WeightFormat.DENSE:
        _check_shape("weight", t["weight"], (v, h), head.dtype)
        out[WEIGHT] = tensor_proto(WEIGHT, t["weight"])
    elif spec.weight_format is WeightFormat.FP8:
        _check_shape("weight", t["weight"], (v, h), torch.float8_e4m3fn)
        ws = t.get("weight_scale")
        if ws is None:
            raise QuantizationError("FP8 head exported no weight_scale")
        if spec.granularity is Granularity.PER_ROW:
            if ws.numel() != v:
                raise QuantizationError(f"per-row FP8 weight_scale: expected {v} values, got shape {list(ws.shape)}")
            out[WEIGHT_SCALE] = tensor_proto(WEIGHT_SCALE, ws.detach().reshape(v).float())
        else:
            out[WEIGHT_SCALE] = _scalar(WEIGHT_SCALE, ws)
        out[WEIGHT] = tensor_proto(WEIGHT, t["weight"])
        if spec.activation is Activation.STATIC:
            out[INPUT_SCALE] = _scalar(INPUT_SCALE, t.get("input_scale"))
    elif spec.weight_format is WeightFormat.NVFP4:
        _check_shape("weight", t["weight"], (v, h // 2), torch.uint8)
        ws = t.get("weight_scale")
        if ws is None:
            raise QuantizationError("NVFP4 head exported no weight_scale (block scales)")
        _check_shape("weight_scale", ws, (v, h // spec.block_size), torch.float8_e4m3fn)
        out[WEIGHT] = fp4_proto(WEIGHT, t["weight"])
        out[WEIGHT_SCALE] = tensor_proto(WEIGHT_SCALE, ws)
        out[WEIGHT_SCALE_2] = _scalar(WEIGHT_SCALE_2, t.get("weight_scale_2"))
        if spec.activation is Activation.STATIC:
            out[INPUT_SCALE] = _scalar(INPUT_SCALE, t.get("input_scale"))
    elif spec.weight_format in GGUF_GRAPH_FORMATS:
        out.update(_gguf_tensors(head, spec))
    else:
        raise QuantizationError(f"no ONNX export for weight format {spec.weight_format!r}")
    if spec.head_bias:
        bias = getattr(head, "bias", None)
        if bias is None or tuple(bias.shape) != (v,):
            raise CheckpointError(f"the head's bias: expected float32 [{v}], got {getattr(bias, 'shape', None)}")
        out[BIAS] = tensor_proto(BIAS, bias.detach().float())
    if spec.lora_rank:
        assert adapter is not None
        part = head.adapters[adapter]
        out[LORA_A] = tensor_proto(LORA_A, part.lora_a.detach().float().t().contiguous())
        out[LORA_B] = tensor_proto(LORA_B, (part.lora_b.detach().float() * part.scaling).t().contiguous())
    return out


def _gguf_tensors(head: LMHead, spec: GraphSpec) -> dict[str, TensorProto]:
    """A GGUF Q8_0 / Q4_0 / Q4_1 shard's blocks as DequantizeLinear operands (their values, bit for bit), laid
    out ``[H, V_local]`` (blocks along axis 0, the GEMM's K): the layout TensorRT-RTX fuses into an int4
    weight-only GEMM."""
    v, h = spec.local_vocab_size, spec.hidden_size
    if spec.weight_format is WeightFormat.GGUF_Q8_0:
        q, d = q8_0_tensors(head)
        m = None
    else:
        q, d, m = q4_tensors(head)  # the signed codes q - 8
    if q.shape != (v, h) or d.shape != (v, h // GGUF_BLOCK):
        raise CheckpointError(f"{spec.weight_format} head: codes {list(q.shape)} / scales {list(d.shape)}, expected "
                              f"[{v}, {h}] / [{v}, {h // GGUF_BLOCK}]")
    qt = np.ascontiguousarray(q.T)
    out = {GGUF_Q: numpy_helper.from_array(qt, GGUF_Q) if spec.weight_format is WeightFormat.GGUF_Q8_0
           else int4_proto(GGUF_Q, qt), GGUF_D: numpy_helper.from_array(np.ascontiguousarray(d.T), GGUF_D)}
    if m is not None:  # Q4_1: ((q - 8) * d + 8 d) + m, 8 d and m repeated over their blocks
        out[GGUF_D8] = numpy_helper.from_array(np.ascontiguousarray((8 * d).T).reshape(h // GGUF_BLOCK, 1, v), GGUF_D8)
        out[GGUF_M] = numpy_helper.from_array(np.ascontiguousarray(m.T).reshape(h // GGUF_BLOCK, 1, v), GGUF_M)
    return out


def _lora_rank(head: LMHead, adapter: int | None) -> int:
    """The rank of the LoRA adapter ``adapter`` baked into the graph (0: none); refuses what a graph would drop."""
    if adapter is None:
        if head.adapters:
            raise ConfigError(f"ONNX export: the head holds LoRA adapters {head.adapter_names}, which the graph would "
                              "drop; pass adapter=INDEX to bake one in, or export a head without adapters")
        return 0
    if isinstance(adapter, bool) or not isinstance(adapter, int) or not 0 <= adapter < len(head.adapters):
        raise ConfigError(f"ONNX export: adapter must be an index into {head.adapter_names}, got {adapter!r}")
    part = head.adapters[adapter]
    if part.added:
        raise ConfigError(f"ONNX export: adapter {part.name!r} adds {part.added} tokens (an added-vocabulary "
                          "segment past the base vocabulary); a graph's columns are the base shard only: refused "
                          "(run it on the PyTorch head; docs/architecture.md, 'Adapters that add tokens')")
    if part.copy is not None or part.token_index is not None:
        raise ConfigError(f"ONNX export: adapter {part.name!r} replaces rows of the head (modules_to_save / "
                          "trainable tokens); only LoRA factors are exported (two MatMuls)")
    return part.rank if part.has_lora else 0


def spec_for_head(head: LMHead, *, context_logits: bool, opset: int, dequantize_fp4: bool = False,
                  adapter: int | None = None) -> GraphSpec:
    """What shapes ``head``'s graph; ``adapter``: a LoRA adapter's index to bake in (see :func:`export_onnx`)."""
    lora_rank = _lora_rank(head, adapter)
    fmt = head.weight_format
    qc = head.quant_config
    activation, granularity, block = Activation.NONE, Granularity.PER_TENSOR, FP4_BLOCK
    if fmt.is_gguf and fmt not in GGUF_GRAPH_FORMATS:
        names = ", ".join(gguf_blocks.of_format(f).name for f in GGUF_GRAPH_FORMATS)
        raise QuantizationError(f"no ONNX export for a GGUF {gguf_blocks.of_format(fmt).name} head kept in its "
                                f"stored blocks (blocked DequantizeLinear has {names} only); load it "
                                "float32-dequantized ([lm_head] gguf_blocks = false) to export a dense graph")
    if fmt in GGUF_GRAPH_FORMATS:
        block = GGUF_BLOCK  # activations stay float; the graph multiplies in float32
    elif fmt is not WeightFormat.DENSE:
        if qc is None:
            raise QuantizationError(f"{fmt} head has no quant_config")
        activation, granularity, block = qc.activation, qc.granularity, qc.group_size
    if fmt not in MIN_OPSET:
        raise QuantizationError(f"no ONNX export for weight format {fmt!r}; supported: {[str(f) for f in MIN_OPSET]}")
    latest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET[fmt] <= opset <= latest:
        raise ConfigError(f"opset {opset} cannot express a {fmt} head: use {MIN_OPSET[fmt]}..{latest}")
    if fmt is WeightFormat.NVFP4:
        if block != FP4_BLOCK:
            raise QuantizationError(f"NVFP4 export needs group_size {FP4_BLOCK} (TensorRT's FP4 block), got {block}")
        if activation not in (Activation.STATIC, Activation.NONE):
            raise QuantizationError(f"NVFP4 activation must be 'static' (W4A4) or 'none' (W4A16), got {activation!r}")
        if head.hidden_size % FP4_BLOCK:
            raise QuantizationError(f"NVFP4 needs hidden_size divisible by {FP4_BLOCK}, got {head.hidden_size}")
    if dequantize_fp4 and fmt is not WeightFormat.NVFP4:
        raise ConfigError(f"dequantize_fp4 applies to NVFP4 heads, this one is {fmt}")
    return GraphSpec(
        weight_format=fmt, dtype=dtype_name(head.dtype), hidden_size=head.hidden_size,
        local_vocab_size=head.local_vocab_size, activation=activation, granularity=granularity, block_size=block,
        context_logits=context_logits, dequantize_fp4=dequantize_fp4, opset=opset,
        float32_logits=fmt is WeightFormat.DENSE and head.dtype != torch.float32
        and getattr(head, "output_dtype", head.dtype) == torch.float32,
        deterministic=bool(getattr(head, "deterministic", False)),
        vocab_start=head.vocab_start, vocab_end=head.vocab_end, vocab_size=head.vocab_size,
        tp_size=head.tp_size, tp_rank=head.tp_rank, lora_rank=lora_rank, **_ops_fields(head),
    )


def _ops_fields(head: LMHead) -> dict[str, Any]:
    ops = head.head_ops
    return {"head_bias": ops.bias, "logit_scale": ops.scale, "logit_divisor": ops.divisor,
            "softcap": ops.softcap or 0.0}


def has_head_ops(spec: GraphSpec) -> bool:
    """Whether the graph applies a family's ops after ``x @ W.T``."""
    return spec.head_bias or spec.logit_scale != 1.0 or spec.logit_divisor != 1.0 or spec.softcap > 0


def _head_ops(g: _Graph, spec: GraphSpec, tensors: dict[str, TensorProto]) -> None:
    """``softcap(((z + b) * scale) / divisor)`` on the float32 ``z`` the GEMM wrote to GEMM_LOGITS, in the
    fallback's order (trtvocab.base.family.HeadOps): Add, Mul, Div, then Div, Tanh, Mul."""
    steps: list[tuple[str, str]] = []
    if spec.head_bias:
        steps.append(("Add", g.init(tensors[BIAS])))
    if spec.logit_scale != 1.0:
        steps.append(("Mul", g.const("logit_scale", spec.logit_scale, np.float32)))
    if spec.logit_divisor != 1.0:
        steps.append(("Div", g.const("logit_divisor", spec.logit_divisor, np.float32)))
    if spec.softcap > 0:
        cap = g.const("softcap", spec.softcap, np.float32)
        steps += [("Div", cap), ("Tanh", ""), ("Mul", cap)]
    z = GEMM_LOGITS
    for i, (op, operand) in enumerate(steps):
        out = LOGITS if i == len(steps) - 1 else None
        z = g.node(op, [z] + ([operand] if operand else []), out=out)


# ---- graph ----------------------------------------------------------------------------------
class _Graph:
    """Accumulates nodes and initializers; every node is named ``lm_head/<op>_<n>`` for error messages."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._count = 0

    def init(self, proto: TensorProto) -> str:
        self.inits.append(proto)
        return proto.name

    def const(self, name: str, value: Any, dtype: Any) -> str:
        return self.init(numpy_helper.from_array(np.array(value, dtype=dtype), f"lm_head/{name}"))

    def node(self, op: str, inputs: list[str], *, out: str | None = None, n_out: int = 1, domain: str = "",
             **attrs: Any) -> Any:
        self._count += 1
        name = f"lm_head/{op}_{self._count}"
        outputs = [out] if out is not None else [f"{name}:{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if n_out == 1 else outputs


def _to_float32(g: _Graph, x: str, spec: GraphSpec) -> str:
    return x if spec.dtype == "float32" else g.node("Cast", [x], to=TensorProto.FLOAT)


def gemm_rounding(spec: GraphSpec) -> str | None:
    """The dtype the graph rounds each logit to before the float32 output (None: the GEMM is float32).

    Half-precision dense heads (``float32_logits`` included), FP8 W8A16, NVFP4 W4A16 and
    ``dequantize_fp4`` graphs multiply in the head dtype, and an ONNX MatMul's output has
    its operands' type; float32 heads and W8A8 / W4A4 graphs multiply in float32.
    """
    if spec.dtype == "float32" or spec.weight_format in GGUF_GRAPH_FORMATS:  # GGUF: float32 W and x
        return None
    if spec.weight_format is WeightFormat.DENSE or spec.activation is Activation.NONE:
        return spec.dtype
    return None


# Dequantized weight values: e4m3 codes are multiples of 2**-9 (the smallest subnormal) up
# to 448; e2m1 (multiples of 0.5, up to 6) times an e4m3 block scale: multiples of 2**-10 up
# to 2688. Each 16-bit type: the exponent of its smallest subnormal and its largest value.
_WEIGHT_GRID = {WeightFormat.FP8: (-9, float(FP8_MAX)), WeightFormat.NVFP4: (-10, 6.0 * FP8_MAX)}
_HALF_RANGE = {"float16": (-24, 65504.0), "bfloat16": (-133, float(torch.finfo(torch.bfloat16).max))}


def exact_prescale(scale: float, fmt: WeightFormat, dtype: str) -> float:
    """The power of two ``2**k`` nearest ``scale`` such that every dequantized ``fmt`` value
    times ``2**k`` is exact in ``dtype`` (on its grid and in range), and never 1.0.

    1.0 is skipped because TensorRT removes a DequantizeLinear scale of 1.0 and the plain
    cast left behind is not fused into the GEMM (TensorRT-RTX 1.7.1: a separate dequantize
    kernel writes the weight in 16 bits on every call).
    """
    lsb, top = _WEIGHT_GRID[fmt]
    tiny, big = _HALF_RANGE[dtype]
    lo, hi = tiny - lsb, math.floor(math.log2(big / top))
    k = round(math.log2(scale)) if math.isfinite(scale) and scale > 0 else 0
    k = min(max(k, lo), hi)
    return 2.0 ** (k if k != 0 else -1)


def _prescaled(g: _Graph, y: str, spec: GraphSpec, scale: TensorProto, prescale: float) -> None:
    """``logits = float32(y) * (scale / prescale)``: the weight's real scale, applied after the GEMM.

    The division is a constant expression (folded by TensorRT and onnxruntime), so the
    checkpoint's scale stays in the graph under its own name; dividing by a power of two is exact.
    """
    post = g.node("Div", [g.init(scale), g.const("weight_prescale_f32", prescale, np.float32)])
    g.node("Mul", [g.node("Cast", [y], to=TensorProto.FLOAT), post], out=LOGITS)


def _dense(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec) -> None:
    wt = g.node("Transpose", [g.init(t[WEIGHT])], perm=[1, 0])
    if spec.dtype == "float32":
        g.node("MatMul", [x, wt], out=LOGITS)
    else:
        # float32_logits too: Cast(W) to float32 would be folded into a float32 copy of the
        # weight; the head-dtype GEMM + Cast is one 16-bit GEMM with a float32 output in TensorRT.
        g.node("Cast", [g.node("MatMul", [x, wt])], out=LOGITS, to=TensorProto.FLOAT)


def _gguf(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec) -> None:
    """Blocked ``DequantizeLinear`` (axis 0, block 32) of the stored codes laid out ``[H, V_local]``: each weight
    ``gguf.quants.dequantize``'s float32 value (Q4_1: then ``+ 8 d``, exact, and ``+ m``, one rounded add), then
    a float32 ``x @ W`` (docs/architecture.md, "GGUF heads in their stored blocks")."""
    v, h = spec.local_vocab_size, spec.hidden_size
    w = g.node("DequantizeLinear", [g.init(t[GGUF_Q]), g.init(t[GGUF_D])], axis=0, block_size=GGUF_BLOCK)
    if GGUF_M in t:  # Q4_1: + 8 d (exact), then + m (one rounding), each per block
        blocks = g.const("gguf_block_shape", [h // GGUF_BLOCK, GGUF_BLOCK, v], np.int64)
        full = g.const("gguf_weight_shape", [h, v], np.int64)
        for name in (GGUF_D8, GGUF_M):
            w = g.node("Add", [w, g.node("Reshape", [g.node("Expand", [g.init(t[name]), blocks]), full])])
    g.node("MatMul", [_to_float32(g, x, spec), w], out=LOGITS)


def _fp8(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec) -> None:
    per_row = spec.granularity is Granularity.PER_ROW
    if spec.activation is Activation.NONE and spec.dtype != "float32":
        _fp8_weight_only(g, x, t, spec)
        return
    w = g.node("DequantizeLinear", [g.init(t[WEIGHT]), g.init(t[WEIGHT_SCALE])], **({"axis": 0} if per_row else {}))
    wt = g.node("Transpose", [w], perm=[1, 0])
    x32 = _to_float32(g, x, spec)
    if spec.activation is Activation.NONE:
        g.node("MatMul", [x32, wt], out=LOGITS)
        return
    zero_point = g.init(helper.make_tensor("lm_head/fp8_zero_point", TensorProto.FLOAT8E4M3FN, [], [0.0]))
    if spec.activation is Activation.STATIC:
        scale = g.init(t[INPUT_SCALE])
        q = g.node("QuantizeLinear", [x32, scale, zero_point], saturate=1)
        xq = g.node("DequantizeLinear", [q, scale, zero_point])
        g.node("MatMul", [xq, wt], out=LOGITS)
        return
    if spec.activation is not Activation.DYNAMIC:
        raise QuantizationError(f"FP8 activation must be static, dynamic or none, got {spec.activation!r}")
    # Per-tensor scale of the rows actually multiplied: amax / 448, and 1.0 unless amax > 0
    # (an all-zero input), as trtvocab.quant.fp8.fp8_scale_from_amax.
    amax = g.node("ReduceMax", [g.node("Abs", [x32])], keepdims=0)
    scaled = g.node("Div", [amax, g.const("fp8_max", FP8_MAX, np.float32)])
    positive = g.node("Greater", [amax, g.const("zero", 0.0, np.float32)])
    scale = g.node("Where", [positive, scaled, g.const("one", 1.0, np.float32)])
    # x / s here and Q/DQ with the constant 1.0: the FP8 codes of Q(x, s), in a form TensorRT
    # fuses into an FP8 x FP8 GEMM (module docstring); s multiplies the float32 result.
    unit = g.const("fp8_unit_scale", 1.0, np.float32)
    q = g.node("QuantizeLinear", [g.node("Div", [x32, scale]), unit, zero_point], saturate=1)
    xq = g.node("DequantizeLinear", [q, unit, zero_point])
    g.node("Mul", [g.node("MatMul", [xq, wt]), scale], out=LOGITS)


def _half_const(g: _Graph, name: str, value: float, dtype: str) -> str:
    return g.init(tensor_proto(f"lm_head/{name}", torch.tensor(value, dtype=HEAD_DTYPES[dtype])))


def _fp8_weight_only(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec) -> None:
    """W8A16 in the head dtype: ``x @ (q * 2**k).T`` rounded once, times ``weight_scale / 2**k``."""
    ws = numpy_helper.to_array(t[WEIGHT_SCALE]).astype(np.float32)
    prescale = exact_prescale(float(ws.max()), WeightFormat.FP8, spec.dtype)
    w = g.node("DequantizeLinear", [g.init(t[WEIGHT]), _half_const(g, "weight_prescale", prescale, spec.dtype)])
    y = g.node("MatMul", [x, g.node("Transpose", [w], perm=[1, 0])])
    # Per row, the [V] scale vector broadcasts over the logits' columns.
    _prescaled(g, y, spec, t[WEIGHT_SCALE], prescale)


def _nvfp4(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec, rows: str) -> None:
    if spec.dequantize_fp4:
        _nvfp4_dequantized(g, x, t, spec)
        return
    block = spec.block_size
    if spec.activation is Activation.NONE and spec.dtype != "float32":
        # W4A16 in the head dtype: block scales times 2**k, then e2m1 times those, both exact.
        prescale = exact_prescale(float(numpy_helper.to_array(t[WEIGHT_SCALE_2])), WeightFormat.NVFP4, spec.dtype)
        scales = g.node("DequantizeLinear", [g.init(t[WEIGHT_SCALE]),
                                             _half_const(g, "weight_prescale", prescale, spec.dtype)])
        w = g.node("DequantizeLinear", [g.init(t[WEIGHT]), scales], axis=-1, block_size=block)
        y = g.node("MatMul", [x, g.node("Transpose", [w], perm=[1, 0])])
        _prescaled(g, y, spec, t[WEIGHT_SCALE_2], prescale)
        return
    # Two-level DQ: fp32 scales = block_scale * weight_scale_2 first, then values * scales.
    scales = g.node("DequantizeLinear", [g.init(t[WEIGHT_SCALE]), g.init(t[WEIGHT_SCALE_2])])
    w = g.node("DequantizeLinear", [g.init(t[WEIGHT]), scales], axis=-1, block_size=block)
    wt = g.node("Transpose", [w], perm=[1, 0])
    x32 = _to_float32(g, x, spec)
    if spec.activation is Activation.STATIC:
        global_scale = g.init(t[INPUT_SCALE])
        xq, xs = g.node(FP4_QUANTIZE_OP, [x32, global_scale], n_out=2, domain=TRT_DOMAIN, axis=-1,
                        block_size=block, scale_type=TensorProto.FLOAT8E4M3FN)
        # No shape inference exists for the custom op: declare its outputs.
        g.value_info += [
            helper.make_tensor_value_info(xq, TensorProto.FLOAT4E2M1, [rows, spec.hidden_size]),
            helper.make_tensor_value_info(xs, TensorProto.FLOAT8E4M3FN, [rows, spec.hidden_size // block]),
        ]
        x_scales = g.node("DequantizeLinear", [xs, global_scale])
        x32 = g.node("DequantizeLinear", [xq, x_scales], axis=-1, block_size=block)
    elif spec.activation is not Activation.NONE:
        raise QuantizationError(f"NVFP4 activation must be static or none, got {spec.activation!r}")
    g.node("MatMul", [x32, wt], out=LOGITS)


def _nvfp4_dequantized(g: _Graph, x: str, t: dict[str, TensorProto], spec: GraphSpec) -> None:
    if spec.activation is Activation.STATIC:
        raise QuantizationError(
            "dequantize_fp4 replaces only the weights: a W4A4 head still needs FP4 activation "
            "quantization (compute capability >= 10.0). Use the W4A16 head (weight_only) on this GPU")
    values = numpy_helper.to_array(t[WEIGHT]).astype(np.float32)
    block_scales = numpy_helper.to_array(t[WEIGHT_SCALE]).astype(np.float32)
    # e2m1 (2 significant bits) * e4m3 (4 bits): exact in bf16 / fp16 / fp32.
    w = values * np.repeat(block_scales, spec.block_size, axis=1)
    w_head = torch.from_numpy(w).to(HEAD_DTYPES[spec.dtype])
    if not torch.equal(w_head.float(), torch.from_numpy(w)):
        raise QuantizationError("dequantized FP4 weight is not exact in the head dtype")  # cannot happen
    wt = g.node("Transpose", [g.init(tensor_proto(WEIGHT + "_dequantized", w_head))], perm=[1, 0])
    y = g.node("MatMul", [x, wt])
    g.node("Mul", [_to_float32(g, y, spec), g.init(t[WEIGHT_SCALE_2])], out=LOGITS)


def build_model(tensors: dict[str, TensorProto], spec: GraphSpec) -> onnx.ModelProto:
    """The graph of ``spec`` over initializers named ``lm_head.weight`` etc. (see :func:`head_tensors`)."""
    g = _Graph()
    h, v = spec.hidden_size, spec.local_vocab_size
    inputs = [helper.make_tensor_value_info(HIDDEN, _ONNX_FLOAT[spec.dtype], [TOKENS_DIM, h])]
    x, rows = HIDDEN, TOKENS_DIM
    if not spec.context_logits:
        inputs.append(helper.make_tensor_value_info(SEQ_LENS, TensorProto.INT32, [BATCH_DIM]))
        ends = g.node("CumSum", [SEQ_LENS, g.const("axis0", 0, np.int32)])
        last = g.node("Sub", [ends, g.const("one_i32", 1, np.int32)])
        x, rows = g.node("Gather", [HIDDEN, last], axis=0), BATCH_DIM
    if spec.weight_format is WeightFormat.DENSE:
        _dense(g, x, tensors, spec)
    elif spec.weight_format is WeightFormat.FP8:
        _fp8(g, x, tensors, spec)
    elif spec.weight_format is WeightFormat.NVFP4:
        _nvfp4(g, x, tensors, spec, rows)
    elif spec.weight_format in GGUF_GRAPH_FORMATS:
        _gguf(g, x, tensors, spec)
    else:
        raise QuantizationError(f"no ONNX export for weight format {spec.weight_format!r}")
    if spec.lora_rank:  # a baked-in adapter: logits = x @ W.T + (x @ A^T) @ (s B^T), float32, before the ops
        for node in g.nodes:
            node.output[:] = [BASE_LOGITS if o == LOGITS else o for o in node.output]
        xf = x if spec.dtype == "float32" else g.node("Cast", [x], to=TensorProto.FLOAT)
        delta = g.node("MatMul", [g.node("MatMul", [xf, g.init(tensors[LORA_A])]), g.init(tensors[LORA_B])])
        g.node("Add", [BASE_LOGITS, delta], out=LOGITS)
    if has_head_ops(spec):  # the GEMM's output feeds the family's ops, which write the logits
        for node in g.nodes:
            node.output[:] = [GEMM_LOGITS if o == LOGITS else o for o in node.output]
        _head_ops(g, spec, tensors)
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [rows, v])]
    graph = helper.make_graph(g.nodes, f"lm_head_rank{spec.tp_rank}", inputs, outputs, g.inits,
                              value_info=g.value_info)
    opsets = [helper.make_opsetid("", spec.opset)]
    if any(n.domain == TRT_DOMAIN for n in g.nodes):
        opsets.append(helper.make_opsetid(TRT_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="trtvocab")
    model.ir_version = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    model.producer_version = __version__
    helper.set_model_props(model, spec.metadata())
    return model


# ---- files ----------------------------------------------------------------------------------
def save_model_atomic(model: onnx.ModelProto, path: str | Path, *, external_data: bool,
                      check: bool = False) -> dict[str, str]:
    """Write ``model`` to ``path`` (+ ``<name>.data``) so that a reader never sees a partial graph.

    Everything is written into a private temp folder beside ``path`` first; then the
    data file (if any) and finally the graph are moved into place with ``os.replace``.
    The graph is the commit point: it only ever names a data file that is complete.
    With ``check`` the written temp graph must pass ``onnx.checker`` (full check, by path so
    that large models work) before it is moved into place.
    On any failure the temp folder is removed and ``path`` is left as it was.
    Returns ``{file name: sha256}`` of what was written. With external data, ``model``'s
    initializers are turned into references (onnx does that in place): do not reuse it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{path.name}.data"
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        tmp_graph = tmp / path.name
        if external_data:
            # The shard's tensors (weight and scales) go to the data file; the graph's small
            # constants stay inline. Marking them by hand (rather than save_as_external_data)
            # also avoids onnx's check for a file of that name in the *working* directory.
            for tensor in model.graph.initializer:
                if tensor.name.startswith("lm_head.") and tensor.HasField("raw_data"):
                    external_data_helper.set_external_data(tensor, data_name)
        onnx.save_model(model, str(tmp_graph))
        if check:
            onnx.checker.check_model(str(tmp_graph), full_check=True)
        written = [tmp_graph] + ([tmp / data_name] if external_data else [])
        digests = {}
        for f in written:
            fsync_file(f)
            digests[f.name] = sha256_file(f)
        if external_data:
            os.replace(tmp / data_name, path.parent / data_name)
        os.replace(tmp_graph, path)
        if not external_data:
            # A data file left by an earlier external-data export of this path is stale now.
            with contextlib.suppress(FileNotFoundError):
                (path.parent / data_name).unlink()
        return digests
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tensor_infos(values: Any) -> list[GraphTensor]:
    out = []
    for vi in values:
        tt = vi.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim]
        out.append(GraphTensor(name=vi.name, dtype=_TYPE_NAMES.get(tt.elem_type, str(tt.elem_type)), shape=shape))
    return out


def _write(model: onnx.ModelProto, spec: GraphSpec, path: str | Path, external_data: bool | None,
           check: bool) -> ExportInfo:
    size = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    external = size > EXTERNAL_DATA_THRESHOLD if external_data is None else bool(external_data)
    # Read what the info needs now: an external-data save hollows the initializers out.
    inputs, outputs = _tensor_infos(model.graph.input), _tensor_infos(model.graph.output)
    ops = sorted({f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node})
    ir_version = model.ir_version
    path = Path(path)
    digests = save_model_atomic(model, path, external_data=external, check=check)
    files = [path] + ([path.parent / f"{path.name}.data"] if external else [])
    d = asdict(spec)
    return ExportInfo(
        path=str(path), data_path=str(files[1]) if external else None, sha256=digests,
        total_bytes=sum(f.stat().st_size for f in files), inputs=inputs, outputs=outputs, opset=spec.opset,
        ir_version=ir_version, ops=ops,
        **{k: d[k] for k in ("weight_format", "activation", "granularity", "context_logits", "dequantize_fp4",
                             "hidden_size", "local_vocab_size", "vocab_start", "vocab_end")},
    )


def export_onnx(
    head: LMHead,
    path: str | Path,
    *,
    context_logits: bool = False,
    opset: int = DEFAULT_OPSET,
    external_data: bool | None = None,
    dequantize_fp4: bool = False,
    check: bool = True,
    adapter: int | None = None,
) -> ExportInfo:
    """Write this rank's shard of ``head`` as one ONNX graph at ``path``.

    ``external_data`` None: weights go to ``<name>.data`` beside the graph only when they
    exceed ~1.8 GB (the protobuf limit is 2 GiB); True/False force it. ``check`` runs
    ``onnx.checker.check_model(full_check=True)``. The write is atomic (see
    :func:`save_model_atomic`). ``adapter``: bake the LoRA adapter of that index (``head.load_adapter``) into
    the graph as two float32 MatMuls added to ``x @ W.T`` before the family's ops (every row uses it); a
    head holding adapters and no ``adapter`` is refused, as is an adapter that replaces rows.
    """
    spec = spec_for_head(head, context_logits=context_logits, opset=opset, dequantize_fp4=dequantize_fp4,
                         adapter=adapter)
    model = build_model(head_tensors(head, spec, adapter), spec)
    return _write(model, spec, path, external_data, check)


def build_model_for_head(head: LMHead, *, context_logits: bool = False, opset: int = DEFAULT_OPSET,
                         dequantize_fp4: bool = False, adapter: int | None = None) -> onnx.ModelProto:
    """The in-memory graph of :func:`export_onnx`, for callers that run it without a file."""
    spec = spec_for_head(head, context_logits=context_logits, opset=opset, dequantize_fp4=dequantize_fp4,
                         adapter=adapter)
    return build_model(head_tensors(head, spec, adapter), spec)


def dequantize_fp4_onnx(src: str | Path, dst: str | Path, *, external_data: bool | None = None,
                        check: bool = True) -> ExportInfo:
    """Rewrite an exported NVFP4 graph into its Hopper variant (see module docstring).

    Rebuilt from the same initializers and metadata, not patched node by node, so the
    result is exactly what ``export_onnx(..., dequantize_fp4=True)`` writes.
    """
    model = onnx.load(str(src))
    spec = GraphSpec.from_model(model)
    if spec.weight_format is not WeightFormat.NVFP4:
        raise ConfigError(f"{src}: dequantize_fp4 applies to NVFP4 graphs, this one is {spec.weight_format}")
    if spec.dequantize_fp4:
        raise ConfigError(f"{src}: already dequantized")
    tensors = {t.name: t for t in model.graph.initializer}
    spec = replace(spec, dequantize_fp4=True)
    return _write(build_model(tensors, spec), spec, dst, external_data, check)
