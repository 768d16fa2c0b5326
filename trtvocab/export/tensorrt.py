"""``lm_head.onnx`` -> ``lm_head.plan`` with the TensorRT 11 Python API (the runner of a plan is
:mod:`trtvocab.backends.tensorrt`).

TensorRT (and ``onnx``) are optional dependencies: this module imports them only inside the
functions that need them, so importing the module (and everything that is not TensorRT
itself: the compute-capability gate, profile validation, the atomic plan write) works
without them.

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

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtvocab.errors import ArtifactError, ConfigError, EngineUnavailableError, QuantizationError
from trtvocab.formats import HIDDEN, SEQ_LENS, WeightFormat
from trtvocab.fsutil import atomic_write_bytes, sha256_bytes
from trtvocab.recipe import EngineBuild, Profile, validate_profile

if TYPE_CHECKING:
    from trtvocab.export.onnx import GraphSpec

__all__ = ["EngineBuild", "Profile", "build_engine", "check_compute_capability", "sha256_bytes",
           "tensorrt_available", "validate_profile", "write_plan_atomic"]
MIN_TENSORRT = (10, 8)  # strongly typed networks with FP4 (DynamicQuantize) exist from 10.8
FP8_MIN_CC = (8, 9)
FP4_MIN_CC = (10, 0)
BF16_MIN_CC = (8, 0)
NATIVE, DEQUANTIZE_FP4 = "native", "dequantize_fp4"


# ---- availability -------------------------------------------------------------------------------
def import_tensorrt() -> Any:
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


def cuda_device() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailableError("no CUDA GPU is visible to PyTorch: TensorRT engines need one")
    return torch.device("cuda", torch.cuda.current_device())


def tensorrt_available() -> tuple[bool, str]:
    """(True, "TensorRT x.y on <GPU> (CC a.b)") or (False, one-line reason); never raises."""
    try:
        trt = import_tensorrt()
        device = cuda_device()
    except EngineUnavailableError as exc:
        return False, str(exc)
    import torch

    cc = torch.cuda.get_device_capability(device)
    return True, f"TensorRT {trt.__version__} on {torch.cuda.get_device_name(device)} (CC {cc[0]}.{cc[1]})"


# ---- compute-capability gate ----------------------------------------------------------------------
def check_compute_capability(weight_format: WeightFormat | str, cc: tuple[int, int] | None = None, *,
                             dequantize_fp4: bool = False, dtype: str | None = None) -> str:
    """How an engine of ``weight_format`` can be built on a GPU of compute capability ``cc``.

    Returns ``"native"`` or ``"dequantize_fp4"`` (NVFP4 below 10.0 when asked to: the FP4
    weights are dequantized to the head dtype at build time). Raises
    :class:`EngineUnavailableError` with the reason otherwise. ``cc`` None: the current GPU.
    """
    if cc is None:
        import torch

        cc = torch.cuda.get_device_capability(cuda_device())
    cc = (int(cc[0]), int(cc[1]))
    have = f"{cc[0]}.{cc[1]}"
    if dtype == "bfloat16" and cc < BF16_MIN_CC:
        raise EngineUnavailableError(f"bfloat16 engines need compute capability >= 8.0 (Ampere); this GPU is {have}")
    if weight_format == WeightFormat.DENSE:
        return NATIVE
    if weight_format == WeightFormat.FP8:
        if cc < FP8_MIN_CC:
            raise EngineUnavailableError(
                f"FP8 engines need compute capability >= 8.9 (Ada, Hopper or newer); this GPU is {have}")
        return NATIVE
    if weight_format == WeightFormat.NVFP4:
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


# ---- files ------------------------------------------------------------------------------------------
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


# ---- the graph's header (no weights read) -------------------------------------------------------------
def _graph_header(onnx_path: Path) -> tuple[GraphSpec, list[str]]:
    """(the exporter's GraphSpec, input names) of an exported graph, weights not loaded."""
    import onnx

    from trtvocab.export.onnx import GraphSpec

    if not onnx_path.is_file():
        raise ArtifactError(f"no ONNX graph at {onnx_path}")
    model = onnx.load(str(onnx_path), load_external_data=False)
    inputs = [vi.name for vi in model.graph.input]
    if HIDDEN not in inputs:
        raise ArtifactError(f"{onnx_path}: no {HIDDEN!r} input (inputs: {inputs}); not a trtvocab LM-head graph")
    return GraphSpec.from_model(model), inputs


# ---- build ------------------------------------------------------------------------------------------
def recording_logger(trt: Any, severity: Any) -> Any:
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
    profile: Profile | dict[str, Any],
    workspace_bytes: int = 4 << 30,
    timing_cache_path: str | Path | None = None,
    *,
    weight_format: WeightFormat | str | None = None,
    dequantize_fp4: bool = False,
    compute_capability: tuple[int, int] | None = None,
    tf32: bool = False,
    builder_optimization_level: int | None = None,
    verbose: bool = False,
) -> EngineBuild:
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
    spec, inputs = _graph_header(onnx_path)
    hidden_size, fmt = spec.hidden_size, spec.weight_format
    if weight_format is not None and weight_format != fmt:
        raise ConfigError(f"weight_format {str(weight_format)!r} but {onnx_path} was exported as {str(fmt)!r}")
    trt = import_tensorrt()
    device = cuda_device()
    import torch

    cc = compute_capability or torch.cuda.get_device_capability(device)
    already_dequantized = spec.dequantize_fp4
    if already_dequantized:
        # Exported with dequantize_fp4: no FP4 tensor is left, it builds like a dense head.
        check_compute_capability(WeightFormat.DENSE, cc, dtype=spec.dtype)
        mode = DEQUANTIZE_FP4
    else:
        mode = check_compute_capability(fmt, cc, dequantize_fp4=dequantize_fp4, dtype=spec.dtype)
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


def _build(trt: Any, parsed: Path, plan_path: Path, prof: Profile, workspace_bytes: int,
           timing_cache_path: str | Path | None, inputs: list[str], hidden_size: int, fmt: WeightFormat, mode: str,
           cc: tuple[int, int], device: Any, tf32: bool, opt_level: int | None, verbose: bool,
           source: Path) -> EngineBuild:
    import torch

    started = time.monotonic()
    logger = recording_logger(trt, trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING)
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
    return EngineBuild(
        plan_path=str(plan_path), sha256=digest, bytes=memoryview(blob).nbytes, onnx_path=str(source), mode=mode,
        weight_format=fmt, tensorrt_version=trt.__version__, device=torch.cuda.get_device_name(device),
        compute_capability=f"{cc[0]}.{cc[1]}", profile=prof.model_dump(), workspace_bytes=workspace_bytes,
        timing_cache_path=str(cache_path) if cache_path is not None else None, inputs=sorted(network_inputs),
        outputs=[network.get_output(i).name for i in range(network.num_outputs)],
        build_seconds=round(time.monotonic() - started, 3),
    )
