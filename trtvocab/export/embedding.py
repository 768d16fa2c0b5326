"""One rank's masked embedding lookup as an ONNX graph (the all-reduce stays outside).

Ids this rank does not own (and invalid ones) index an all-zero row appended to the shard, so the
graph outputs this rank's partial rows and summing the ranks' outputs gives the full lookup (one
owner per id). An FP8 table stays 1-byte codes: a DequantizeLinear before the Gather, then a cast
to the head dtype, with the module's numbers.

The node layout and why (the zero row instead of a float ``Where``, the dequantize before the
Gather): docs/architecture.md, "The input end: VocabParallelEmbedding".
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper
from pydantic import BaseModel, ConfigDict

from trtvocab.base.dtypes import dtype_name
from trtvocab.base.formats import EMBED_IDS, EMBED_ROWS, WeightFormat
from trtvocab.embedding import VocabParallelEmbedding
from trtvocab.errors import ConfigError
from trtvocab.export.onnx import DEFAULT_OPSET, save_model_atomic, tensor_proto
from trtvocab.version import __version__

_ONNX_FLOAT = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
_META = "trtvocab."


class EmbeddingExport(BaseModel):
    """What :func:`export_embedding_onnx` wrote."""

    model_config = ConfigDict(frozen=True)

    path: str
    sha256: dict[str, str]
    vocab_start: int
    vocab_end: int
    hidden_size: int
    dtype: str
    weight_format: WeightFormat


def _i64(name: str, value: int) -> TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [], [int(value)])


def build_embedding_model(emb: VocabParallelEmbedding, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """The graph of the module docstring for this rank's shard of ``emb``."""
    if emb.adapters:
        raise ConfigError(f"embedding export: the table holds LoRA adapters {emb.adapter_names}, which the graph "
                          "would drop; export the base table (docs/architecture.md, 'LoRA adapters')")
    size, hidden = emb.shard.size, emb.hidden_size
    fmt = emb.weight_format
    if fmt not in (WeightFormat.DENSE, WeightFormat.FP8):
        raise ConfigError(f"embedding export supports dense and FP8 tables, got {fmt}")
    dtype = dtype_name(emb.dtype)
    inits = [_i64("embedding/start", emb.shard.start), _i64("embedding/size", size), _i64("embedding/zero", 0)]
    nodes = [
        helper.make_node("Sub", [EMBED_IDS, "embedding/start"], ["local"]),
        helper.make_node("GreaterOrEqual", ["local", "embedding/zero"], ["ge"]),
        helper.make_node("Less", ["local", "embedding/size"], ["lt"]),
        helper.make_node("And", ["ge", "lt"], ["mine"]),
        helper.make_node("Where", ["mine", "local", "embedding/size"], ["index"]),
    ]
    stored = emb.weights.weight[:size]
    if fmt is WeightFormat.DENSE:
        table = torch.cat([stored, stored.new_zeros(1, hidden)])
        inits.append(tensor_proto("embedding.weight", table))
        nodes.append(helper.make_node("Gather", ["embedding.weight", "index"], [EMBED_ROWS], axis=0))
    else:
        codes = torch.cat([stored.view(torch.uint8), torch.zeros(1, hidden, dtype=torch.uint8)])
        inits.append(helper.make_tensor("embedding.weight", TensorProto.FLOAT8E4M3FN, list(codes.shape),
                                        codes.numpy().tobytes(), raw=True))
        scale = emb.weights.weight_scale
        dq_attrs = {}
        if emb.weights.per_row:
            # Scale 1.0 for the zero row: its codes are +0, so its rows are +0 as the module's
            # (zeroed codes and scales); TensorRT refuses a DequantizeLinear scale that is not > 0.
            inits.append(tensor_proto("embedding.weight_scale",
                                      torch.cat([scale[:size].reshape(size).float(), torch.ones(1)])))
            dq_attrs["axis"] = 0
        else:
            inits.append(tensor_proto("embedding.weight_scale", scale.reshape(()).float()))
        nodes += [helper.make_node("DequantizeLinear", ["embedding.weight", "embedding.weight_scale"], ["table"],
                                   **dq_attrs),
                  helper.make_node("Gather", ["table", "index"], ["rows_f32"], axis=0)]
        if dtype == "float32":
            nodes.append(helper.make_node("Identity", ["rows_f32"], [EMBED_ROWS]))
        else:
            nodes.append(helper.make_node("Cast", ["rows_f32"], [EMBED_ROWS], to=_ONNX_FLOAT[dtype]))
    ops = emb.embedding_ops
    if not ops.is_identity:  # the family's scale (Gemma's sqrt(H)): as the module multiplies, in float32
        nodes[-1].output[:] = ["rows_unscaled"]
        scale = torch.tensor(ops.scale, dtype=torch.float32)
        if ops.round_scale:
            scale = scale.to(emb.dtype).float()
        inits.append(tensor_proto("embedding/scale", scale))
        if dtype == "float32":
            nodes.append(helper.make_node("Mul", ["rows_unscaled", "embedding/scale"], [EMBED_ROWS]))
        else:  # a 16-bit row times the scale is computed in float32 and rounded once, as torch does
            nodes += [helper.make_node("Cast", ["rows_unscaled"], ["rows_unscaled_f32"], to=TensorProto.FLOAT),
                      helper.make_node("Mul", ["rows_unscaled_f32", "embedding/scale"], ["rows_scaled_f32"]),
                      helper.make_node("Cast", ["rows_scaled_f32"], [EMBED_ROWS], to=_ONNX_FLOAT[dtype])]
    graph = helper.make_graph(
        nodes, f"embedding_rank{emb.tp_rank}",
        [helper.make_tensor_value_info(EMBED_IDS, TensorProto.INT64, ["num_tokens"])],
        [helper.make_tensor_value_info(EMBED_ROWS, _ONNX_FLOAT[dtype], ["num_tokens", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="trtvocab")
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.producer_version = __version__
    helper.set_model_props(model, {
        _META + "kind": "embedding", _META + "weight_format": str(fmt), _META + "dtype": dtype,
        _META + "vocab_size": str(emb.vocab_size), _META + "vocab_start": str(emb.shard.start),
        _META + "vocab_end": str(emb.shard.end), _META + "hidden_size": str(hidden),
        _META + "tp_size": str(emb.tp_size), _META + "tp_rank": str(emb.tp_rank),
        _META + "embed_scale": repr(emb.embedding_ops.scale)})
    return model


def export_embedding_onnx(emb: VocabParallelEmbedding, path: str | Path, *, check: bool = True) -> EmbeddingExport:
    """Write this rank's lookup graph at ``path`` atomically (checked with ``onnx.checker`` first)."""
    model = build_embedding_model(emb)
    size = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    digests = save_model_atomic(model, path, external_data=size > 1_800_000_000, check=check)
    return EmbeddingExport(path=str(path), sha256=digests, vocab_start=emb.shard.start, vocab_end=emb.shard.end,
                           hidden_size=emb.hidden_size, dtype=dtype_name(emb.dtype), weight_format=emb.weight_format)


__all__ = ["EmbeddingExport", "build_embedding_model", "export_embedding_onnx"]
