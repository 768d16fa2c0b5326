"""What TensorRT compiles each exported graph to: real TensorRT-RTX builds, read from the layer table.

TensorRT-RTX builds engines ahead of time without a GPU; with ``ProfilingVerbosity.DETAILED``
its VERBOSE log lists every engine layer with the datatypes of its inputs and constants, and
INFO gives ``Total Weights Memory``. For each graph kind these tests build a small engine
(one target: SM89, SM120 where FP4 needs it) and check

* the GEMM layer (the one built from the graph's MatMul): its activation and weight datatypes,
  and whether the weight is a constant of the engine (resident) or a tensor some other layer
  writes on every call (a per-call dequantized copy);
* the engine's weight bytes against the graph's initializer bytes (a folded float32 copy of a
  16-bit weight, or uint8 codes widened to int32, would be 2x or 4x).

Each expectation is the graph's intent (``trtvocab.export.onnx`` docstring); the one the
compiler cannot meet (NVFP4 W4A16: no FP4 weight-only GEMM in TensorRT-RTX 1.7.1, the FP4
weight is dequantized to a head-dtype buffer per call) is asserted as what it is, so a
compiler that starts fusing it shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

trt = pytest.importorskip("tensorrt_rtx")

from trtvocab import LMHead, QuantAlgo, QuantConfig  # noqa: E402
from trtvocab.embedding import VocabParallelEmbedding  # noqa: E402
from trtvocab.export.embedding import build_embedding_model  # noqa: E402
from trtvocab.export.layer_table import EngineLayer, EngineTensor, LayerTable, parse_layer_table  # noqa: E402
from trtvocab.export.onnx import build_model_for_head  # noqa: E402
from trtvocab.quant import fp8  # noqa: E402
from trtvocab.quant.writer import quantize_head_tensors  # noqa: E402

V, H = 256, 128  # weights large enough that the engine's own constants are small beside them
F32, BF16, F16, FP8, FP4 = "float32", "bfloat16", "float16", "fp8_e4m3", "fp4_e2m1"


# ---- building and reading an engine -----------------------------------------------------------------
class _Logger(trt.ILogger):
    def __init__(self) -> None:
        trt.ILogger.__init__(self)
        self.messages: list[str] = []

    def log(self, severity, msg) -> None:
        self.messages.append(msg)


def build(model, sm: str = "89") -> LayerTable:
    """Parse and AOT-build ``model`` for one compute capability; the engine's layer table."""
    logger = _Logger()
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    config.num_compute_capabilities = 1
    config.set_compute_capability({"89": trt.ComputeCapability.SM89, "120": trt.ComputeCapability.SM120}[sm], 0)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.name == "hidden_states":
            profile.set_shape(tensor.name, (1, H), (4, H), (16, H))
        else:  # seq_lens [B] or input_ids [T]
            profile.set_shape(tensor.name, (1,), (2,), (8,))
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    assert blob is not None, [m for m in logger.messages if "rror" in m][-3:]
    table = parse_layer_table(logger.messages)
    assert table.weights_bytes is not None
    return table


def onnx_weight_bytes(model) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def _weight_shaped(t: EngineTensor, rows: int) -> bool:
    return sorted(t.dims) == sorted([rows, H])


@dataclass
class Gemm:
    layer: EngineLayer
    activation: str
    weight: str
    resident: bool  # the weight is a constant of the engine, not a tensor written per call


def gemm(engine: LayerTable, rows: int = V) -> Gemm:
    """The engine layer built from the graph's MatMul, with its activation and weight operands."""
    layers = [x for x in engine.layers if any("MatMul" in n for n in x.onnx_nodes)
              and x.kind in ("gemm", "runtime_fusion")]
    assert len(layers) == 1, [(x.name, x.kind, x.onnx_nodes) for x in engine.layers]
    layer = layers[0]
    acts = [t for t in layer.inputs if t.dims == [-1, H]]
    weights = [(t, True) for t in layer.constants if _weight_shaped(t, rows)]
    weights += [(t, False) for t in layer.inputs if _weight_shaped(t, rows)]
    assert len(acts) == 1 and len(weights) == 1, layer
    return Gemm(layer, acts[0].dtype, weights[0][0].dtype, weights[0][1])


def per_call_weight_copies(engine: LayerTable, rows: int = V) -> list[EngineTensor]:
    """Weight-shaped tensors some layer writes on every call (a dequantized copy of the weight)."""
    return [t for x in engine.layers for t in x.outputs if _weight_shaped(t, rows)]


def assert_weight_bytes(engine: LayerTable, model) -> None:
    """The engine holds the graph's weights at their own width: within a few percent of the
    initializers (the builder adds small constants and alignment), never 2x or 4x."""
    stored = onnx_weight_bytes(model)
    assert 0.97 * stored <= engine.weights_bytes <= 1.06 * stored + 1024, (engine.weights_bytes, stored)


# ---- heads ------------------------------------------------------------------------------------------
def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed)) * H**-0.5


def dense_head(dtype: torch.dtype, **kwargs) -> LMHead:
    head = LMHead(V, H, dtype=dtype, **kwargs)
    head.load_weights({"weight": _weight().to(dtype)})
    return head


def quant_head(algo: QuantAlgo, activation: str, dtype: torch.dtype = torch.bfloat16,
               granularity: str = "per_tensor") -> LMHead:
    config = QuantConfig(quant_algo=algo, activation=activation, granularity=granularity)
    head = LMHead(V, H, dtype=dtype, quant_config=config)
    head.load_weights(quantize_head_tensors(_weight(), config, input_amax=3.0 if activation == "static" else None))
    return head


HALF = [torch.bfloat16, torch.float16]
_NAME = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}


# ---- dense ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", [False, True], ids=["last", "context"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_dense_gemm_in_the_head_dtype(dtype, context):
    model = build_model_for_head(dense_head(dtype), context_logits=context)
    engine = build(model)
    g = gemm(engine)
    assert (g.activation, g.weight, g.resident) == (_NAME[dtype], _NAME[dtype], True)
    assert g.layer.outputs[0].dtype == F32  # the Cast to float32 logits is fused into the GEMM
    assert_weight_bytes(engine, model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_output_dtype_float32_keeps_the_16_bit_weight(dtype):
    """Before: Cast(W) was folded into a float32 weight (2x the bytes, a float32 GEMM)."""
    model = build_model_for_head(dense_head(dtype, output_dtype=torch.float32))
    engine = build(model)
    g = gemm(engine)
    assert (g.activation, g.weight, g.resident) == (_NAME[dtype], _NAME[dtype], True)
    assert g.layer.outputs[0].dtype == F32
    assert_weight_bytes(engine, model)


# ---- FP8 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
@pytest.mark.parametrize("activation", ["static", "dynamic"])
def test_fp8_w8a8_is_an_fp8_gemm(activation, granularity):
    """Dynamic too: before, the computed scale in the Q/DQ pair gave a float32 x FP8 kernel."""
    model = build_model_for_head(quant_head(QuantAlgo.FP8, activation, granularity=granularity))
    engine = build(model)
    g = gemm(engine)
    assert (g.layer.kind, g.activation, g.weight, g.resident) == ("gemm", FP8, FP8, True)
    assert_weight_bytes(engine, model)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_fp8_weight_only_is_16_bit_times_resident_fp8(dtype, granularity):
    """Before: x was cast to float32 (a float32 x FP8 kernel)."""
    model = build_model_for_head(quant_head(QuantAlgo.FP8, "none", dtype, granularity))
    engine = build(model)
    g = gemm(engine)
    assert (g.activation, g.weight, g.resident) == (_NAME[dtype], FP8, True)
    assert per_call_weight_copies(engine) == []  # no dequantized weight written per call
    assert_weight_bytes(engine, model)


def test_fp8_weight_only_float32_head_stays_float32():
    model = build_model_for_head(quant_head(QuantAlgo.FP8, "none", torch.float32))
    engine = build(model)
    g = gemm(engine)
    assert (g.activation, g.weight, g.resident) == (F32, FP8, True)
    assert_weight_bytes(engine, model)


# ---- NVFP4 ------------------------------------------------------------------------------------------
def test_nvfp4_w4a4_is_an_fp4_gemm():
    model = build_model_for_head(quant_head(QuantAlgo.NVFP4, "static"))
    engine = build(model, "120")
    g = gemm(engine)
    assert (g.layer.kind, g.activation, g.weight, g.resident) == ("gemm", FP4, FP4, True)
    assert_weight_bytes(engine, model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_nvfp4_w4a16_keeps_fp4_weights_and_a_16_bit_gemm(dtype):
    """The weight stays 4-bit in the engine and the GEMM is 16 x 16 bit (before: float32 x float32
    over a float32 copy of the weight). TensorRT-RTX 1.7.1 has no FP4 weight-only GEMM: one kernel
    dequantizes the FP4 weight into a head-dtype buffer per call (INT4 in the same form fuses)."""
    model = build_model_for_head(quant_head(QuantAlgo.NVFP4, "none", dtype))
    engine = build(model, "120")
    g = gemm(engine)
    assert (g.activation, g.weight) == (_NAME[dtype], _NAME[dtype])
    copies = per_call_weight_copies(engine)
    assert [t.dtype for t in copies] == [_NAME[dtype]]  # one head-dtype buffer, never float32
    assert not g.resident  # the known limitation; a fused FP4 weight-only GEMM would fail this
    (dequant,) = [x for x in engine.layers if any(t.dtype == FP4 and _weight_shaped(t, V) for t in x.constants)]
    assert any(t.dtype == FP8 for t in dequant.constants)  # the block scales stay FP8
    assert_weight_bytes(engine, model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_nvfp4_dequantize_fp4_is_a_16_bit_gemm(dtype):
    model = build_model_for_head(quant_head(QuantAlgo.NVFP4, "none", dtype), dequantize_fp4=True)
    engine = build(model)
    g = gemm(engine)
    assert (g.activation, g.weight, g.resident) == (_NAME[dtype], _NAME[dtype], True)
    assert_weight_bytes(engine, model)


# ---- embedding --------------------------------------------------------------------------------------
def _table(engine: LayerTable, rows: int) -> EngineTensor:
    (table,) = [t for x in engine.layers for t in x.constants if _weight_shaped(t, rows)]
    return table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_embedding_table_in_the_head_dtype(dtype):
    emb = VocabParallelEmbedding(V, H, dtype=dtype, reduce_output=False)
    emb.load_weights({"weight": _weight().to(dtype)})
    model = build_embedding_model(emb)
    engine = build(model)
    assert _table(engine, V + 1).dtype == _NAME[dtype]
    assert_weight_bytes(engine, model)


@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
def test_fp8_embedding_table_is_one_byte_codes(per_row):
    """Before: uint8 codes, which TensorRT's parser widens to int32 (4x the table)."""
    q, s = fp8.quantize_fp8(_weight(), per_row=per_row)
    config = QuantConfig(quant_algo=QuantAlgo.FP8, activation="none",
                         granularity="per_row" if per_row else "per_tensor")
    emb = VocabParallelEmbedding(V, H, dtype=torch.bfloat16, quant_config=config, reduce_output=False)
    emb.load_weights({"weight": q, "weight_scale": s.reshape(-1) if per_row else s})
    model = build_embedding_model(emb)
    engine = build(model)
    assert _table(engine, V + 1).dtype == FP8
    assert per_call_weight_copies(engine, V + 1) == []  # the gather reads the codes; no dequantized table
    assert_weight_bytes(engine, model)
