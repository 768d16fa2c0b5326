"""What each exported graph must compile to, and the check of an engine's layer table against it.

=========================  ==============================================================
graph                      the engine's GEMM (activation x weight -> output)
=========================  ==============================================================
dense bf16 / fp16 / fp32   head dtype x head dtype (weight resident in the head dtype)
``output_dtype=float32``   the same 16-bit operands: no float32 copy of the weight
FP8 W8A8 (static, dyn.)    FP8 x FP8
FP8 W8A16 (weight-only)    head dtype x FP8, the FP8 weight resident (no per-call copy)
NVFP4 W4A4                 FP4 x FP4 (FP8 block scales)
NVFP4 W4A16                head dtype x FP4, the FP4 weight resident
NVFP4 ``dequantize_fp4``   head dtype x head dtype (Hopper: W4A16 numbers)
embedding dense / FP8      a lookup table in the head dtype / in 1-byte codes
=========================  ==============================================================

The hardware datatypes a graph needs (:class:`~trtvocab.export.targets.HwType`) are read
from the graph's own tensor types, plus a float32 GEMM where the contract has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtvocab.base.formats import EMBED_IDS, HIDDEN, Activation, WeightFormat
from trtvocab.errors import ArtifactError
from trtvocab.export.layer_table import EngineLayer, EngineTensor, LayerTable
from trtvocab.export.records import EngineCompute, GemmRecord
from trtvocab.export.targets import HwType
from trtvocab.quant import gguf_blocks

_HEAD_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
_GEMM_KINDS = ("gemm", "runtime_fusion")


@dataclass(frozen=True)
class Expected:
    """The contract of one graph: allowed datatypes of the GEMM's activation and weight (or of the
    embedding table), and in words. Every contract keeps the weight a constant of the engine."""

    graph: str  # "lm_head" | "embedding"
    activation: frozenset[str]
    weight: frozenset[str]
    text: str


@dataclass(frozen=True)
class GraphInfo:
    """An exported graph as the builder sees it: kind, shapes, format, contract, hardware needs."""

    graph: str  # "lm_head" | "embedding"
    weight_format: WeightFormat
    dtype: str
    hidden_size: int
    rows: int  # the weight's (or table's) rows as exported: V_local (+1 zero row for a table)
    dequantize_fp4: bool
    deterministic: bool
    context_logits: bool
    inputs: list[str]
    expected: Expected
    needs: frozenset[HwType]


# A GGUF graph's stored codes as the builder may keep them for a fused weight-only GEMM (the block table's onnx_codes).
_GGUF_CODES = {t.weight_format: frozenset({t.onnx_codes}) for t in gguf_blocks.BLOCK_TYPES.values() if t.onnx_codes}


def _expected_head(fmt: WeightFormat, activation: Activation, dtype: str, dequantized: bool) -> Expected:
    head = _HEAD_DTYPE[dtype]
    if fmt in _GGUF_CODES:  # blocked DequantizeLinear, then a float32 GEMM (the activation cast up)
        codes = _GGUF_CODES[fmt]
        name = gguf_blocks.of_format(fmt).name
        return Expected("lm_head", frozenset({"float32"}), codes | {"float32"},
                        f"GGUF {name} blocked DequantizeLinear: a float32 x {'/'.join(sorted(codes))} weight-only "
                        f"GEMM where the builder fuses it, else a float32 GEMM on a dequantized copy (recorded)")
    if fmt is WeightFormat.DENSE or dequantized:
        what = "NVFP4 dequantize_fp4" if dequantized else f"dense {head}"
        return Expected("lm_head", frozenset({head}), frozenset({head}),
                        f"{what}: a {head} x {head} GEMM")
    code = {WeightFormat.FP8: "fp8_e4m3", WeightFormat.NVFP4: "fp4_e2m1"}[fmt]
    if activation is Activation.NONE:
        bits = "8" if fmt is WeightFormat.FP8 else "4"
        return Expected("lm_head", frozenset({head}), frozenset({code}),
                        f"{fmt} weight-only: a {head} x {code} GEMM on {bits}-bit weights resident in the engine")
    return Expected("lm_head", frozenset({code}), frozenset({code}),
                    f"{fmt} {activation}: a {code} x {code} GEMM")


def _expected_table(fmt: WeightFormat, dtype: str) -> Expected:
    if fmt is WeightFormat.FP8:
        return Expected("embedding", frozenset(), frozenset({"fp8_e4m3", "uint8", "int8"}),
                        "FP8 embedding: a 1-byte lookup table")
    return Expected("embedding", frozenset(), frozenset({_HEAD_DTYPE[dtype]}),
                    f"dense embedding: a {dtype} lookup table")


def _graph_types(model: Any) -> set[int]:
    """Every element type the graph names: inputs, outputs, initializers, value infos, Cast targets."""
    from onnx import AttributeProto

    g = model.graph
    types = {t.data_type for t in g.initializer}
    for vi in [*g.input, *g.output, *g.value_info]:
        types.add(vi.type.tensor_type.elem_type)
    for node in g.node:
        for attr in node.attribute:
            if attr.name in ("to", "output_dtype", "scale_type") and attr.type == AttributeProto.INT:
                types.add(attr.i)
    return types


def describe_graph(onnx_path: Path) -> GraphInfo:
    """Read an exported graph's header (weights not loaded) into its :class:`GraphInfo`."""
    import onnx
    from onnx import TensorProto

    from trtvocab.export.onnx import GraphSpec

    if not onnx_path.is_file():
        raise ArtifactError(f"no ONNX graph at {onnx_path}")
    model = onnx.load(str(onnx_path), load_external_data=False)
    inputs = [vi.name for vi in model.graph.input]
    props = {p.key: p.value for p in model.metadata_props}
    types = _graph_types(model)
    needs = set()
    if TensorProto.BFLOAT16 in types:
        needs.add(HwType.BF16)
    if TensorProto.FLOAT8E4M3FN in types:
        needs.add(HwType.FP8)
    if TensorProto.FLOAT4E2M1 in types:
        needs.add(HwType.FP4)
    if props.get("trtvocab.kind") == "embedding":
        if EMBED_IDS not in inputs:
            raise ArtifactError(f"{onnx_path}: no {EMBED_IDS!r} input (inputs: {inputs}); not a trtvocab embedding")
        fmt, dtype = WeightFormat(props["trtvocab.weight_format"]), props["trtvocab.dtype"]
        rows = int(props["trtvocab.vocab_end"]) - int(props["trtvocab.vocab_start"]) + 1
        return GraphInfo("embedding", fmt, dtype, int(props["trtvocab.hidden_size"]), rows, False, False, False,
                         inputs, _expected_table(fmt, dtype), frozenset(needs))
    if HIDDEN not in inputs:
        raise ArtifactError(f"{onnx_path}: no {HIDDEN!r} input (inputs: {inputs}); not a trtvocab LM-head graph")
    spec = GraphSpec.from_model(model)
    expected = _expected_head(spec.weight_format, spec.activation, spec.dtype, spec.dequantize_fp4)
    if "float32" in expected.activation:
        needs.add(HwType.FP32_GEMM)
    return GraphInfo("lm_head", spec.weight_format, spec.dtype, spec.hidden_size, spec.local_vocab_size,
                     spec.dequantize_fp4, spec.deterministic, spec.context_logits, inputs,
                     expected, frozenset(needs))


def _engine_rows(t: EngineTensor, info: GraphInfo) -> int | None:
    """The rows of ``t`` if it is the weight (``[H, rows]`` or ``[rows, H]``), else None. The
    builder may pad ``rows`` up: it pads an odd GEMM N to an aligned one and slices the output."""
    if len(t.dims) != 2 or -1 in t.dims or info.hidden_size not in t.dims:
        return None
    other = t.dims[1] if t.dims[0] == info.hidden_size else t.dims[0]
    return other if info.rows <= other < info.rows + 256 else None


def _is_weight_shaped(t: EngineTensor, info: GraphInfo) -> bool:
    return _engine_rows(t, info) is not None


def _weight_operand(layer: EngineLayer, info: GraphInfo) -> tuple[EngineTensor, bool] | None:
    """The layer's weight-shaped operand and whether it is a constant of the engine (else computed)."""
    for resident, tensors in ((True, layer.constants), (False, layer.inputs)):
        for t in tensors:
            if _is_weight_shaped(t, info):
                return t, resident
    return None


def _gemm(table: LayerTable, info: GraphInfo) -> tuple[GemmRecord, int] | None:
    """The GEMM's record and the weight rows it reads (padded, where the builder pads)."""
    candidates = [layer for layer in table.layers if _weight_operand(layer, info) is not None]
    gemms = [layer for layer in candidates if layer.kind in _GEMM_KINDS] or candidates
    if not gemms:
        return None
    layer = gemms[-1]  # a per-call dequantize kernel comes first; the GEMM consumes its output
    weight, resident = _weight_operand(layer, info)  # type: ignore[misc]
    source = None
    if not resident:  # computed per call: from which constant (through which layers)?
        producers = [p for p in table.layers if any(o.name == weight.name for o in p.outputs)]
        source = next((c.dtype for p in producers for c in p.constants if _is_weight_shaped(c, info)), None)
    acts = [t for t in layer.inputs if len(t.dims) == 2 and t.dims[-1] == info.hidden_size and t.dims[0] == -1]
    record = GemmRecord(layer=layer.name, kind=layer.kind, activation=acts[0].dtype if acts else None,
                        weight=weight.dtype, weight_resident=resident,
                        output=layer.outputs[0].dtype if layer.outputs else None, weight_source=source)
    return record, _engine_rows(weight, info) or info.rows


def check_engine(table: LayerTable, info: GraphInfo) -> EngineCompute:
    """The engine's :class:`EngineCompute`: its GEMM (or table) and every break of the contract."""
    kinds: dict[str, int] = {}
    for layer in table.layers:
        kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
    exp = info.expected
    problems: list[str] = []
    notes: list[str] = []
    common: dict[str, Any] = {"layers": len(table.layers), "kinds": kinds, "weights_bytes": table.weights_bytes,
                              "activation_bytes": table.activation_bytes, "expected": exp.text}
    if info.graph == "embedding":
        found = None
        for layer in table.layers:
            operand = _weight_operand(layer, info)
            if operand is not None:
                found = operand[0].dtype
                if found not in exp.weight:
                    problems.append(f"layer {layer.name}: the lookup table is {found} in the engine; "
                                    f"the contract is {exp.text}")
                break
        if found is None:
            problems.append(f"no engine layer holds the {info.rows} x {info.hidden_size} table ({exp.text})")
        return EngineCompute(table=found, problems=problems, **common)
    found = _gemm(table, info)
    gemm: GemmRecord | None = None
    weight_path: str | None = None
    if found is None:
        problems.append(f"no engine layer multiplies by the {info.rows} x {info.hidden_size} weight ({exp.text})")
    else:
        gemm, rows = found
        where = f"layer {gemm.layer} ({gemm.kind})"
        if gemm.activation not in exp.activation:
            problems.append(f"{where}: activation {gemm.activation}, the contract wants {sorted(exp.activation)} "
                            f"({exp.text})")
        # Computed per call: a dequantize (another datatype) breaks the contract; a copy in the
        # weight's own datatype (the builder pads an odd number of rows this way) is a note.
        dequantized_per_call = not gemm.weight_resident and gemm.weight_source != gemm.weight
        if dequantized_per_call:
            problems.append(f"{where}: the weight operand is {gemm.weight} computed on every call"
                            + (f" from the {gemm.weight_source} constant" if gemm.weight_source else "")
                            + f", not resident in the engine ({exp.text})")
        elif gemm.weight not in exp.weight:
            problems.append(f"{where}: weight operand {gemm.weight}, the contract wants {sorted(exp.weight)} "
                            f"({exp.text})")
        if info.weight_format in _GGUF_CODES:  # either way is allowed; what the engine runs is recorded
            dequantized_per_call = False
            problems = [p for p in problems if "weight operand" not in p]
            weight_path = _gguf_weight_path(gemm, info)
            notes.append(f"{where}: {weight_path}")
        if not gemm.weight_resident and not dequantized_per_call and info.weight_format not in _GGUF_CODES:
            notes.append(f"{where}: the {gemm.weight} weight is copied on every call (padded to {rows} rows); "
                         "an even shard avoids it")
    return EngineCompute(gemm=gemm, problems=problems, notes=notes, weight_path=weight_path, **common)


def _gguf_weight_path(gemm: GemmRecord, info: GraphInfo) -> str:
    """What a GGUF graph's engine multiplies by, in words: the stored codes (a fused weight-only GEMM) or a
    dequantized copy (resident, or computed on every call), never left unsaid."""
    if gemm.weight in ("int8", "int4"):
        return (f"fused weight-only GEMM: {gemm.activation} x {gemm.weight} on the stored codes"
                + (" resident in the engine" if gemm.weight_resident else " (copied per call)"))
    if gemm.weight_resident:
        return f"dequantized copy: a {gemm.weight} weight resident in the engine (the blocks folded at build time)"
    return (f"dequantized copy: a {gemm.weight} weight computed on every call"
            + (f" from the {gemm.weight_source} constant" if gemm.weight_source else ""))


__all__ = ["Expected", "GraphInfo", "check_engine", "describe_graph"]
