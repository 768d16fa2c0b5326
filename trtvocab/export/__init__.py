"""Per-rank export of the LM head: an ONNX graph, and a TensorRT engine built from it.

::

    onnx.py           LMHead shard -> lm_head.onnx (dense / FP8 Q-DQ / NVFP4 double-DQ)
    tensorrt.py       lm_head.onnx -> lm_head.plan (TensorRT, optional) and its runner

The graph runs on CPU (onnxruntime, or onnx.reference with this project's TRT_FP4DynamicQuantize)
in ``trtvocab/backends/onnx.py``. Nothing here is imported eagerly: ``onnx`` and ``tensorrt`` are
optional extras.
"""

__all__ = ["onnx", "tensorrt"]
