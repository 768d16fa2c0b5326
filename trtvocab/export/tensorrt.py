"""``lm_head.onnx`` -> ``lm_head.plan`` with the TensorRT 11 Python API, and a runner for the plan.

TensorRT is an optional dependency: this module imports it only inside the functions
that need it, so importing the module (and everything that is not TensorRT itself:
the compute-capability gate, profile validation, the atomic plan write) works without it.

Build, in order::

    validate the profile            (ConfigError: before anything expensive)
    import tensorrt, find a GPU     (EngineUnavailableError with a one-line reason)
    compute-capability gate         FP8 needs >= 8.9, NVFP4 >= 10.0; on Hopper an NVFP4
                                    head may be rebuilt with dequantized weights
                                    (``dequantize_fp4=True``, W4A16 numbers)
    Builder -> strongly typed network -> OnnxParser.parse_from_file (errors name the node)
    config: workspace pool limit, optimization profile, timing cache (loaded, saved back)
    build_serialized_network -> atomic write of the plan

Strongly typed: TensorRT 11 removed the precision builder flags (FP16/BF16/FP8/FP4/INT8);
every tensor's type comes from the ONNX graph (casts and Q/DQ nodes). On TensorRT 11 the
STRONGLY_TYPED creation flag is accepted and ignored (always on); on 10.x it is required,
so it is always set when the enum has it.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trtvocab.errors import ArtifactError, ConfigError, EngineUnavailableError, InputError, QuantizationError
from trtvocab.fsutil import atomic_write_bytes

HIDDEN, SEQ_LENS, LOGITS = "hidden_states", "seq_lens", "logits"  # the names export/onnx.py writes
MIN_TENSORRT = (10, 8)  # strongly typed networks with FP4 (DynamicQuantize) exist from 10.8
FP8_MIN_CC = (8, 9)
FP4_MIN_CC = (10, 0)
BF16_MIN_CC = (8, 0)
NATIVE, DEQUANTIZE_FP4 = "native", "dequantize_fp4"


# ---- availability -------------------------------------------------------------------------------
def _import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise EngineUnavailableError(
            f"TensorRT is not importable ({exc}); install the 'tensorrt' extra with NVIDIA's TensorRT "
            "libraries on a machine with a CUDA GPU") from None
    version = tuple(int(p) for p in trt.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TENSORRT:
        raise EngineUnavailableError(
            f"TensorRT {trt.__version__} is too old: strongly typed FP8/FP4 builds need >= "
            f"{'.'.join(map(str, MIN_TENSORRT))}")
    return trt


def _cuda_device() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailableError("no CUDA GPU is visible to PyTorch: TensorRT engines need one")
    return torch.device("cuda", torch.cuda.current_device())


def tensorrt_available() -> tuple[bool, str]:
    """(True, "TensorRT x.y on <GPU> (CC a.b)") or (False, one-line reason); never raises."""
    try:
        trt = _import_tensorrt()
        device = _cuda_device()
    except EngineUnavailableError as exc:
        return False, str(exc)
    import torch

    cc = torch.cuda.get_device_capability(device)
    return True, f"TensorRT {trt.__version__} on {torch.cuda.get_device_name(device)} (CC {cc[0]}.{cc[1]})"


# ---- compute-capability gate ----------------------------------------------------------------------
def check_compute_capability(weight_format: str, cc: tuple[int, int] | None = None, *,
                             dequantize_fp4: bool = False, dtype: str | None = None) -> str:
    """How an engine of ``weight_format`` can be built on a GPU of compute capability ``cc``.

    Returns ``"native"`` or ``"dequantize_fp4"`` (NVFP4 below 10.0 when asked to: the FP4
    weights are dequantized to the head dtype at build time). Raises
    :class:`EngineUnavailableError` with the reason otherwise. ``cc`` None: the current GPU.
    """
    if cc is None:
        import torch

        cc = torch.cuda.get_device_capability(_cuda_device())
    cc = (int(cc[0]), int(cc[1]))
    have = f"{cc[0]}.{cc[1]}"
    if dtype == "bfloat16" and cc < BF16_MIN_CC:
        raise EngineUnavailableError(f"bfloat16 engines need compute capability >= 8.0 (Ampere); this GPU is {have}")
    if weight_format == "dense":
        return NATIVE
    if weight_format == "FP8":
        if cc < FP8_MIN_CC:
            raise EngineUnavailableError(
                f"FP8 engines need compute capability >= 8.9 (Ada, Hopper or newer); this GPU is {have}")
        return NATIVE
    if weight_format == "NVFP4":
        if cc >= FP4_MIN_CC:
            return NATIVE
        if dequantize_fp4 and cc >= BF16_MIN_CC:
            return DEQUANTIZE_FP4
        hint = ("" if dequantize_fp4 else
                "; pass dequantize_fp4=True to build it with the FP4 weights dequantized (W4A16 numbers, "
                "no memory saving)")
        raise EngineUnavailableError(
            f"NVFP4 engines need compute capability >= 10.0 (Blackwell); this GPU is {have}{hint}")
    raise EngineUnavailableError(f"no TensorRT engine for weight format {weight_format!r}")


# ---- profile ----------------------------------------------------------------------------------------
class EngineProfile(BaseModel):
    """Optimization-profile ranges: tokens T of ``hidden_states [T, H]``, batch B of ``seq_lens [B]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_tokens: int = Field(1, ge=1)
    opt_tokens: int = Field(256, ge=1)
    max_tokens: int = Field(8192, ge=1)
    min_batch: int = Field(1, ge=1)
    opt_batch: int = Field(8, ge=1)
    max_batch: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> EngineProfile:
        for kind in ("tokens", "batch"):
            lo, opt, hi = (getattr(self, f"{k}_{kind}") for k in ("min", "opt", "max"))
            if not lo <= opt <= hi:
                raise ConfigError(f"profile: need min_{kind} <= opt_{kind} <= max_{kind}, got {lo}, {opt}, {hi}")
        # Every sequence has at least one token, so B <= T at each end of the range.
        if self.max_batch > self.max_tokens:
            raise ConfigError(f"profile: max_batch ({self.max_batch}) > max_tokens ({self.max_tokens}); "
                              "every sequence has at least one token")
        if self.min_batch > self.min_tokens:
            raise ConfigError(f"profile: min_batch ({self.min_batch}) > min_tokens ({self.min_tokens})")
        return self

    def shapes(self, hidden_size: int, has_seq_lens: bool) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Input name -> (min, opt, max) shapes."""
        out = {HIDDEN: tuple((t, hidden_size) for t in (self.min_tokens, self.opt_tokens, self.max_tokens))}
        if has_seq_lens:
            out[SEQ_LENS] = tuple((b,) for b in (self.min_batch, self.opt_batch, self.max_batch))
        return out


def validate_profile(profile: EngineProfile | dict[str, Any]) -> EngineProfile:
    if isinstance(profile, EngineProfile):
        return profile
    if not isinstance(profile, dict):
        raise ConfigError(f"profile must be a dict of min/opt/max tokens and batch, got {type(profile).__name__}")
    unknown = sorted(set(profile) - set(EngineProfile.model_fields))
    if unknown:
        raise ConfigError(f"profile: unknown keys {unknown}; allowed: {sorted(EngineProfile.model_fields)}")
    try:
        return EngineProfile(**profile)
    except ConfigError:
        raise
    except ValueError as exc:  # pydantic's ValidationError: one line per bad field
        errors = exc.errors()  # type: ignore[attr-defined]
        for e in errors:  # our own cross-field check, wrapped by pydantic: raise it as it was
            if isinstance(e.get("ctx", {}).get("error"), ConfigError):
                raise e["ctx"]["error"] from None
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors]
        raise ConfigError("profile: " + "; ".join(lines)) from None


# ---- files ------------------------------------------------------------------------------------------
def sha256_bytes(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def write_plan_atomic(path: str | Path, blob: Any) -> str:
    """Write a serialized engine (bytes or a buffer such as TensorRT's IHostMemory) atomically.

    Temp file in the same folder, fsync, ``os.replace``: a reader sees the old plan or the
    new one, never a partial one; on failure the temp file is removed. Returns the sha256.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    view = memoryview(blob)
    if view.nbytes == 0:
        raise EngineUnavailableError(f"refusing to write an empty engine to {path}")
    atomic_write_bytes(path, view)
    return sha256_bytes(view)


class BuildInfo(BaseModel):
    """What :func:`build_engine` produced (recorded in the artifact manifest)."""

    model_config = ConfigDict(frozen=True)

    plan_path: str
    sha256: str
    bytes: int
    onnx_path: str  # the graph actually parsed (the dequantized variant in dequantize_fp4 mode)
    mode: str  # "native" | "dequantize_fp4"
    weight_format: str
    tensorrt_version: str
    device: str
    compute_capability: str
    profile: dict[str, int]
    workspace_bytes: int
    timing_cache_path: str | None
    inputs: list[str]
    outputs: list[str]
    build_seconds: float


# ---- the graph's header (no weights read) -------------------------------------------------------------
def _graph_header(onnx_path: Path) -> tuple[dict[str, str], list[str], int]:
    """(trtvocab metadata, input names, hidden size) of an exported graph, weights not loaded."""
    import onnx

    if not onnx_path.is_file():
        raise ArtifactError(f"no ONNX graph at {onnx_path}")
    model = onnx.load(str(onnx_path), load_external_data=False)
    meta = {p.key.removeprefix("trtvocab."): p.value for p in model.metadata_props if p.key.startswith("trtvocab.")}
    inputs = [vi.name for vi in model.graph.input]
    if HIDDEN not in inputs:
        raise ArtifactError(f"{onnx_path}: no {HIDDEN!r} input (inputs: {inputs}); not a trtvocab LM-head graph")
    hidden = next(vi for vi in model.graph.input if vi.name == HIDDEN)
    width = hidden.type.tensor_type.shape.dim[1].dim_value
    if width <= 0:
        raise ArtifactError(f"{onnx_path}: {HIDDEN} needs a static hidden size, got {hidden.type}")
    return meta, inputs, width


# ---- build ------------------------------------------------------------------------------------------
def _recording_logger(trt: Any, severity: Any) -> Any:
    """A TensorRT logger that keeps errors (for the exception message) and prints at ``severity``."""

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, sev: Any, msg: str) -> None:
            if sev in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)
            if int(sev) <= int(severity):
                print(f"[TensorRT] {msg}")

    return _Logger()


def _parser_errors(parser: Any) -> str:
    lines = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        node = err.node_name() or f"#{err.node()}"
        lines.append(f"node {node} ({err.node_operator()}): {err.desc()} [{err.code()}]")
    return "; ".join(lines) or "no details from the parser"


def build_engine(
    onnx_path: str | Path,
    plan_path: str | Path,
    profile: EngineProfile | dict[str, Any],
    workspace_bytes: int = 4 << 30,
    timing_cache_path: str | Path | None = None,
    *,
    weight_format: str | None = None,
    dequantize_fp4: bool = False,
    compute_capability: tuple[int, int] | None = None,
    tf32: bool = False,
    builder_optimization_level: int | None = None,
    verbose: bool = False,
) -> BuildInfo:
    """Build ``plan_path`` from an exported LM-head graph (see the module docstring).

    ``weight_format`` None: read from the graph's metadata. ``tf32`` False clears
    TensorRT's TF32 flag (where it still exists) so float32 GEMMs stay float32, like the
    fallback. Raises :class:`ConfigError` for a bad profile and
    :class:`EngineUnavailableError` (one line) when TensorRT, a GPU or the GPU's compute
    capability is missing, or when parsing or building fails.
    """
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    prof = validate_profile(profile)
    if not isinstance(workspace_bytes, int) or workspace_bytes <= 0:
        raise ConfigError(f"workspace_bytes must be a positive int, got {workspace_bytes!r}")
    meta, inputs, hidden_size = _graph_header(onnx_path)
    fmt = weight_format or meta.get("format")
    if fmt is None:
        raise ArtifactError(f"{onnx_path}: no trtvocab.format metadata; pass weight_format")
    if meta.get("format") not in (None, fmt):
        raise ConfigError(f"weight_format {fmt!r} but {onnx_path} was exported as {meta['format']!r}")
    trt = _import_tensorrt()
    device = _cuda_device()
    import torch

    cc = compute_capability or torch.cuda.get_device_capability(device)
    already_dequantized = meta.get("dequantize_fp4") == "True"
    if already_dequantized:
        # Exported with dequantize_fp4: no FP4 tensor is left, it builds like a dense head.
        check_compute_capability("dense", cc, dtype=meta.get("dtype"))
        mode = DEQUANTIZE_FP4
    else:
        mode = check_compute_capability(fmt, cc, dequantize_fp4=dequantize_fp4, dtype=meta.get("dtype"))
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    # Scratch space beside the plan (same filesystem; the dequantized graph can be large).
    with tempfile.TemporaryDirectory(prefix=f".{plan_path.name}.build-", dir=plan_path.parent) as scratch:
        parsed = onnx_path
        if mode == DEQUANTIZE_FP4 and not already_dequantized:
            from trtvocab.export.onnx import dequantize_fp4_onnx

            parsed = Path(scratch) / onnx_path.name
            try:
                dequantize_fp4_onnx(onnx_path, parsed)
            except QuantizationError as exc:
                raise EngineUnavailableError(str(exc)) from None
        return _build(trt, parsed, plan_path, prof, workspace_bytes, timing_cache_path, inputs, hidden_size,
                      fmt, mode, cc, device, tf32, builder_optimization_level, verbose, onnx_path)


def _build(trt: Any, parsed: Path, plan_path: Path, prof: EngineProfile, workspace_bytes: int,
           timing_cache_path: str | Path | None, inputs: list[str], hidden_size: int, fmt: str, mode: str,
           cc: tuple[int, int], device: Any, tf32: bool, opt_level: int | None, verbose: bool,
           source: Path) -> BuildInfo:
    import torch

    started = time.monotonic()
    logger = _recording_logger(trt, trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves lm_head.onnx.data relative to the graph's folder.
    if not parser.parse_from_file(str(parsed)):
        raise EngineUnavailableError(f"TensorRT could not parse {source}: {_parser_errors(parser)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if opt_level is not None:
        config.builder_optimization_level = int(opt_level)
    opt_profile = builder.create_optimization_profile()
    network_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for name, (lo, opt, hi) in prof.shapes(hidden_size, SEQ_LENS in inputs).items():
        if name not in network_inputs:
            raise EngineUnavailableError(f"{source}: TensorRT's network has no input {name!r} "
                                         f"(it has {sorted(network_inputs)})")
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    cache_path = Path(timing_cache_path) if timing_cache_path else None
    cache_blob = cache_path.read_bytes() if cache_path is not None and cache_path.is_file() else b""
    cache = config.create_timing_cache(cache_blob)
    config.set_timing_cache(cache, False)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        detail = "; ".join(logger.errors[-3:]) or "see the TensorRT log"
        raise EngineUnavailableError(f"TensorRT failed to build an engine from {source}: {detail}")
    digest = write_plan_atomic(plan_path, blob)
    if cache_path is not None:
        write_plan_atomic(cache_path, config.get_timing_cache().serialize())  # same atomic write
    return BuildInfo(
        plan_path=str(plan_path), sha256=digest, bytes=memoryview(blob).nbytes, onnx_path=str(source), mode=mode,
        weight_format=fmt, tensorrt_version=trt.__version__, device=torch.cuda.get_device_name(device),
        compute_capability=f"{cc[0]}.{cc[1]}", profile=prof.model_dump(), workspace_bytes=workspace_bytes,
        timing_cache_path=str(cache_path) if cache_path is not None else None, inputs=sorted(network_inputs),
        outputs=[network.get_output(i).name for i in range(network.num_outputs)],
        build_seconds=round(time.monotonic() - started, 3),
    )


# ---- run --------------------------------------------------------------------------------------------
class EngineRunner:
    """Deserialize a plan once; run it on torch CUDA tensors (``execute_async_v3`` on a torch stream).

    ``run(hidden [T, H], seq_lens [B] | None)`` -> float32 logits ``[B, V_local]`` (or
    ``[T, V_local]`` for a context engine) on the GPU. Inputs are validated on the host
    first (dtype, width, profile range, seq_lens) so that a bad input raises
    :class:`InputError` instead of reaching the engine.
    """

    def __init__(self, plan_path: str | Path, info: dict[str, Any] | None = None, *, verify_sha256: bool = True):
        self.trt = _import_tensorrt()
        self.device = _cuda_device()
        path = Path(plan_path)
        if not path.is_file():
            raise ArtifactError(f"no TensorRT plan at {path}")
        blob = path.read_bytes()
        want = (info or {}).get("sha256")
        if verify_sha256 and want and sha256_bytes(blob) != want:
            raise ArtifactError(f"{path}: sha256 does not match the recorded one (partial or replaced plan)")
        self.logger = _recording_logger(self.trt, self.trt.ILogger.Severity.WARNING)
        self.runtime = self.trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise ArtifactError(f"{path}: TensorRT {self.trt.__version__} cannot deserialize this plan (built by "
                                f"another TensorRT version or for another GPU): {'; '.join(self.logger.errors)}")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode_in = self.trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode_in]
        self.outputs = [n for n in names if n not in self.inputs]
        if HIDDEN not in self.inputs or self.outputs != [LOGITS]:
            raise ArtifactError(f"{path}: engine I/O {names} is not a trtvocab LM head")

    def _torch_dtype(self, name: str) -> Any:
        import torch

        dt = self.engine.get_tensor_dtype(name)
        table = {self.trt.DataType.FLOAT: torch.float32, self.trt.DataType.HALF: torch.float16,
                 self.trt.DataType.BF16: torch.bfloat16, self.trt.DataType.INT32: torch.int32}
        if dt not in table:
            raise ArtifactError(f"engine tensor {name} has unsupported type {dt}")
        return table[dt]

    def _check_range(self, name: str, extent: int, what: str) -> None:
        lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
        if not lo[0] <= extent <= hi[0]:
            raise InputError(f"{what} = {extent} is outside the engine's profile [{lo[0]}, {hi[0]}]; "
                             "rebuild with a wider [profile]")

    def run(self, hidden: Any, seq_lens: Any = None, stream: Any = None) -> Any:
        import torch

        from trtvocab.logits import last_token_rows

        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise InputError(f"{HIDDEN}: expected a [T, H] torch tensor, got {getattr(hidden, 'shape', hidden)!r}")
        want_dtype = self._torch_dtype(HIDDEN)
        width = self.engine.get_tensor_shape(HIDDEN)[1]
        if hidden.dtype != want_dtype or hidden.shape[1] != width:
            raise InputError(f"{HIDDEN}: the engine takes {want_dtype} [T, {width}], got {hidden.dtype} "
                             f"{list(hidden.shape)}")
        total = hidden.shape[0]
        if total == 0:
            raise InputError(f"{HIDDEN}: empty batch (T = 0)")
        self._check_range(HIDDEN, total, "T (tokens)")
        feeds = {HIDDEN: hidden.to(self.device).contiguous()}
        if SEQ_LENS in self.inputs:
            lens = seq_lens if seq_lens is not None else torch.tensor([total], dtype=torch.int32)
            last_token_rows(lens, total)  # validated on the host: the engine's Gather cannot raise
            lens = torch.as_tensor(lens).to(self.device, torch.int32).contiguous()
            self._check_range(SEQ_LENS, lens.shape[0], "B (sequences)")
            feeds[SEQ_LENS] = lens
        elif seq_lens is not None:
            last_token_rows(seq_lens, total)
        for name, tensor in feeds.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        out = torch.empty(tuple(self.context.get_tensor_shape(LOGITS)), dtype=self._torch_dtype(LOGITS),
                          device=self.device)
        self.context.set_tensor_address(LOGITS, out.data_ptr())
        stream = stream or torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineUnavailableError(f"TensorRT execution failed: {'; '.join(self.logger.errors[-3:])}")
        # Inputs may be temporaries: keep them alive until the engine has read them.
        for tensor in feeds.values():
            tensor.record_stream(stream)
        return out
