"""The ONNX graph of a GGUF Q8_0 / Q4_0 / Q4_1 head's shard: blocked ``DequantizeLinear`` (opset 21,
block 32 along H).

``hidden_states [N, H]`` float32 -> ``DequantizeLinear(q [V_local, H], d float32 [V_local, H / 32],
axis=1, block_size=32)``: Q8_0 ``q`` int8, each weight ``q * d``; Q4_0 ``q - 8`` as int4 (no zero point),
``(q - 8) * d``; Q4_1 the same int4 ``(q - 8) * d``, then ``Add`` of ``8 d`` (exact: the sum ``q * d`` is a
float32) and ``Add`` of ``m``, each repeated over its block (``Expand``, ``Reshape``): ``d * q + m``, one
rounded add. Each weight is ``gguf.quants.dequantize``'s value bit for bit (the products of a small integer
and an fp16 scale are exact in float32). Signed int4 without zero points: TensorRT's ONNX parser has no
UINT4 initializers and refuses a non-zero zero point. -> ``Gemm``
(``transB``) -> the family's ops (``Add`` bias, ``Mul`` scale, ``Div`` divisor, ``Div, Tanh, Mul``
softcap, in float32) -> ``logits [N, V_local]`` float32. The GEMM's summation order is the runtime's, so
the graph equals the fallback's chain within float32 reassociation (docs/architecture.md, "GGUF heads
in their stored blocks"). ``trtvocab build`` writes the same weights inside its per-rank graph frame,
laid out ``[H, V_local]`` (:mod:`trtvocab.export.onnx`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from trtvocab.base.formats import HIDDEN, LOGITS, WeightFormat
from trtvocab.errors import ConfigError
from trtvocab.lm_head import LMHead

OPSET = 21  # blocked DequantizeLinear
BLOCK = 32


def q8_0_tensors(head: LMHead) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [V_local, H], d float32 [V_local, H / 32])`` of a Q8_0 head's owned rows."""
    raw = head.weights.export_tensors()["weight"]
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float().reshape(raw.shape[0], -1)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
    return q.numpy().copy(), d.numpy().copy()


def q4_tensors(head: LMHead) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(codes int8 [V_local, H] in -8..7 (the stored q - 8), d float32 [V_local, H / 32], m float32 or None)``
    of a Q4_0 / Q4_1 head's owned rows (element order: GGUF keeps elements ``j`` and ``j + 16`` in byte ``j``)."""
    raw = head.weights.export_tensors()["weight"]
    rows = raw.shape[0]
    size = 18 if head.weight_format is WeightFormat.GGUF_Q4_0 else 20
    blocks = raw.reshape(rows, -1, size)
    d = blocks[..., :2].contiguous().view(torch.float16).float().reshape(rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().reshape(rows, -1) if size == 20 else None
    qs = blocks[..., size - 16 :]
    codes = torch.cat([qs & 0x0F, qs >> 4], -1).reshape(rows, -1).to(torch.int8) - 8
    return codes.numpy().copy(), d.numpy().copy(), None if m is None else m.numpy().copy()


def int4_proto(name: str, values: np.ndarray) -> TensorProto:
    """``values`` (integers -8..7) as an ONNX INT4 tensor: the flattened elements' two's-complement nibbles
    packed in pairs, the first in the low nibble (an odd count padded with a zero nibble)."""
    flat = (values.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    return helper.make_tensor(name, TensorProto.INT4, list(values.shape), packed.tobytes(), raw=True)


def _dequantize(head: LMHead) -> tuple[list[TensorProto], list[onnx.NodeProto]]:
    """The initializers and nodes that make ``weight`` float32 ``[V_local, H]``, bit for bit the decode."""
    fmt = head.weight_format
    if fmt is WeightFormat.GGUF_Q8_0:
        q, d = q8_0_tensors(head)
        inits = [numpy_helper.from_array(q, "weight_q"), numpy_helper.from_array(d, "weight_d")]
        return inits, [helper.make_node("DequantizeLinear", ["weight_q", "weight_d"], ["weight"], axis=1,
                                        block_size=BLOCK)]
    if fmt not in (WeightFormat.GGUF_Q4_0, WeightFormat.GGUF_Q4_1):
        raise ConfigError(f"gguf_graph: a GGUF Q8_0, Q4_0 or Q4_1 head, got {fmt}")
    codes, d, m = q4_tensors(head)
    rows, hidden = codes.shape
    inits = [int4_proto("weight_q", codes), numpy_helper.from_array(d, "weight_d")]
    if m is None:  # Q4_0: (q - 8) * d, the signed code times d
        return inits, [helper.make_node("DequantizeLinear", ["weight_q", "weight_d"], ["weight"], axis=1,
                                        block_size=BLOCK)]
    shape = np.array([rows, hidden // BLOCK, BLOCK], dtype=np.int64)
    inits += [numpy_helper.from_array(8 * d.reshape(rows, -1, 1), "weight_d8"),
              numpy_helper.from_array(m.reshape(rows, -1, 1), "weight_m"),
              numpy_helper.from_array(shape, "block_shape"),
              numpy_helper.from_array(np.array([rows, hidden], dtype=np.int64), "weight_shape")]
    return inits, [  # Q4_1: ((q - 8) * d + 8 d) + m; the first add is exact (its sum q * d is a float32)
        helper.make_node("DequantizeLinear", ["weight_q", "weight_d"], ["weight_dq"], axis=1, block_size=BLOCK),
        helper.make_node("Expand", ["weight_d8", "block_shape"], ["weight_d8_blocks"]),
        helper.make_node("Reshape", ["weight_d8_blocks", "weight_shape"], ["weight_d8_full"]),
        helper.make_node("Add", ["weight_dq", "weight_d8_full"], ["weight_qd"]),
        helper.make_node("Expand", ["weight_m", "block_shape"], ["weight_m_blocks"]),
        helper.make_node("Reshape", ["weight_m_blocks", "weight_shape"], ["weight_m_full"]),
        helper.make_node("Add", ["weight_qd", "weight_m_full"], ["weight"])]


def gguf_graph(head: LMHead) -> onnx.ModelProto:
    """The graph of ``head``'s owned columns (module docstring)."""
    inits, nodes = _dequantize(head)
    nodes.append(helper.make_node("Gemm", [HIDDEN, "weight"], ["gemm_logits"], transB=1))
    last = "gemm_logits"
    ops = head.head_ops

    def step(op: str, value: np.ndarray, name: str) -> None:
        nonlocal last
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        nodes.append(helper.make_node(op, [last, name], [f"{name}_out"]))
        last = f"{name}_out"

    if ops.bias:
        step("Add", head.bias.detach().float().numpy(), "lm_head_bias")
    if ops.scale != 1.0:
        step("Mul", np.array(ops.scale), "logit_scale")
    if ops.divisor != 1.0:
        step("Div", np.array(ops.divisor), "logit_divisor")
    if ops.softcap:
        step("Div", np.array(ops.softcap), "softcap_in")
        nodes.append(helper.make_node("Tanh", [last], ["softcap_tanh"]))
        last = "softcap_tanh"
        step("Mul", np.array(ops.softcap), "softcap_out")
    nodes.append(helper.make_node("Identity", [last], [LOGITS]))
    graph = helper.make_graph(
        nodes, f"trtvocab_gguf_{str(head.weight_format).removeprefix('GGUF_').lower()}_head",
        [helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, ["N", head.hidden_size])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["N", head.shard.size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    for key, value in (("weight_format", str(head.weight_format)), ("vocab_start", str(head.vocab_start)),
                       ("vocab_end", str(head.vocab_end)), ("vocab_size", str(head.vocab_size))):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    return model


def q8_0_graph(head: LMHead) -> onnx.ModelProto:
    """:func:`gguf_graph` of a Q8_0 head (refuses any other format)."""
    if head.weight_format is not WeightFormat.GGUF_Q8_0:
        raise ConfigError(f"q8_0_graph: a GGUF Q8_0 head, got {head.weight_format}")
    return gguf_graph(head)


def export_gguf(head: LMHead, path: str | Path) -> Path:
    """Write :func:`gguf_graph` to ``path`` (a single file: the codes and their scales inline)."""
    path = Path(path)
    onnx.save(gguf_graph(head), str(path))
    return path


def export_q8_0(head: LMHead, path: str | Path) -> Path:
    """:func:`export_gguf` of a Q8_0 head (refuses any other format)."""
    path = Path(path)
    onnx.save(q8_0_graph(head), str(path))
    return path
