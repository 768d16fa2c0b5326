"""The ONNX graph of a GGUF Q8_0 head's shard: blocked ``DequantizeLinear`` (opset 21, block 32 along H).

``hidden_states [N, H]`` float32 -> ``DequantizeLinear(q int8 [V_local, H], d float32 [V_local, H / 32],
axis=1, block_size=32)`` (each weight ``q * d``: ``gguf.quants.dequantize``'s value, exact) -> ``Gemm``
(``transB``) -> the family's ops (``Add`` bias, ``Mul`` scale, ``Div`` divisor, ``Div, Tanh, Mul``
softcap, in float32) -> ``logits [N, V_local]`` float32. The GEMM's summation order is the runtime's, so
the graph equals the fallback's chain within float32 reassociation (docs/architecture.md, "GGUF heads
in their stored blocks").
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


def q8_0_graph(head: LMHead) -> onnx.ModelProto:
    """The graph of ``head``'s owned columns (module docstring)."""
    if head.weight_format is not WeightFormat.GGUF_Q8_0:
        raise ConfigError(f"q8_0_graph: a GGUF Q8_0 head, got {head.weight_format}")
    q, d = q8_0_tensors(head)
    inits = [numpy_helper.from_array(q, "weight_q"), numpy_helper.from_array(d, "weight_d")]
    nodes = [helper.make_node("DequantizeLinear", ["weight_q", "weight_d"], ["weight"], axis=1, block_size=BLOCK),
             helper.make_node("Gemm", [HIDDEN, "weight"], ["gemm_logits"], transB=1)]
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
        nodes, "trtvocab_gguf_q8_0_head",
        [helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, ["N", head.hidden_size])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["N", head.shard.size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    for key, value in (("weight_format", str(head.weight_format)), ("vocab_start", str(head.vocab_start)),
                       ("vocab_end", str(head.vocab_end)), ("vocab_size", str(head.vocab_size))):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    return model


def export_q8_0(head: LMHead, path: str | Path) -> Path:
    """Write :func:`q8_0_graph` to ``path`` (a single file: the int8 codes and their scales inline)."""
    path = Path(path)
    onnx.save(q8_0_graph(head), str(path))
    return path
