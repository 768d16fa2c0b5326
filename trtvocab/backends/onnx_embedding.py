"""Run one rank's exported embedding lookup (:mod:`trtvocab.export.embedding`) on onnxruntime CPU.

onnxruntime has no numpy type for bfloat16, so the output is bound to a preallocated
buffer of the same bytes (uint16 for bf16) and read back as a torch tensor of the graph's dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto

from trtvocab.backends.onnx import session_options
from trtvocab.base.formats import EMBED_IDS, EMBED_ROWS
from trtvocab.errors import InputError

_OUT = {TensorProto.BFLOAT16: (np.uint16, torch.bfloat16), TensorProto.FLOAT16: (np.float16, torch.float16),
        TensorProto.FLOAT: (np.float32, torch.float32)}


def run_embedding_onnx(path: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids [T]`` (any integer dtype) -> this rank's partial rows ``[T, H]`` in the graph's dtype."""
    import onnxruntime as ort

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype.is_floating_point:
        raise InputError(f"{EMBED_IDS}: expected a 1-D integer tensor, got {getattr(input_ids, 'shape', input_ids)}")
    model = onnx.load(str(path), load_external_data=False)
    out_type = model.graph.output[0].type.tensor_type
    np_type, torch_type = _OUT[out_type.elem_type]
    hidden = out_type.shape.dim[1].dim_value
    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    ids = input_ids.detach().cpu().to(torch.int64).contiguous().numpy()
    out = np.empty((ids.shape[0], hidden), dtype=np_type)
    binding = session.io_binding()
    binding.bind_ortvalue_input(EMBED_IDS, ort.OrtValue.ortvalue_from_numpy(ids))
    binding.bind_ortvalue_output(EMBED_ROWS, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, out_type.elem_type))
    session.run_with_iobinding(binding)
    result = torch.from_numpy(out)
    return result.view(torch_type) if np_type is np.uint16 else result
