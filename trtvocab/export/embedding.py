"""One rank's masked embedding lookup as an ONNX graph (the all-reduce stays outside)::

    input_ids [T] int64
        local = input_ids - start;  mine = 0 <= local < size
        index = Where(mine, local, size)            non-owned and invalid ids -> row `size`,
                                                   an extra all-zero row appended to the table
    dense   rows = Gather(W_local+zero_row, index)                        [T, H] head dtype
    FP8     codes = Gather(codes_local+zero_row, index)  (uint8: ONNX Gather takes no float8)
            rows  = Cast(Gather(E4M3_TO_F32[256], codes) * scale, dtype)  scale per tensor,
                    or Gather(row_scales+0, index) per row
    rows [T, H]  = this rank's partial rows: zero where it owns no id

The appended zero row replaces a float ``Where`` (which onnxruntime CPU lacks for bf16)
and costs one row. The FP8 decode table holds the float32 value of each of the 256 e4m3
codes, so ``Gather`` + ``Mul`` is ``q.float() * scale`` exactly, as the PyTorch module
dequantizes. Summing the ranks' outputs gives the full lookup (one owner per id).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper
from pydantic import BaseModel, ConfigDict

from trtvocab.dtypes import dtype_name
from trtvocab.embedding import VocabParallelEmbedding
from trtvocab.errors import ConfigError
from trtvocab.export.onnx import DEFAULT_OPSET, save_model_atomic, tensor_proto
from trtvocab.formats import EMBED_IDS, EMBED_ROWS, WeightFormat
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
        decode = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        inits += [helper.make_tensor("embedding.weight", TensorProto.UINT8, list(codes.shape),
                                     codes.numpy().tobytes(), raw=True),
                  tensor_proto("embedding/e4m3_to_f32", decode)]
        nodes += [helper.make_node("Gather", ["embedding.weight", "index"], ["codes"], axis=0),
                  helper.make_node("Cast", ["codes"], ["code_index"], to=TensorProto.INT32),
                  helper.make_node("Gather", ["embedding/e4m3_to_f32", "code_index"], ["values"], axis=0)]
        scale = emb.weights.weight_scale
        if emb.weights.per_row:
            rows_scale = torch.cat([scale[:size].reshape(size, 1), torch.zeros(1, 1)])
            inits.append(tensor_proto("embedding.weight_scale", rows_scale))
            nodes.append(helper.make_node("Gather", ["embedding.weight_scale", "index"], ["scale"], axis=0))
        else:
            inits.append(tensor_proto("embedding.weight_scale", scale.reshape(()).float()))
            nodes.append(helper.make_node("Identity", ["embedding.weight_scale"], ["scale"]))
        nodes.append(helper.make_node("Mul", ["values", "scale"], ["rows_f32"]))
        if dtype == "float32":
            nodes.append(helper.make_node("Identity", ["rows_f32"], [EMBED_ROWS]))
        else:
            nodes.append(helper.make_node("Cast", ["rows_f32"], [EMBED_ROWS], to=_ONNX_FLOAT[dtype]))
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
        _META + "tp_size": str(emb.tp_size), _META + "tp_rank": str(emb.tp_rank)})
    return model


def export_embedding_onnx(emb: VocabParallelEmbedding, path: str | Path, *, check: bool = True) -> EmbeddingExport:
    """Write this rank's lookup graph at ``path`` atomically (checked with ``onnx.checker`` first)."""
    model = build_embedding_model(emb)
    size = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    digests = save_model_atomic(model, path, external_data=size > 1_800_000_000, check=check)
    return EmbeddingExport(path=str(path), sha256=digests, vocab_start=emb.shard.start, vocab_end=emb.shard.end,
                           hidden_size=emb.hidden_size, dtype=dtype_name(emb.dtype), weight_format=emb.weight_format)


__all__ = ["EmbeddingExport", "build_embedding_model", "export_embedding_onnx"]
