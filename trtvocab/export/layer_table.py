"""What an engine computes, read from the builder's own layer table.

With ``ProfilingVerbosity.DETAILED`` and the logger at VERBOSE, TensorRT (standard and
RTX) prints after a build one message that starts with ``Layers:``; each following line
describes one engine layer::

    Name: lm_head/MatMul_9_myl0_3, LayerType: gemm, Inputs: [ { Name: x, Dimensions: [-1,64],
    ..., Datatype: FP8, Format: ... }], Constants: [ {...} ], Outputs: [ {...} ],
    TacticName: ..., StreamId: 0, Metadata: [ONNX Layer: lm_head/MatMul_9]...

INFO lines give ``Total Weights Memory`` and ``Total Activation Memory``. This is the only
view of an engine that exists without a GPU (an engine inspector needs a deserialized
engine), so builds parse it into :class:`LayerTable` and check it against the head's
contract (:mod:`trtvocab.export.contract`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

# The builder's datatype names -> the names manifests use.
DATATYPES = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "FP8": "fp8_e4m3",
             "FP4E2M1": "fp4_e2m1", "Int32": "int32", "Int64": "int64", "UInt8": "uint8", "Int8": "int8",
             "Bool": "bool", "Int4": "int4"}
_LAYER = re.compile(r"^Name: (?P<name>.*?), LayerType: (?P<kind>[^,]*), Inputs: \[(?P<inputs>.*?)\], "
                    r"Constants: \[(?P<constants>.*?)\], Outputs: \[(?P<outputs>.*?)\], TacticName: (?P<tactic>[^,]*),"
                    r".*?Metadata: (?P<meta>.*)$")
_TENSOR = re.compile(r"\{ Name: (?P<name>[^,]*), Dimensions: \[(?P<dims>[^\]]*)\].*?Datatype: (?P<dtype>[^,}]*)")
_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]]+)\]")
_MEMORY = re.compile(r"Total (Weights|Activation) Memory: (\d+) bytes")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineTensor(_Frozen):
    """One tensor of an engine layer: its name, dims (-1 for dynamic) and datatype (manifest names)."""

    name: str
    dims: list[int]
    dtype: str


class EngineLayer(_Frozen):
    """One layer of the engine: kind (``gemm``, ``kgen``, ``runtime_fusion``, ...), its tensors,
    the tactic and the ONNX nodes it was made from."""

    name: str
    kind: str
    inputs: list[EngineTensor]
    constants: list[EngineTensor]
    outputs: list[EngineTensor]
    tactic: str
    onnx_nodes: list[str]


class LayerTable(_Frozen):
    """The parsed table, plus the builder's memory totals (None where the log had none)."""

    layers: list[EngineLayer]
    weights_bytes: int | None = None
    activation_bytes: int | None = None


def _tensors(text: str) -> list[EngineTensor]:
    out = []
    for m in _TENSOR.finditer(text):
        dims = [int(d) for d in m.group("dims").split(",") if d.strip()]
        raw = m.group("dtype").strip()
        out.append(EngineTensor(name=m.group("name").strip(), dims=dims, dtype=DATATYPES.get(raw, raw)))
    return out


def parse_layer_table(messages: list[str]) -> LayerTable:
    """Parse the builder's log messages (all of them; only the layer table and the memory totals
    are read). Raises ValueError when no ``Layers:`` message is among them."""
    table_text = next((m for m in messages if m.startswith("Layers:")), None)
    if table_text is None:
        raise ValueError("the builder printed no layer table (needs ProfilingVerbosity.DETAILED and a VERBOSE logger)")
    memory: dict[str, int] = {}
    for m in messages:
        for kind, value in _MEMORY.findall(m):
            memory[kind] = int(value)
    layers = []
    for line in table_text.split("\n\n", 1)[0].splitlines()[1:]:
        match = _LAYER.match(line.strip())
        if match is None:
            continue
        layers.append(EngineLayer(
            name=match.group("name"), kind=match.group("kind").strip(), inputs=_tensors(match.group("inputs")),
            constants=_tensors(match.group("constants")), outputs=_tensors(match.group("outputs")),
            tactic=match.group("tactic").strip(), onnx_nodes=_ONNX_LAYER.findall(match.group("meta"))))
    return LayerTable(layers=layers, weights_bytes=memory.get("Weights"), activation_bytes=memory.get("Activation"))


__all__ = ["DATATYPES", "EngineLayer", "EngineTensor", "LayerTable", "parse_layer_table"]
