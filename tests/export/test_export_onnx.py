"""ONNX export of one rank's LM head, run on CPU and compared with the PyTorch fallback.

Tolerances, and why they are what they are:

* dense bf16 / fp16: the graph and the fallback compute the same thing (GEMM with float32
  accumulation, rounded once to the head dtype); only the float32 summation order
  differs, which can flip the final rounding. Allowed: 1 ulp of the head dtype at the
  value's magnitude (``rtol = eps(dtype)``) plus a float32-order term.
* FP8 W8A16 and NVFP4 W4A16 heads in bf16 / fp16 (and ``dequantize_fp4``): the graph
  multiplies the exactly dequantized weight in the head dtype and rounds each logit once
  to it (``gemm_rounding``), the fallback keeps the float32 sum: 1 ulp of the head dtype,
  as for dense half heads.
* dense float32, W8A8 / W4A4 and float32 weight-only heads: after (bit-exact)
  quantization and dequantization both sides run a float32 GEMM; only the summation
  order (and, for dynamic FP8, where the activation scale is multiplied) differs.
  Allowed: ``1e-5 * max|logit|`` (measured error is ~1e-7 relative; an FP8/FP4
  rounding flip anywhere would be orders of magnitude larger).

The quantized heads are built two ways: with this file's own stand-in weight formats
(``_FP8Stand``/``_NVFP4Stand``: the fallback's numerics as the contract states them, for
testing the export on its own) and, when ``trtvocab.weights.fp8`` exists, with the
real PyTorch fallback heads.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch

from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig
from trtvocab.backends.onnx import fp4_dynamic_quantize, register_trt_schemas, run_onnx
from trtvocab.base.formats import Runtime, WeightFormat
from trtvocab.errors import EngineUnavailableError, InputError, QuantizationError
from trtvocab.export.onnx import (
    FP4_QUANTIZE_OP,
    TRT_DOMAIN,
    GraphSpec,
    build_model_for_head,
    dequantize_fp4_onnx,
    exact_prescale,
    export_onnx,
    fp4_proto,
    gemm_rounding,
)
from trtvocab.weights.base import WeightMethod

V, H = 37, 64  # V not divisible by 3: uneven shards 13/12/12
SEQ_LENS = torch.tensor([3, 1, 3], dtype=torch.int32)
HAVE_REAL_METHODS = importlib.util.find_spec("trtvocab.weights.fp8") is not None
HAVE_NVFP4_MODULE = importlib.util.find_spec("trtvocab.quant.nvfp4") is not None
IMPLS = ["stand-in", *(["real"] if HAVE_REAL_METHODS else [])]


# ---- the contract's numerics in torch (independent of the numpy op under test) ------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to E2M1, half to even, saturating at 6: (values, 4-bit codes)."""
    mag = a.abs().clamp(max=6.0)
    hi = torch.searchsorted(E2M1_GRID, mag).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - E2M1_GRID[lo], E2M1_GRID[hi] - mag
    idx = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    values = torch.where(a < 0, -E2M1_GRID[idx], E2M1_GRID[idx])
    return values, (idx | torch.where(a < 0, 8, 0)).to(torch.uint8)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, K] float32 -> (values [N, K], codes [N, K], block scales fp8 [N, K/16])."""
    blocks = x.reshape(x.shape[0], -1, 16)
    ratio = blocks.abs().amax(-1) / (6 * global_scale)
    bs = torch.where(ratio == 0, 1.0, ratio).clamp(2.0**-9, 448).to(torch.float8_e4m3fn)
    values, codes = e2m1(blocks / (bs.float() * global_scale).unsqueeze(-1))
    return values.reshape(x.shape), codes.reshape(x.shape), bs


def nvfp4_dequantize(values: torch.Tensor, bs: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    scales = (bs.float() * global_scale).repeat_interleave(16, dim=1)  # the fp32 product first
    return values * scales


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x / scale, -448, 448).to(torch.float8_e4m3fn).float() * scale


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    values = E2M1_GRID[codes & 7]
    return torch.where(codes >= 8, -values, values)


# ---- stand-in weight formats: the fallback contract, for testing export on its own ---------------
class _FP8Stand(WeightMethod):
    """Test double of the FP8 fallback (docs/checkpoint_formats.md numerics), not the project's implementation."""

    weight_format = WeightFormat.FP8

    def __init__(self, shard, hidden_size, dtype, quant_config, tensors):
        super().__init__(shard, hidden_size, dtype, quant_config)
        rows = slice(shard.start, shard.end)
        self.register_buffer("weight", tensors["weight"][rows].clone())
        ws = tensors["weight_scale"]
        self.register_buffer("weight_scale", ws[rows].clone() if ws.numel() > 1 else ws.clone())
        self.input_scale = tensors.get("input_scale")

    def forward(self, x):
        ws = self.weight_scale.reshape(-1, 1) if self.weight_scale.numel() > 1 else self.weight_scale
        w = self.weight.float() * ws
        xf = x.float()
        mode = self.quant_config.activation
        if mode == "static":
            xf = fp8_qdq(xf, self.input_scale)
        elif mode == "dynamic":
            amax = xf.abs().max()
            xf = fp8_qdq(xf, amax / 448 if amax > 0 else torch.tensor(1.0))
        return xf @ w.t()

    def block_logits(self, prepared, start, end):  # what LMHead.column_logits calls (prepare(x) is x here)
        return self.forward(prepared)[:, start:end]

    def export_tensors(self):
        out = {"weight": self.weight, "weight_scale": self.weight_scale}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out


class _NVFP4Stand(WeightMethod):
    """Test double of the NVFP4 fallback (docs/checkpoint_formats.md numerics), not the project's implementation."""

    weight_format = WeightFormat.NVFP4

    def __init__(self, shard, hidden_size, dtype, quant_config, tensors):
        super().__init__(shard, hidden_size, dtype, quant_config)
        rows = slice(shard.start, shard.end)
        self.register_buffer("weight", tensors["weight"][rows].clone())
        self.register_buffer("weight_scale", tensors["weight_scale"][rows].clone())
        self.weight_scale_2 = tensors["weight_scale_2"]
        self.input_scale = tensors.get("input_scale")

    def forward(self, x):
        w = nvfp4_dequantize(unpack_fp4(self.weight), self.weight_scale, self.weight_scale_2)
        xf = x.float()
        if self.quant_config.activation == "static":
            values, _, bs = nvfp4_quantize(xf, self.input_scale)
            xf = nvfp4_dequantize(values, bs, self.input_scale)
        return xf @ w.t()

    def block_logits(self, prepared, start, end):  # what LMHead.column_logits calls (prepare(x) is x here)
        return self.forward(prepared)[:, start:end]

    def export_tensors(self):
        out = {"weight": self.weight, "weight_scale": self.weight_scale, "weight_scale_2": self.weight_scale_2}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out


# ---- checkpoints and heads ----------------------------------------------------------------------
def fp8_checkpoint(w: torch.Tensor, per_row: bool, static: bool) -> dict[str, torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().max()  # per row: [V, 1]
    ws = (amax / 448).float()
    out = {"weight": (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": ws}
    if static:
        out["input_scale"] = torch.tensor(3.0 / 448)  # randn inputs: some values saturate
    return out


def nvfp4_checkpoint(w: torch.Tensor, static: bool) -> dict[str, torch.Tensor]:
    s2 = (w.abs().max() / (6 * 448)).float()
    _, codes, bs = nvfp4_quantize(w, s2)
    out = {"weight": pack_fp4(codes), "weight_scale": bs, "weight_scale_2": s2}
    if static:
        out["input_scale"] = torch.tensor(3.0 / (6 * 448))  # blocks with amax > 3 saturate
    return out


def make_head(fmt: str, *, activation: str = "none", granularity: str = "per_tensor", tp: int = 1, rank: int = 0,
              dtype: torch.dtype = torch.bfloat16, impl: str = "stand-in", seed: int = 0,
              vocab_layout: str = "uneven", vocab: int = V, hidden: int = H) -> LMHead:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5  # logits of order 1
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
    if fmt == "dense":
        head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping, vocab_layout=vocab_layout, pad_to=8)
        head.load_weights({"weight": w.to(dtype)})
        return head
    algo = QuantAlgo.FP8 if fmt == "FP8" else QuantAlgo.NVFP4
    qc = QuantConfig(quant_algo=algo, activation=activation, granularity=granularity)
    static = activation == "static"
    tensors = fp8_checkpoint(w, granularity == "per_row", static) if fmt == "FP8" else nvfp4_checkpoint(w, static)
    if impl == "real":
        head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping, quant_config=qc)
        head.load_weights(tensors)
        return head
    head = LMHead(vocab, hidden, dtype=dtype, mapping=mapping)  # dense frame, then the stand-in format
    stand = _FP8Stand if fmt == "FP8" else _NVFP4Stand
    head.weights = stand(head.shard, hidden, dtype, qc, tensors)
    head.quant_config = qc
    return head


def hidden_states(dtype: torch.dtype, seed: int = 1, hidden: int = H) -> torch.Tensor:
    return torch.randn(int(SEQ_LENS.sum()), hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fallback(head: LMHead, x: torch.Tensor, context: bool) -> torch.Tensor:
    rows = x if context else x.index_select(0, (torch.cumsum(SEQ_LENS.long(), 0) - 1))
    with torch.no_grad():
        return head.local_logits(rows)[:, : head.local_vocab_size].float()


MEASURED: dict[str, tuple[float, float]] = {}  # label -> (max abs err, max abs err / max|logit|)


def compare(label: str, got: np.ndarray, want: torch.Tensor, *, rtol: float, atol_scale: float,
            rounded: bool = False) -> None:
    """``rounded``: the graph rounds each logit to a half type where the fallback keeps float32,
    so two logits within an ulp may tie or swap: the graph's argmax must then be a logit within
    the tolerance of the row's maximum, not necessarily the same column."""
    got_t = torch.from_numpy(got)
    assert got_t.shape == want.shape, (got_t.shape, want.shape)
    err = (got_t - want).abs()
    scale = want.abs().max().item()
    rel = err.max().item() / scale
    prev = MEASURED.get(label, (0.0, 0.0))
    MEASURED[label] = (max(prev[0], err.max().item()), max(prev[1], rel))
    torch.testing.assert_close(got_t, want, rtol=rtol, atol=atol_scale * scale)
    if not rounded:
        assert torch.equal(got_t.argmax(-1), want.argmax(-1))
        return
    top = want.max(-1).values
    picked = want.gather(-1, got_t.argmax(-1, keepdim=True))[:, 0]
    assert bool(((top - picked) <= 2 * (rtol * top.abs() + atol_scale * scale)).all())


def check_graph(path: Path) -> onnx.ModelProto:
    """full_check, and only standard ops (at the model's opset) plus TRT_FP4DynamicQuantize."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    opset = next(o.version for o in model.opset_import if o.domain == "")
    for node in model.graph.node:
        if node.domain == TRT_DOMAIN:
            assert node.op_type == FP4_QUANTIZE_OP
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"axis": -1, "block_size": 16, "scale_type": onnx.TensorProto.FLOAT8E4M3FN}
        else:
            assert node.domain == "", node
            onnx.defs.get_schema(node.op_type, opset)  # raises for a non-standard op
    return model


# ---- dense ---------------------------------------------------------------------------------------
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}
EPS_BY_NAME = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def graph_rtol(model: onnx.ModelProto) -> tuple[float, str]:
    """(rtol, label suffix): one ulp of the dtype the graph's GEMM output is rounded to, else 1e-5.

    The suffix names that dtype ("bf16 GEMM" / "float16 GEMM"), which the measured-tolerance
    report reads to pick the half-precision bound.
    """
    rounding = gemm_rounding(GraphSpec.from_model(model))
    if rounding is None:
        return 1e-5, ""
    return EPS_BY_NAME[rounding], " (bf16 GEMM)" if rounding == "bfloat16" else " (float16 GEMM)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("context", [False, True], ids=["last", "context"])
def test_dense_parity(tmp_path, dtype, tp, context):
    x = hidden_states(dtype)
    for rank in range(tp):
        head = make_head("dense", tp=tp, rank=rank, dtype=dtype)
        info = export_onnx(head, tmp_path / f"rank{rank}.onnx", context_logits=context)
        check_graph(Path(info.path))
        got, backend = run_onnx(info.path, x, None if context else SEQ_LENS)
        assert backend == (Runtime.ONNXRUNTIME if dtype == torch.float32 else Runtime.ONNX_REFERENCE)
        compare(f"dense {dtype}", got, fallback(head, x, context), rtol=EPS[dtype] or 1e-5, atol_scale=1e-5)
        assert info.input_names == (["hidden_states"] if context else ["hidden_states", "seq_lens"])
        assert info.outputs[0].shape == [("num_tokens" if context else "batch"), head.local_vocab_size]
        assert info.inputs[0].dtype == str(dtype).replace("torch.", "")


def test_dense_padded_layout_exports_owned_columns_only(tmp_path):
    head = make_head("dense", tp=3, rank=2, vocab_layout="padded")
    assert head.shard.width > head.local_vocab_size  # there is padding to leave out
    info = export_onnx(head, tmp_path / "m.onnx")
    x = hidden_states(torch.bfloat16)
    got = run_onnx(info.path, x, SEQ_LENS).logits
    compare("dense padded", got, fallback(head, x, False), rtol=EPS[torch.bfloat16], atol_scale=1e-5)


def test_onnxruntime_cpu_has_no_bf16_matmul(tmp_path):
    """Why bf16 graphs run on onnx.reference: onnxruntime CPU refuses them."""
    import onnxruntime as ort

    info = export_onnx(make_head("dense"), tmp_path / "m.onnx")
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED|Could not find an implementation"):
        ort.InferenceSession(info.path, providers=["CPUExecutionProvider"])
    with pytest.raises(EngineUnavailableError, match="bfloat16"):
        run_onnx(info.path, hidden_states(torch.bfloat16), SEQ_LENS, runner="onnxruntime")


# ---- FP8 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["static", "dynamic", "none"])
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("context", [False, True], ids=["last", "context"])
def test_fp8_parity(tmp_path, impl, activation, tp, context):
    x = hidden_states(torch.bfloat16)
    for rank in range(tp):
        head = make_head("FP8", activation=activation, tp=tp, rank=rank, impl=impl)
        info = export_onnx(head, tmp_path / f"rank{rank}.onnx", context_logits=context)
        model = check_graph(Path(info.path))
        ops = {n.op_type for n in model.graph.node}
        assert ("QuantizeLinear" in ops) == (activation != "none")
        assert ("ReduceMax" in ops) == (activation == "dynamic")
        got, backend = run_onnx(info.path, x, None if context else SEQ_LENS)
        # W8A8: bf16 input fed as an OrtValue, float32 GEMM; W8A16: a bf16 GEMM (no onnxruntime kernel)
        assert backend == (Runtime.ONNX_REFERENCE if activation == "none" else Runtime.ONNXRUNTIME)
        want = fallback(head, x, context)
        rtol, kind = graph_rtol(model)
        compare(f"FP8 {activation}{kind} ({impl})", got, want, rtol=rtol, atol_scale=1e-5, rounded=bool(kind))
        ref = run_onnx(info.path, x, None if context else SEQ_LENS, runner=Runtime.ONNX_REFERENCE).logits
        compare(f"FP8 {activation}{kind} reference ({impl})", ref, want, rtol=rtol, atol_scale=1e-5,
                rounded=bool(kind))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_per_row_scales(tmp_path, impl):
    x = hidden_states(torch.bfloat16)
    for rank in range(3):
        head = make_head("FP8", activation="static", granularity="per_row", tp=3, rank=rank, impl=impl)
        info = export_onnx(head, tmp_path / "m.onnx")
        model = check_graph(Path(info.path))
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and "lm_head.weight" in n.input]
        assert [a.i for a in dq[0].attribute if a.name == "axis"] == [0]
        compare(f"FP8 per-row ({impl})", run_onnx(info.path, x, SEQ_LENS).logits, fallback(head, x, False),
                rtol=1e-5, atol_scale=1e-5)


def test_fp8_dynamic_all_zero_input_uses_scale_one(tmp_path):
    head = make_head("FP8", activation="dynamic")
    info = export_onnx(head, tmp_path / "m.onnx")
    got = run_onnx(info.path, torch.zeros(7, H, dtype=torch.bfloat16), SEQ_LENS).logits
    assert np.all(got == 0) and np.all(np.isfinite(got))


# ---- NVFP4 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["static", "none"], ids=["W4A4", "W4A16"])
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("context", [False, True], ids=["last", "context"])
def test_nvfp4_parity(tmp_path, impl, activation, tp, context):
    x = hidden_states(torch.bfloat16)
    for rank in range(tp):
        head = make_head("NVFP4", activation=activation, tp=tp, rank=rank, impl=impl)
        info = export_onnx(head, tmp_path / f"rank{rank}.onnx", context_logits=context)
        model = check_graph(Path(info.path))
        assert (f"{TRT_DOMAIN}::{FP4_QUANTIZE_OP}" in info.ops) == (activation == "static")
        w = next(t for t in model.graph.initializer if t.name == "lm_head.weight")
        assert w.data_type == onnx.TensorProto.FLOAT4E2M1 and list(w.dims) == [head.local_vocab_size, H]
        got, backend = run_onnx(info.path, x, None if context else SEQ_LENS)
        assert backend is Runtime.ONNX_REFERENCE
        rtol, kind = graph_rtol(model)
        compare(f"NVFP4 {activation}{kind} ({impl})", got, fallback(head, x, context), rtol=rtol, atol_scale=1e-5,
                rounded=bool(kind))


def test_nvfp4_graph_passes_checker_with_registered_schema(tmp_path):
    """With a schema for the custom op, full_check validates its node too (types, attributes)."""
    register_trt_schemas()
    info = export_onnx(make_head("NVFP4", activation="static"), tmp_path / "m.onnx")
    check_graph(Path(info.path))
    assert onnx.defs.has(FP4_QUANTIZE_OP, TRT_DOMAIN)


def test_fp4_packing_matches_onnx():
    """Checkpoint packing (element 2k in the low nibble) is ONNX's FLOAT4E2M1 raw layout."""
    values = torch.tensor([[0.5, 1.0, 1.5, -6.0, 0.0, 3.0, -0.5, 4.0]])
    _, codes = e2m1(values)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF3, 0x50, 0x69]]
    decoded = onnx.numpy_helper.to_array(fp4_proto("w", packed)).astype(np.float32)
    np.testing.assert_array_equal(decoded, values.numpy())
    np.testing.assert_array_equal(values.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32), decoded)


def test_fp4_dynamic_quantize_matches_contract():
    """The numpy op against this file's torch recipe: bit-exact, ties and saturation included."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen) * 2
    x[0, :16] = 0.0  # an all-zero block: scale 1.0, values 0
    x[2, :16] = 1e-30  # a tiny block: scale clamps to 2**-9 (the smallest E4M3 subnormal)
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, 7.0, -100.0, 0, 0, 0, 0])
    gs = torch.tensor(1.0 / (6 * 448)) * 6  # block amax 6 -> block scale 448 (clamped above for row 1)
    values, scales = fp4_dynamic_quantize(x.numpy(), gs.numpy())
    want_values, _, want_bs = nvfp4_quantize(x, gs)
    np.testing.assert_array_equal(values, want_values.numpy())
    np.testing.assert_array_equal(scales, want_bs.float().numpy())
    assert scales[0, 0] == 1.0 and np.all(values[0, :16] == 0)
    assert scales[2, 0] == 2.0**-9
    assert scales[1, 0] == 448.0  # block amax 100 > 6 * 6 * global: clamped, values saturate at 6
    if HAVE_NVFP4_MODULE:  # and the project's own NVFP4 numerics agree, bit for bit
        from trtvocab.quant.nvfp4 import fake_quant_activation

        dq = values * np.repeat(scales * gs.numpy(), 16, axis=1)
        np.testing.assert_array_equal(dq, fake_quant_activation(x, gs).numpy())


def test_dequantize_fp4_variant(tmp_path):
    """Hopper variant: the W4A16 numbers with a dense head-dtype weight and no FP4 tensors."""
    x = hidden_states(torch.bfloat16)
    for rank in range(3):
        head = make_head("NVFP4", activation="none", tp=3, rank=rank)
        info = export_onnx(head, tmp_path / "direct.onnx", dequantize_fp4=True)
        model = check_graph(Path(info.path))
        types = {t.data_type for t in model.graph.initializer}
        assert onnx.TensorProto.FLOAT4E2M1 not in types and onnx.TensorProto.BFLOAT16 in types
        # bf16 GEMM output (rounded once) times weight_scale_2: 1 bf16 ulp of the fallback's fp32 result.
        compare("NVFP4 dequantize_fp4 (bf16 GEMM)", run_onnx(info.path, x, SEQ_LENS).logits, fallback(head, x, False),
                rtol=2.0**-7, atol_scale=1e-5, rounded=True)
        native = export_onnx(head, tmp_path / "native.onnx")
        rebuilt = dequantize_fp4_onnx(native.path, tmp_path / "rebuilt.onnx")
        assert Path(rebuilt.path).read_bytes() == Path(info.path).read_bytes()


def test_dequantize_fp4_refuses_w4a4(tmp_path):
    head = make_head("NVFP4", activation="static")
    with pytest.raises(QuantizationError, match="W4A4"):
        export_onnx(head, tmp_path / "m.onnx", dequantize_fp4=True)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize(("fmt", "activation", "dtype"), [
    ("dense", "none", torch.bfloat16), ("dense", "none", torch.float16), ("dense", "none", torch.float32),
    ("FP8", "static", torch.bfloat16), ("FP8", "dynamic", torch.bfloat16), ("FP8", "none", torch.bfloat16),
    ("NVFP4", "static", torch.bfloat16), ("NVFP4", "none", torch.bfloat16),
])
def test_parity_at_a_larger_shape(tmp_path, fmt, activation, dtype):
    """H = 1024, V = 1000: summation-order differences at a realistic reduction length."""
    impl = "real" if HAVE_REAL_METHODS else "stand-in"
    head = make_head(fmt, activation=activation, dtype=dtype, impl=impl, vocab=1000, hidden=1024)
    x = hidden_states(dtype, hidden=1024)
    info = export_onnx(head, tmp_path / "m.onnx")
    rtol, kind = graph_rtol(onnx.load(info.path))
    compare(f"{fmt} {activation} {dtype}{kind} H=1024 ({impl})", run_onnx(info.path, x, SEQ_LENS).logits,
            fallback(head, x, False), rtol=rtol, atol_scale=1e-5, rounded=bool(kind) and fmt != "dense")


# ---- graph forms (what TensorRT compiles them to: tests/export/test_engine_graphs.py) ---------------------
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]
E2M1_BY_E4M3 = (E2M1_GRID[:, None] * E4M3_VALUES[None, :]).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", [WeightFormat.FP8, WeightFormat.NVFP4], ids=str)
def test_exact_prescale_keeps_every_dequantized_weight_exact(dtype, fmt):
    """Every e4m3 code (FP8) or e2m1 x e4m3 product (NVFP4) times the chosen 2**k is a value
    of the head dtype, for scales from tiny to huge; 2**k follows the scale inside that range."""
    values = E4M3_VALUES if fmt is WeightFormat.FP8 else E2M1_BY_E4M3
    name = str(dtype).replace("torch.", "")
    seen = set()
    for log2 in range(-40, 41):
        p = exact_prescale(2.0**log2 * 1.3, fmt, name)
        assert p != 1.0 and p == 2.0 ** round(np.log2(p))
        scaled = values.double() * p
        assert torch.equal(scaled.to(dtype).double(), scaled), (log2, p)
        seen.add(p)
    assert exact_prescale(2.0**-12, fmt, name) == 2.0**-12  # typical weight scales are not clamped
    assert exact_prescale(1.0, fmt, name) == 0.5  # never 1.0 (TensorRT drops it and the fusion with it)
    # The clamp is tight for fp16: one power of two further and the values stop being exact.
    if dtype == torch.float16:
        lo, hi = min(seen), max(seen)
        for out in (lo / 2, hi * 2):
            scaled = values.double() * out
            assert not torch.equal(scaled.to(dtype).double(), scaled)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _matmul(model: onnx.ModelProto) -> onnx.NodeProto:
    (mm,) = [n for n in model.graph.node if n.op_type == "MatMul"]
    return mm


def _elem_type(model: onnx.ModelProto, name: str) -> int:
    inferred = onnx.shape_inference.infer_shapes(model)
    values = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    return values[name].type.tensor_type.elem_type


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("fmt", "granularity"), [("FP8", "per_tensor"), ("FP8", "per_row"), ("NVFP4", "per_tensor")])
def test_weight_only_graph_multiplies_in_the_head_dtype(tmp_path, dtype, fmt, granularity):
    """W8A16 / W4A16: no float32 activation or weight: the MatMul's operands are the head dtype,
    the DQ scale is a power of two in the head dtype, and the real scale multiplies the output."""
    head = make_head(fmt, granularity=granularity, dtype=dtype, impl="real" if HAVE_REAL_METHODS else "stand-in")
    model = build_model_for_head(head)
    onnx.checker.check_model(model, full_check=True)
    half = onnx.TensorProto.BFLOAT16 if dtype == torch.bfloat16 else onnx.TensorProto.FLOAT16
    mm = _matmul(model)
    assert [_elem_type(model, i) for i in mm.input] == [half, half]
    inits = {t.name: t for t in model.graph.initializer}
    prescale = onnx.numpy_helper.to_array(inits["lm_head/weight_prescale"]).astype(np.float64)
    assert inits["lm_head/weight_prescale"].data_type == half and prescale != 1.0
    assert prescale == 2.0 ** round(np.log2(prescale))
    assert "Cast" in _ops(model) and _ops(model)[-1] == "Mul"  # float32 output times the scale
    assert gemm_rounding(GraphSpec.from_model(model)) == str(dtype).replace("torch.", "")
    x = hidden_states(dtype)
    compare(f"{fmt} {granularity} weight-only {dtype} (bf16 GEMM)" if dtype == torch.bfloat16 else
            f"{fmt} {granularity} weight-only (float16 GEMM)", run_onnx(model, x, SEQ_LENS).logits,
            fallback(head, x, False), rtol=EPS[dtype], atol_scale=1e-5, rounded=True)


def test_float32_weight_only_graph_stays_float32():
    head = make_head("FP8", dtype=torch.float32, impl="real" if HAVE_REAL_METHODS else "stand-in")
    model = build_model_for_head(head)
    assert [_elem_type(model, i) for i in _matmul(model).input] == [onnx.TensorProto.FLOAT] * 2
    assert gemm_rounding(GraphSpec.from_model(model)) is None


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
def test_fp8_dynamic_graph_quantizes_with_a_constant_scale(granularity):
    """The computed amax/448 divides x before Q and multiplies the GEMM output; the Q/DQ pair
    itself has constant scales (what TensorRT needs for an FP8 x FP8 GEMM)."""
    head = make_head("FP8", activation="dynamic", granularity=granularity,
                     impl="real" if HAVE_REAL_METHODS else "stand-in")
    model = build_model_for_head(head)
    inits = {t.name for t in model.graph.initializer}
    q = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    dq_x = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q[0].output[0]]
    assert len(q) == 1 and len(dq_x) == 1
    assert q[0].input[1] in inits and dq_x[0].input[1] in inits
    producers = {o: n for n in model.graph.node for o in n.output}
    assert producers[q[0].input[0]].op_type == "Div"
    last = model.graph.node[-1]
    assert last.op_type == "Mul" and producers[last.input[1]].op_type == "Where"  # times the dynamic scale
    assert [_elem_type(model, i) for i in _matmul(model).input] == [onnx.TensorProto.FLOAT] * 2


def test_float32_logits_graph_has_no_float32_weight():
    """output_dtype=float32 on a bf16 head: the same bf16 GEMM as the plain head (no Cast of W,
    which TensorRT folds into a float32 copy of it), rounded once (gemm_rounding) then cast."""
    head = make_head("dense")
    head.output_dtype = torch.float32
    model = build_model_for_head(head)
    spec = GraphSpec.from_model(model)
    assert spec.float32_logits and gemm_rounding(spec) == "bfloat16"
    producers = {o: n for n in model.graph.node for o in n.output}
    assert producers[_matmul(model).input[1]].op_type == "Transpose"
    assert [_elem_type(model, i) for i in _matmul(model).input] == [onnx.TensorProto.BFLOAT16] * 2
    x = hidden_states(torch.bfloat16)
    compare("dense output_dtype=float32 (bf16 GEMM)", run_onnx(model, x, SEQ_LENS).logits,
            fallback(head, x, False), rtol=EPS[torch.bfloat16], atol_scale=1e-5, rounded=True)


def test_graph_metadata_carries_deterministic():
    head = LMHead(V, H, dtype=torch.float32, deterministic=True)
    head.load_weights({"weight": torch.randn(V, H)})
    model = build_model_for_head(head)
    assert GraphSpec.from_model(model).deterministic is True
    assert {p.key: p.value for p in model.metadata_props}["trtvocab.deterministic"] == "True"
    assert GraphSpec.from_model(build_model_for_head(make_head("dense"))).deterministic is False


# ---- files ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["FP8", "NVFP4"])  # onnxruntime and onnx.reference read the data file
def test_external_data(tmp_path, fmt):
    head = make_head(fmt, activation="static", tp=3, rank=1)
    path = tmp_path / "lm_head.onnx"
    info = export_onnx(head, path, external_data=True)
    data = tmp_path / "lm_head.onnx.data"
    assert info.data_path == str(data) and data.is_file()
    assert set(info.sha256) == {"lm_head.onnx", "lm_head.onnx.data"}
    from trtvocab.artifact.store import sha256_file

    assert info.sha256["lm_head.onnx.data"] == sha256_file(data)
    assert info.sha256["lm_head.onnx"] == sha256_file(path)
    hollow = onnx.load(str(path), load_external_data=False)
    locations = {e.value for t in hollow.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"lm_head.onnx.data"}  # relative: the folder can move
    x = hidden_states(torch.bfloat16)
    compare(f"{fmt} static external data", run_onnx(path, x, SEQ_LENS).logits, fallback(head, x, False),
            rtol=1e-5, atol_scale=1e-5)
    # Re-exporting inline removes the stale data file.
    export_onnx(head, path, external_data=False)
    assert not data.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_head.onnx"]


@pytest.mark.parametrize("external", [False, True])
def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch, external):
    path = tmp_path / "lm_head.onnx"
    head = make_head("dense")
    export_onnx(head, path)
    before = path.read_bytes()
    real_save = onnx.save_model

    def save_then_fail(model, f, *args, **kwargs):
        real_save(model, f, *args, **kwargs)
        with open(f, "r+b") as fh:  # a half-written graph ...
            fh.truncate(os.path.getsize(f) // 2)
        raise OSError("disk full")  # ... and then the failure

    monkeypatch.setattr(onnx, "save_model", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        export_onnx(make_head("dense", seed=7), path, external_data=external)
    assert path.read_bytes() == before  # the earlier graph is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_head.onnx"]  # no temp folder, no .data
    monkeypatch.undo()
    fresh = tmp_path / "fresh.onnx"
    monkeypatch.setattr(onnx, "save_model", save_then_fail)
    with pytest.raises(OSError):
        export_onnx(head, fresh, external_data=external)
    assert not fresh.exists()


# ---- inputs ----------------------------------------------------------------------------------------
def test_run_onnx_validates_inputs(tmp_path):
    info = export_onnx(make_head("FP8", activation="static"), tmp_path / "m.onnx")
    x = hidden_states(torch.bfloat16)
    with pytest.raises(InputError, match="sum to 6"):
        run_onnx(info.path, x, torch.tensor([3, 1, 2], dtype=torch.int32))
    with pytest.raises(InputError, match="takes bfloat16"):
        run_onnx(info.path, x.float(), SEQ_LENS)
    with pytest.raises(InputError, match=r"\[T, 64\]"):
        run_onnx(info.path, x[:, :32], SEQ_LENS)
    with pytest.raises(InputError, match="backend"):
        run_onnx(info.path, x, SEQ_LENS, runner="cuda")
    # seq_lens None = one sequence: the last row; numpy bf16 input works too.
    got = run_onnx(build_model_for_head(make_head("FP8", activation="static")), x.view(torch.int16).numpy()
                   .view(ml_dtypes.bfloat16)).logits
    np.testing.assert_allclose(got, run_onnx(info.path, x, [7]).logits, rtol=0, atol=0)
    fp4 = export_onnx(make_head("NVFP4", activation="static"), tmp_path / "fp4.onnx")
    with pytest.raises(EngineUnavailableError, match="TRT_FP4DynamicQuantize"):
        run_onnx(fp4.path, x, SEQ_LENS, runner="onnxruntime")


def test_context_graph_validates_but_ignores_seq_lens(tmp_path):
    head = make_head("dense", dtype=torch.float32)
    info = export_onnx(head, tmp_path / "m.onnx", context_logits=True)
    x = hidden_states(torch.float32)
    np.testing.assert_array_equal(run_onnx(info.path, x, SEQ_LENS).logits, run_onnx(info.path, x).logits)
    with pytest.raises(InputError):
        run_onnx(info.path, x, [1, 1])


def test_measured_tolerances_report(capsys):
    """Prints the max abs / rel errors measured above and checks them together: float32
    paths (quantized, dense fp32) within 1e-5 of max|logit|, half-precision within one ulp."""
    if not MEASURED:
        pytest.skip("nothing measured: run together with the export parity tests")
    for label, (_, rel_err) in MEASURED.items():
        half = "float16" in label or "bf16" in label  # (also matches bfloat16)
        assert rel_err <= (2.0**-7 if half else 1e-5), label
    with capsys.disabled():
        for label, (abs_err, rel_err) in sorted(MEASURED.items()):
            print(f"\n  {label:45s} max abs {abs_err:.3g}  max abs / max|logit| {rel_err:.3g}", end="")
        print()


def test_onnxruntime_sessions_take_this_processs_thread_share_and_never_spin() -> None:
    """N ranks on one host each get cores // N torch threads; onnxruntime's default (every core, pool
    threads spinning between ops) would make N pools fight over the same cores."""
    pytest.importorskip("onnxruntime")
    from trtvocab.backends.onnx import session_options

    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            options = session_options()
            assert options.intra_op_num_threads == threads
            assert options.inter_op_num_threads == 1
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        torch.set_num_threads(before)
