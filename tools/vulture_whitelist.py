"""The intentional cases of `make lint`'s dead-code check (vulture; settings: [tool.vulture] in pyproject.toml).

Each name below is used by something vulture does not see, for the reason its group says. A new entry needs
the same: what uses it. Anything else vulture reports is dead code to delete.
"""

# ruff: noqa: B018, F821
_ = object()  # vulture's convention: ``_.name`` stands for an attribute or method of any object

# ---- fields of files, records and reports (written as JSON, read by people and older readers) ----------------
format_version  # Manifest
recipe_file  # Manifest
embedding_plan  # Manifest, RankEntry
description  # BuildRecipe (the recipe's TOML)
build_seconds  # EngineBuild record
total_bytes  # OnnxExport record
tactic  # the engine's layer table
logits_gather_time_s  # trtvocab plan --json
head_time_s  # trtvocab plan --json
actorder  # compressed-tensors' config.json schema (CTArgs / CTGroup / CTConfig): parsed and validated
output_activations  # (quant_method must be "compressed-tensors"), never read back by name
quant_method
_.output_names  # OnnxExport, the counterpart of input_names

# ---- names another library reads or sets ----------------------------------------------------------------------
__getattr__  # the package facade's lazy attributes (PEP 562)
__dir__
_._missing_  # Enum: Runtime("reference") is the old name of ONNX_REFERENCE
_.extra_repr  # torch.nn.Module's repr
_.write_dl  # click's HelpFormatter
_.pre_tokenizer  # tokenizers.Tokenizer: a test tokenizer splits on whitespace
_.showwarning  # warnings.showwarning, replaced by the CLI
category  # warnings.showwarning's signature
filename
lineno
op_domain  # onnx.reference's OpRun subclasses
_.graph_optimization_level  # onnxruntime.SessionOptions
_.profiling_verbosity  # TensorRT's IBuilderConfig
_.num_compute_capabilities
_.dynamic_shapes_kernel_specialization_strategy
dynamic_shapes_kernel_specialization_strategy  # a test's stand-in for TensorRT-RTX's enum
_.producer_version  # onnx.ModelProto
INFO  # tests' stand-ins for TensorRT's Logger.Severity
add_special_tokens  # a test tokenizer's keyword, as transformers' tokenizers take it
signum  # a signal handler's signature
frame

# ---- pytest fixtures a test requests for their effect, not their value -----------------------------------------
fused  # test_fused_numerics: the kernels loaded (skips where they cannot build)
dense_kernel
no_inference  # test_cli_errors, test_hostile_hidden_file: inference replaced by a spy

# ---- a complete vocabulary of values --------------------------------------------------------------------------
ROW  # lm_head's split kinds: COLUMN is the one an LM head uses, ROW names the other
FP8_PER_CHANNEL_PER_TOKEN  # QuantAlgo: names ModelOpt writes for other layers (a config naming one parses;
FP8_BLOCK_SCALES  # the head does not run it)
W4A8_AWQ
W8A16
W4A16
INT8_SQ
NVFP4_AWQ
W4A8_NVFP4_FP8
W4A8_MXFP4_FP8
MXFP4
MXFP8
