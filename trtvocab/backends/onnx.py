"""The ONNX backend: run one rank's exported LM-head graph on the CPU.

It serves ``infer`` with ``backend`` ``onnx`` and the build's check of every exported graph
against the PyTorch fallback. Which runtime runs which graph (``runner="auto"``)::

    FP8 W8A8 graphs, float32 heads  onnxruntime CPU (float32 GEMM; FP8 Q/DQ kernels exist)
    dense bf16 / fp16, FP8 W8A16    onnx.reference: no bf16 MatMul kernel; fp16 MatMul unrounded
    NVFP4 graphs                    onnx.reference: no FLOAT4E2M1 kernels, no TRT_FP4DynamicQuantize

``onnx.reference`` (numpy, slow but exact about types) gets two additions here: TensorRT's
dynamic NVFP4 activation quantizer ``TRT_FP4DynamicQuantize`` (domain ``trt``) and a ``MatMul``
for bf16 / fp16 operands that accumulates in float32 and rounds once to the operand type (what
tensor cores and PyTorch's CPU GEMM do). What ran is a :class:`~trtvocab.base.formats.Runtime`.
The reasons and the quantizer's definition: the section "runtimes and TRT_FP4DynamicQuantize" below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from trtvocab.artifact.manifest import Manifest
from trtvocab.backends.base import RankLogits
from trtvocab.base.dtypes import DTYPES, dtype_name
from trtvocab.base.formats import HIDDEN, LOGITS, SEQ_LENS, Runtime
from trtvocab.base.inputs import check_hidden_states, last_token_rows
from trtvocab.base.safe_read import open_regular
from trtvocab.errors import ArtifactError, EngineUnavailableError, InputError
from trtvocab.export.onnx import FP4_QUANTIZE_OP, TRT_DOMAIN
from trtvocab.quant.fp8 import FP8_MAX
from trtvocab.quant.nvfp4 import BLOCK, SCALE_MIN
from trtvocab.quant.nvfp4 import E2M1_MAX as _E2M1_MAX

# ---- runtimes and TRT_FP4DynamicQuantize ----------------------------------------------------------
# Which runtime runs which graph (runner="auto"):
#
#     FP8 W8A8 graphs, float32 heads onnxruntime CPU (float32 GEMM; FP8 Q/DQ kernels exist)
#     dense bfloat16 / float16,      onnx.reference: onnxruntime CPU has no bf16 MatMul
#     FP8 W8A16 bf16 / fp16          kernel ("NOT_IMPLEMENTED"), and runs fp16 MatMul in
#                                    float32 without rounding the output to fp16, which is
#                                    not what the graph does (these graphs multiply in the
#                                    head dtype: trtvocab.export.onnx.gemm_rounding)
#     NVFP4 graphs                   onnx.reference: onnxruntime has no FLOAT4E2M1 kernels
#                                    and no TRT_FP4DynamicQuantize
#
# ``TRT_FP4DynamicQuantize(x, double_quant_scale) -> (x_fp4, block_scales_fp8)``, attributes
# ``axis`` (-1), ``block_size`` (16), ``scale_type`` (17 = FLOAT8E4M3FN). Sources: TensorRT's
# operator reference "DynamicQuantize" (inputs ``input`` T1 in {float16, bfloat16, float32} and
# a scalar build-time-constant ``double_quant_scale``; outputs FP4 data and FP8 scales of the
# input's shape with the blocked axis divided by 16) and ModelOpt 0.47's ONNX export
# (``_fp4_dynamic_quantize``: op ``trt::TRT_FP4DynamicQuantize``, attrs ``axis``, ``block_size``,
# ``scale_type``, two outputs, followed by ``DequantizeLinear(scales, global)`` and a blocked
# ``DequantizeLinear(x_fp4, scales_f32)``). The numbers are trtvocab's NVFP4 recipe
# (trtvocab.quant.nvfp4), per block of 16 along ``axis``:
#
#     block_scale = e4m3(clamp(S, 2**-9, 448)),  S = amax(|block|) / (6 * global), S == 0 -> 1.0
#     x_fp4       = e2m1(clamp(x / (block_scale * global), -6, 6))     round half to even


ONNX_RUNTIMES = (Runtime.ONNXRUNTIME, Runtime.ONNX_REFERENCE)  # what runs a graph here
# The runner a caller chooses: "auto" (the module docstring), or one of ONNX_RUNTIMES by value
# ("reference" is accepted as the older name of "onnx.reference").
RUNNERS = ("auto", *(r.value for r in ONNX_RUNTIMES))
E2M1_MAX = np.float32(_E2M1_MAX)
E4M3_MAX = np.float32(FP8_MAX)
BLOCK_SCALE_MIN = np.float32(SCALE_MIN)  # smallest E4M3 subnormal: a block scale never underflows to 0
_NP_INPUT = {TensorProto.BFLOAT16: ml_dtypes.bfloat16, TensorProto.FLOAT16: np.float16,
             TensorProto.FLOAT: np.float32}


# ---- numerics ---------------------------------------------------------------------------------
def fp4_dynamic_quantize(x: np.ndarray, global_scale: Any, block_size: int = BLOCK,
                         axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 block quantization of ``x`` under ``global_scale``, all in float32.

    Returns ``(values, block_scales)`` as float32 arrays that hold exactly E2M1 and E4M3
    values: ``values`` has ``x``'s shape, ``block_scales`` has ``axis`` divided by ``block_size``.
    """
    x = np.moveaxis(np.asarray(x).astype(np.float32), axis, -1)
    if x.shape[-1] % block_size:
        raise InputError(f"{FP4_QUANTIZE_OP}: axis of size {x.shape[-1]} is not divisible by block {block_size}")
    gs = np.float32(np.asarray(global_scale, dtype=np.float32).reshape(()))
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    ratio = amax / (E2M1_MAX * gs)
    # An all-zero block gets scale 1.0 (as trtvocab.quant.nvfp4 and ModelOpt); its values are 0 anyway.
    block_scale = np.clip(np.where(ratio == 0, np.float32(1.0), ratio), BLOCK_SCALE_MIN, E4M3_MAX)
    block_scale = block_scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scaled = np.clip(blocks / (block_scale * gs), -E2M1_MAX, E2M1_MAX)
    # ml_dtypes' E2M1 cast rounds to nearest, ties to even (checked in the tests).
    values = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(x.shape)
    return np.moveaxis(values, -1, axis), np.moveaxis(block_scale[..., 0], -1, axis)


class TRT_FP4DynamicQuantize(OpRun):  # named as the op: the evaluator dispatches on the class name
    """TensorRT's dynamic NVFP4 quantizer for ``onnx.reference`` (defined in the section
    "runtimes and TRT_FP4DynamicQuantize" above)."""

    op_domain = TRT_DOMAIN

    def _run(self, x, double_quant_scale, axis=-1, block_size=BLOCK, scale_type=TensorProto.FLOAT8E4M3FN):
        if scale_type != TensorProto.FLOAT8E4M3FN:
            raise InputError(f"{FP4_QUANTIZE_OP}: scale_type must be FLOAT8E4M3FN (17), got {scale_type}")
        if np.asarray(double_quant_scale).size != 1:
            raise InputError(f"{FP4_QUANTIZE_OP}: double_quant_scale must be a scalar")
        values, scales = fp4_dynamic_quantize(x, double_quant_scale, block_size, axis)
        return values.astype(ml_dtypes.float4_e2m1fn), scales.astype(ml_dtypes.float8_e4m3fn)


class MatMul(OpRun):
    """MatMul with float32 accumulation for bf16 / fp16 operands, rounded once to their type."""

    op_domain = ""

    def _run(self, a, b):
        if a.dtype in (ml_dtypes.bfloat16, np.float16):
            return (np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype),)
        return (np.matmul(a, b),)


REFERENCE_OPS = [TRT_FP4DynamicQuantize, MatMul]


def register_trt_schemas() -> None:
    """Register an ONNX schema for ``trt::TRT_FP4DynamicQuantize`` (idempotent).

    Without it ``onnx.checker`` skips the node (unknown domain); with it the checker
    validates the node's inputs, outputs and attribute types as well.
    """
    if onnx.defs.has(FP4_QUANTIZE_OP, TRT_DOMAIN):
        return
    S = onnx.defs.OpSchema
    schema = S(
        FP4_QUANTIZE_OP, TRT_DOMAIN, 1,
        "TensorRT dynamic NVFP4 block quantization (IDynamicQuantizeLayer).",
        inputs=[S.FormalParameter("input", "T1"), S.FormalParameter("double_quant_scale", "T2")],
        outputs=[S.FormalParameter("output_data", "T3"), S.FormalParameter("output_scale", "T4")],
        type_constraints=[
            ("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "input"),
            ("T2", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "scalar global scale"),
            ("T3", ["tensor(float4e2m1)"], "quantized data"),
            ("T4", ["tensor(float8e4m3fn)"], "block scales"),
        ],
        attributes=[
            S.Attribute("axis", S.AttrType.INT, "blocked axis (last or second to last)", required=False),
            S.Attribute("block_size", S.AttrType.INT, "elements per block (16)", required=False),
            S.Attribute("scale_type", S.AttrType.INT, "scale element type (17 = FLOAT8E4M3FN)", required=False),
        ],
    )
    onnx.defs.register_schema(schema)


# ---- running a graph --------------------------------------------------------------------------
def _load(path_or_model: str | Path | onnx.ModelProto) -> tuple[onnx.ModelProto, Path | None]:
    """The model and its path; from a path, without external data (loaded only where needed)."""
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model, None
    path = Path(path_or_model)
    if not os.path.lexists(path):
        raise InputError(f"no ONNX graph at {path}")
    with open_regular(path, "ONNX graph", InputError) as fh:  # never a FIFO or a device
        return onnx.load_model_from_string(fh.read()), path


def external_data_files(model: onnx.ModelProto) -> set[str]:
    """The ``location`` of every initializer stored outside the graph file."""
    out = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            out.update(e.value for e in tensor.external_data if e.key == "location")
    return out


def onnxruntime_blocker(model: onnx.ModelProto) -> str | None:
    """Why onnxruntime CPU cannot run ``model`` at all (None: it can)."""
    if any(n.domain == TRT_DOMAIN for n in model.graph.node):
        return f"it uses {FP4_QUANTIZE_OP}, a TensorRT op onnxruntime does not have"
    types = {t.data_type for t in model.graph.initializer}
    if TensorProto.FLOAT4E2M1 in types:
        return "onnxruntime has no FLOAT4E2M1 kernels"
    if TensorProto.BFLOAT16 in types:
        return "onnxruntime CPU has no bfloat16 MatMul kernel"
    return None


def reference_reason(model: onnx.ModelProto) -> str | None:
    """Why ``backend="auto"`` runs ``model`` on ``onnx.reference`` (None: onnxruntime runs it)."""
    blocker = onnxruntime_blocker(model)
    if blocker is None and any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer):
        return "onnxruntime CPU runs float16 MatMul in float32 without the graph's float16 rounding"
    return blocker


def _hidden_array(hidden: Any, elem_type: int, width: int) -> np.ndarray:
    """``hidden`` (torch tensor or numpy array) as the graph's input array, validated."""
    want = _NP_INPUT.get(elem_type)
    if want is None:
        raise InputError(f"graph input {HIDDEN} has unsupported type {elem_type}")
    if isinstance(hidden, torch.Tensor):
        t = hidden.detach().cpu().contiguous()
        name = dtype_name(t.dtype) if t.dtype in DTYPES else None
    else:
        arr = np.ascontiguousarray(hidden)
        name = arr.dtype.name
        # numpy bf16 (ml_dtypes) has no torch twin: read its bits as int16 and view them back.
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if arr.dtype == ml_dtypes.bfloat16 \
            else torch.from_numpy(arr) if arr.dtype in (np.float16, np.float32) else None
    if name != np.dtype(want).name or t is None:
        raise InputError(f"{HIDDEN}: the graph takes {np.dtype(want).name}, got {name or hidden.dtype}")
    check_hidden_states(t, hidden_size=width, what=HIDDEN)
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def session_options() -> Any:
    """The ``onnxruntime.SessionOptions`` of every trtvocab session: the graph's arithmetic kept,
    this process's share of the cores, no spinning."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Basic (constant folding, redundant-node removal) keeps the graph's arithmetic; the
    # extended fusions could swap Q/DQ + MatMul for other kernels.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    # torch's thread count is this process's share of the cores (run_ranks gives each of N ranks
    # cores // N); onnxruntime's default is every core, each pool thread spinning between ops, so N
    # ranks on one host would spin N pools against each other (measured: 4x slower decode steps).
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _ort_session(model: onnx.ModelProto, path: Path | None) -> Any:
    import onnxruntime as ort

    source = str(path) if path is not None else model.SerializeToString()
    return ort.InferenceSession(source, session_options(), providers=["CPUExecutionProvider"])


def _ort_run(session: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    values = {}
    for name, arr in feeds.items():
        if arr.dtype == ml_dtypes.bfloat16:
            values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16),
                                                                           TensorProto.BFLOAT16)
        else:
            values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
    return session.run_with_ort_values([LOGITS], values)[0].numpy()


def parse_runner(choice: Any) -> Runtime | None:
    """The runtime a runner choice names (None: ``"auto"``); anything else is an InputError."""
    if choice == "auto":
        return None
    try:
        runtime = Runtime(choice)
    except ValueError:
        runtime = None
    if runtime not in ONNX_RUNTIMES:
        raise InputError(f"runner (the ONNX backend's runtime) must be one of {RUNNERS}, got {choice!r}")
    return runtime


class OnnxRun(NamedTuple):
    """What :func:`run_onnx` computed, and which runtime computed it."""

    logits: np.ndarray  # float32 [B, V_local] (or [T, V_local] for a context graph)
    runner: Runtime  # ONNXRUNTIME or ONNX_REFERENCE


class OnnxGraph:
    """An exported head graph, loaded once, with its runtime picked once (and onnxruntime's
    session built once): what a decode loop calls every step.

    Args:
        path_or_model: the graph file (its external data beside it) or an in-memory model.
        runner: ``"auto"`` (see the module docstring), or one of :data:`ONNX_RUNTIMES`
            (``"onnxruntime"``, ``"onnx.reference"``; ``"reference"`` too).
    """

    def __init__(self, path_or_model: str | Path | onnx.ModelProto, runner: str = "auto") -> None:
        chosen = parse_runner(runner)
        self.model, self.path = _load(path_or_model)
        self.inputs = {vi.name: vi for vi in self.model.graph.input}
        if HIDDEN not in self.inputs:
            raise InputError(f"graph has no {HIDDEN!r} input (inputs: {sorted(self.inputs)})")
        if chosen is None:
            chosen = Runtime.ONNX_REFERENCE if reference_reason(self.model) else Runtime.ONNXRUNTIME
        self.runner: Runtime = chosen
        blocker = onnxruntime_blocker(self.model) if self.runner is Runtime.ONNXRUNTIME else None
        if blocker is not None:
            raise EngineUnavailableError(f"onnxruntime cannot run this graph: {blocker}; "
                                         f"use runner={Runtime.ONNX_REFERENCE.value!r}")
        self._session: Any = None
        self._evaluator: Any = None

    def run(self, hidden: Any, seq_lens: Any = None) -> OnnxRun:
        """Float32 logits of ``hidden [T, H]`` (see :func:`run_onnx`)."""
        tt = self.inputs[HIDDEN].type.tensor_type
        arr = _hidden_array(hidden, tt.elem_type, tt.shape.dim[1].dim_value)
        total = arr.shape[0]
        feeds = {HIDDEN: arr}
        if seq_lens is not None or SEQ_LENS in self.inputs:
            lens = [total] if seq_lens is None else seq_lens
            last_token_rows(lens, total)  # validated even where unused (context graphs), like LogitsProcessor
            if SEQ_LENS in self.inputs:
                feeds[SEQ_LENS] = np.asarray(lens.cpu() if isinstance(lens, torch.Tensor) else lens, dtype=np.int32)
        self.load()
        if self.runner is Runtime.ONNXRUNTIME:
            out = _ort_run(self._session, feeds)
        else:
            out = self._evaluator.run([LOGITS], feeds)[0]
        return OnnxRun(np.asarray(out, dtype=np.float32), self.runner)

    def load(self) -> None:
        """Create the runtime (onnxruntime's session, or the reference evaluator with the external
        data) if it does not exist yet; :meth:`run` calls it, a runner that wants the cost up front too."""
        if self.runner is Runtime.ONNXRUNTIME:
            if self._session is None:
                self._session = _ort_session(self.model, self.path)
        elif self._evaluator is None:
            if self.path is not None:
                onnx.load_external_data_for_model(self.model, str(self.path.parent))
            self._evaluator = ReferenceEvaluator(self.model, new_ops=REFERENCE_OPS)


def run_onnx(
    path_or_model: str | Path | onnx.ModelProto,
    hidden: Any,
    seq_lens: Any = None,
    runner: str = "auto",
) -> OnnxRun:
    """Float32 logits of an exported head graph on CPU, and the runtime that produced them.

    ``hidden``: ``[T, H]`` torch tensor or numpy array in the graph's input dtype (bf16 as
    ``torch.bfloat16`` or ``ml_dtypes.bfloat16``). ``seq_lens``: the packed lengths; None
    means one sequence (the last row). Context graphs have no ``seq_lens`` input: a given
    one is validated and otherwise unused. ``runner``: as for :class:`OnnxGraph`. One call,
    one graph load: a loop that
    runs a graph many times keeps an :class:`OnnxGraph`.
    """
    return OnnxGraph(path_or_model, runner).run(hidden, seq_lens)


class OnnxBackend:
    """``rank{r}/lm_head.onnx`` on the CPU: onnxruntime, or ``onnx.reference`` for graphs
    onnxruntime has no kernels for (bf16, FP4) — :attr:`RankLogits.ran_on` says which."""

    name = "onnx"

    def __init__(self, root: Path, manifest: Manifest, rank: int) -> None:
        rel = manifest.entry(rank).files.onnx
        if rel is None:
            raise EngineUnavailableError(f"rank {rank} of {root} has no ONNX graph")
        self.path = Path(root) / rel
        self.context = manifest.head.context_logits
        # Loaded once, kept for every later step: the session is created after the checks below, at
        # open, so a decode loop's first step times the multiply, not onnxruntime's start-up.
        self._graph = OnnxGraph(self.path)
        # The graph must be what the manifest says it is, and read nothing the manifest does not list.
        model = self._graph.model
        has_lens = SEQ_LENS in {vi.name for vi in model.graph.input}
        if has_lens == self.context:
            raise ArtifactError(f"{self.path}: graph {'takes' if has_lens else 'lacks'} {SEQ_LENS}, but the manifest "
                                f"says context_logits = {self.context} (field head.context_logits)")
        folder = rel.rsplit("/", 1)[0]
        for loc in sorted(external_data_files(model)):
            if "/" in loc or "\\" in loc or loc in ("", ".", "..") or f"{folder}/{loc}" not in manifest.files:
                raise ArtifactError(f"{self.path}: external data {loc!r} is not a file of the rank folder listed in "
                                    "the manifest")
        self._graph.load()

    def rank_logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> RankLogits:
        lens = None if self.context or seq_lens is None else seq_lens.to(torch.int32)
        out = self._graph.run(hidden, lens)
        return RankLogits(torch.from_numpy(out.logits), out.runner)
