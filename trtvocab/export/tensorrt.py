"""``lm_head.onnx`` / ``embedding.onnx`` -> a TensorRT plan, with either of two real compilers.

One builder, two compilers (standard TensorRT, built on the GPU it targets, and TensorRT-RTX,
built ahead of time for named targets without a GPU); :class:`Toolkit` holds what differs. The
build validates the profile, reads the graph's contract, refuses a target that cannot run the
graph, parses, configures, builds, checks the layer table against the contract and writes the
plan atomically. The TensorRT-RTX path makes no ``torch.cuda`` call.

The two compilers compared, the build order and what the layer-table check enforces:
docs/architecture.md, "Engines".
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtvocab.base.formats import EMBED_IDS, SEQ_LENS, WeightFormat
from trtvocab.base.publish import atomic_write_bytes
from trtvocab.base.safe_read import read_regular, sha256_bytes
from trtvocab.errors import ConfigError, EngineUnavailableError, QuantizationError
from trtvocab.export.contract import GraphInfo, check_engine, describe_graph
from trtvocab.export.layer_table import parse_layer_table
from trtvocab.export.records import EngineBuild, Profile, validate_profile
from trtvocab.export.targets import (
    MIN_CC,
    RTX_TARGETS,
    Compiler,
    HwType,
    cc_name,
    choose_targets,
    target_name,
)
from trtvocab.quant import gguf_blocks

__all__ = ["EngineBuild", "Profile", "Toolkit", "build_engine", "check_compute_capability", "import_compiler",
           "resolve_compiler", "sha256_bytes", "tensorrt_available", "validate_profile", "write_plan_atomic"]
MIN_VERSION = {Compiler.TENSORRT: (10, 8), Compiler.TENSORRT_RTX: (1, 7)}
MODULE = {Compiler.TENSORRT: "tensorrt", Compiler.TENSORRT_RTX: "tensorrt_rtx"}
EXTRA = {Compiler.TENSORRT: "tensorrt", Compiler.TENSORRT_RTX: "tensorrt-rtx"}
NATIVE, DEQUANTIZE_FP4 = "native", "dequantize_fp4"


# ---- the two compilers ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Toolkit:
    """One compiler: its Python module and what differs between standard TensorRT and TensorRT-RTX.

    Args:
        compiler: ``Compiler.TENSORRT`` or ``Compiler.TENSORRT_RTX``.
        trt: the imported module (``tensorrt`` or ``tensorrt_rtx``: the same API otherwise).
    """

    compiler: Compiler
    trt: Any

    @property
    def version(self) -> str:
        return str(self.trt.__version__)

    @property
    def aot(self) -> bool:
        """Builds ahead of time for named targets, without a GPU (TensorRT-RTX)."""
        return self.compiler is Compiler.TENSORRT_RTX

    def set_targets(self, config: Any, targets: list[str]) -> None:
        """Name the engine's compute targets (TensorRT-RTX; its default set would be silent)."""
        config.num_compute_capabilities = len(targets)
        for i, name in enumerate(targets):
            config.set_compute_capability(getattr(self.trt.ComputeCapability, name.upper()), i)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def import_compiler(compiler: Compiler | str) -> Toolkit:
    """The toolkit of ``compiler`` (not ``auto``); EngineUnavailableError in one line otherwise."""
    compiler = Compiler(compiler)
    if compiler is Compiler.AUTO:
        return resolve_compiler(compiler)
    module = MODULE[compiler]
    try:
        trt = __import__(module)
    except ImportError as exc:
        where = " on a machine with a CUDA GPU" if compiler is Compiler.TENSORRT else ""
        raise EngineUnavailableError(
            f"{'TensorRT' if compiler is Compiler.TENSORRT else 'TensorRT-RTX'} is not importable ({exc}); "
            f"install the '{EXTRA[compiler]}' extra{where}") from None
    version, need = _version(trt.__version__), MIN_VERSION[compiler]
    if version < need:
        raise EngineUnavailableError(f"{module} {trt.__version__} is too old: trtvocab's strongly typed "
                                     f"FP8/FP4 graphs need >= {'.'.join(map(str, need))}")
    return Toolkit(compiler, trt)


def cuda_device() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailableError("no CUDA GPU is visible to PyTorch: TensorRT engines need one")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_compiler(requested: Compiler | str = Compiler.AUTO) -> Toolkit:
    """``auto``: standard TensorRT where it and a GPU exist, else TensorRT-RTX where it imports."""
    requested = Compiler(requested)
    if requested is not Compiler.AUTO:
        kit = import_compiler(requested)
        if kit.compiler is Compiler.TENSORRT:
            cuda_device()  # standard TensorRT builds for the GPU it runs on
        return kit
    reasons = []
    try:
        kit = import_compiler(Compiler.TENSORRT)
        cuda_device()
        return kit
    except EngineUnavailableError as exc:
        reasons.append(str(exc))
    try:
        return import_compiler(Compiler.TENSORRT_RTX)
    except EngineUnavailableError as exc:
        reasons.append(str(exc))
    raise EngineUnavailableError("no engine compiler: " + "; ".join(reasons))


def tensorrt_available(compiler: Compiler | str = Compiler.AUTO) -> tuple[bool, str]:
    """(True, "<compiler> x.y ...") or (False, one-line reason); never raises."""
    try:
        kit = resolve_compiler(compiler)
    except EngineUnavailableError as exc:
        return False, str(exc)
    if kit.aot:
        return True, f"TensorRT-RTX {kit.version} (ahead of time, no GPU needed)"
    import torch

    device = cuda_device()
    cc = torch.cuda.get_device_capability(device)
    return True, f"TensorRT {kit.version} on {torch.cuda.get_device_name(device)} (CC {cc[0]}.{cc[1]})"


# ---- compute-capability gate (standard TensorRT: the local GPU) -----------------------------------------
def check_compute_capability(weight_format: WeightFormat | str, cc: tuple[int, int] | None = None, *,
                             dequantize_fp4: bool = False, dtype: str | None = None) -> str:
    """How standard TensorRT can build an engine of ``weight_format`` for a GPU of compute capability ``cc``.

    Returns ``"native"`` or ``"dequantize_fp4"`` (NVFP4 below 10.0 when asked to: the FP4
    weights are dequantized to the head dtype at build time). Raises
    :class:`EngineUnavailableError` with the reason otherwise. ``cc`` None: the current GPU.
    """
    if cc is None:
        import torch

        cc = torch.cuda.get_device_capability(cuda_device())
    cc = (int(cc[0]), int(cc[1]))
    have, rules = cc_name(cc), MIN_CC[Compiler.TENSORRT]
    bf16, fp8, fp4 = rules[HwType.BF16], rules[HwType.FP8], rules[HwType.FP4]
    assert bf16 is not None and fp8 is not None and fp4 is not None
    if dtype == "bfloat16" and cc < bf16:
        raise EngineUnavailableError(f"bfloat16 engines need compute capability >= {cc_name(bf16)} (Ampere); "
                                     f"this GPU is {have}")
    if weight_format == WeightFormat.DENSE or weight_format in gguf_blocks.FORMATS:  # GGUF: a float32 GEMM
        return NATIVE
    if weight_format == WeightFormat.FP8:
        if cc < fp8:
            raise EngineUnavailableError(
                f"FP8 engines need compute capability >= {cc_name(fp8)} (Ada, Hopper or newer); this GPU is {have}")
        return NATIVE
    if weight_format == WeightFormat.NVFP4:
        if cc >= fp4:
            return NATIVE
        if dequantize_fp4 and cc >= bf16:
            return DEQUANTIZE_FP4
        hint = ("" if dequantize_fp4 else
                "; pass dequantize_fp4=True to build it with the FP4 weights dequantized (W4A16 numbers, "
                "no memory saving)")
        raise EngineUnavailableError(
            f"NVFP4 engines need compute capability >= {cc_name(fp4)} (Blackwell); this GPU is {have}{hint}")
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


def _graph_bytes(onnx_path: Path) -> int:
    data = onnx_path.parent / f"{onnx_path.name}.data"
    return onnx_path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


# ---- build ------------------------------------------------------------------------------------------
def recording_logger(trt: Any, severity: Any) -> Any:
    """A TensorRT logger that keeps every message (errors for the exception, the layer table for the
    record) and prints those at ``severity`` or worse."""

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []
            self.messages: list[str] = []

        def log(self, sev: Any, msg: str) -> None:
            self.messages.append(msg)
            if sev in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)
            elif sev == trt.ILogger.Severity.WARNING:
                self.warnings.append(msg)
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


@dataclass(frozen=True)
class _Plan:
    """Where and for what one engine is built (the compiler-specific half of a build)."""

    kit: Toolkit
    mode: str
    targets: list[str]
    device: str | None
    cc: tuple[int, int] | None


def _plan_standard(kit: Toolkit, info: GraphInfo, cc: tuple[int, int] | None, dequantize_fp4: bool) -> _Plan:
    import torch

    device = cuda_device()
    cc = cc or tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
    assert cc is not None
    if info.dequantize_fp4 or info.graph == "embedding":
        check_compute_capability(WeightFormat.DENSE, cc, dtype=info.dtype)
        if info.weight_format is WeightFormat.FP8:
            check_compute_capability(WeightFormat.FP8, cc)
        mode = DEQUANTIZE_FP4 if info.dequantize_fp4 else NATIVE
    else:
        mode = check_compute_capability(info.weight_format, cc, dequantize_fp4=dequantize_fp4, dtype=info.dtype)
    return _Plan(kit, mode, [target_name(cc)], torch.cuda.get_device_name(device), cc)


def _plan_rtx(kit: Toolkit, info: GraphInfo, targets: list[str] | None, cc: tuple[int, int] | None) -> _Plan:
    if cc is not None:
        name = target_name(cc)
        if name not in RTX_TARGETS:
            raise EngineUnavailableError(f"compute capability {cc_name(cc)} is not a TensorRT-RTX target (allowed: "
                                         f"{list(RTX_TARGETS)}); Hopper and data-center Blackwell need standard "
                                         "TensorRT")
        targets = [name]
    chosen = choose_targets(set(info.needs), targets)
    return _Plan(kit, DEQUANTIZE_FP4 if info.dequantize_fp4 else NATIVE, chosen, None, None)


MAX_TIMING_CACHE_BYTES = 1 << 30


def _timing_cache(config: Any, path: Path, logger: Any, version: str) -> Any:
    """The timing cache at ``path`` (``[engine] timing_cache``; recipe content, not trusted), which the
    build then replaces atomically: so it must be absent or a regular file that TensorRT deserializes
    as a timing cache. Anything else (``~/.bashrc``, ``/etc/passwd``, a FIFO) is refused with a
    :class:`ConfigError` before building, and never overwritten."""
    what = f"[engine] timing_cache {path}"
    if not os.path.lexists(path):
        return config.create_timing_cache(b"")
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{what}: exists and is not a regular file; the build replaces this file, so it must "
                          "be absent or a TensorRT timing cache (name a new path)")
    blob = read_regular(path, "timing cache", max_bytes=MAX_TIMING_CACHE_BYTES, error=ConfigError)
    if not blob:
        return config.create_timing_cache(b"")
    errors = len(logger.errors)
    try:
        cache = config.create_timing_cache(blob)
    except Exception as exc:  # TensorRT's own deserializer refused it
        cache, detail = None, f"{type(exc).__name__}: {exc}"
    else:
        detail = "; ".join(logger.errors[errors:])
    if cache is None or len(logger.errors) > errors:
        raise ConfigError(f"{what}: exists but TensorRT {version} does not read it as a timing cache "
                          f"({detail[:200] or 'refused'}); the build would replace it, so it is left as it is "
                          "(name a new path, or delete the file if it is a stale cache)")
    return cache


def build_engine(
    onnx_path: str | Path,
    plan_path: str | Path,
    profile: Profile | dict[str, Any],
    workspace_bytes: int = 4 << 30,
    timing_cache_path: str | Path | None = None,
    *,
    compiler: Compiler | str = Compiler.AUTO,
    targets: list[str] | None = None,
    weight_format: WeightFormat | str | None = None,
    dequantize_fp4: bool = False,
    compute_capability: tuple[int, int] | None = None,
    tf32: bool = False,
    builder_optimization_level: int | None = None,
    verbose: bool = False,
    contract: str = "error",
) -> EngineBuild:
    """Build ``plan_path`` from an exported LM-head or embedding graph (see the module docstring).

    ``compiler``: ``auto`` | ``tensorrt`` | ``tensorrt-rtx``. ``targets``: TensorRT-RTX target
    names (None: every target whose hardware has the graph's datatypes).
    ``compute_capability``: standard TensorRT's target (default: the local GPU), or the one
    TensorRT-RTX target. ``dequantize_fp4``: an NVFP4 head below FP4 hardware is built with
    its weights dequantized (W4A16 numbers). ``contract``: ``"error"`` fails the build when the
    layer table breaks the head's contract, ``"warn"`` records it in ``warnings``.
    Raises :class:`ConfigError` for bad arguments and :class:`EngineUnavailableError` (one
    line) when no compiler, GPU or target can build it; nothing is written then.
    """
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    prof = validate_profile(profile)
    if not isinstance(workspace_bytes, int) or workspace_bytes <= 0:
        raise ConfigError(f"workspace_bytes must be a positive int, got {workspace_bytes!r}")
    if contract not in ("error", "warn"):
        raise ConfigError(f"contract must be 'error' or 'warn', got {contract!r}")
    info = describe_graph(onnx_path)
    if weight_format is not None and weight_format != info.weight_format:
        raise ConfigError(f"weight_format {str(weight_format)!r} but {onnx_path} was exported as "
                          f"{str(info.weight_format)!r}")
    kit = resolve_compiler(compiler)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    # Scratch space beside the plan (same filesystem; the dequantized graph can be large).
    with tempfile.TemporaryDirectory(prefix=f".{plan_path.name}.build-", dir=plan_path.parent) as scratch:
        parsed = onnx_path
        if kit.aot:
            wants_dequantize = (dequantize_fp4 and info.weight_format is WeightFormat.NVFP4
                                and not info.dequantize_fp4 and info.graph == "lm_head")
            if wants_dequantize:
                parsed = _dequantized(onnx_path, Path(scratch))
                info = describe_graph(parsed)
            plan = _plan_rtx(kit, info, targets, compute_capability)
        else:
            if targets:
                raise ConfigError("engine targets name TensorRT-RTX targets; standard TensorRT builds for the "
                                  "local GPU (use compute_capability)")
            plan = _plan_standard(kit, info, compute_capability, dequantize_fp4)
            if plan.mode == DEQUANTIZE_FP4 and not info.dequantize_fp4:
                parsed = _dequantized(onnx_path, Path(scratch))
                info = describe_graph(parsed)
        return _build(plan, info, parsed, plan_path, prof, workspace_bytes, timing_cache_path, tf32,
                      builder_optimization_level, verbose, contract, onnx_path)


def _dequantized(onnx_path: Path, scratch: Path) -> Path:
    from trtvocab.export.onnx import dequantize_fp4_onnx

    parsed = scratch / onnx_path.name
    try:
        dequantize_fp4_onnx(onnx_path, parsed)
    except QuantizationError as exc:
        raise EngineUnavailableError(str(exc)) from None
    return parsed


def _shapes(prof: Profile, info: GraphInfo) -> dict[str, tuple[tuple[int, ...], ...]]:
    if info.graph == "embedding":
        return {EMBED_IDS: tuple((t,) for t in (prof.min_tokens, prof.opt_tokens, prof.max_tokens))}
    return prof.shapes(info.hidden_size, SEQ_LENS in info.inputs)


def _build(plan: _Plan, info: GraphInfo, parsed: Path, plan_path: Path, prof: Profile, workspace_bytes: int,
           timing_cache_path: str | Path | None, tf32: bool, opt_level: int | None, verbose: bool, contract: str,
           source: Path) -> EngineBuild:
    trt = plan.kit.trt
    started = time.monotonic()
    # Warnings are kept in the record (and printed by `trtvocab build`), not printed mid-build.
    logger = recording_logger(trt, trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.ERROR)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves <graph>.onnx.data relative to the graph's folder.
    if not parser.parse_from_file(str(parsed)):
        raise EngineUnavailableError(f"TensorRT could not parse {source}: {_parser_errors(parser)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    # The layer table (what the engine computes) is printed only at DETAILED verbosity.
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if info.deterministic:
        # TensorRT's promise: a row's output does not depend on how the batch is split or
        # composed (the engine-side half of LMHead(deterministic=True)).
        config.set_flag(trt.BuilderFlag.DISTRIBUTIVE_INDEPENDENCE)
    if opt_level is not None:
        config.builder_optimization_level = int(opt_level)
    opt_profile = builder.create_optimization_profile()
    network_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for name, (lo, opt, hi) in _shapes(prof, info).items():
        if name not in network_inputs:
            raise EngineUnavailableError(f"{source}: TensorRT's network has no input {name!r} "
                                         f"(it has {sorted(network_inputs)})")
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    cache_path = None
    notes: list[str] = []
    if plan.kit.aot:
        plan.kit.set_targets(config, plan.targets)  # and no timing cache: a no-op in TensorRT-RTX
        if timing_cache_path:
            notes.append(f"[engine] timing_cache {str(timing_cache_path)!r:.200} has no effect with TensorRT-RTX "
                         "(it has no timing cache): the file was neither read nor written")
    else:
        cache_path = Path(timing_cache_path) if timing_cache_path else None
        if cache_path is not None:
            config.set_timing_cache(_timing_cache(config, cache_path, logger, plan.kit.version), False)
        else:
            config.set_timing_cache(config.create_timing_cache(b""), False)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        detail = "; ".join(logger.errors[-3:]) or "see the TensorRT log"
        raise EngineUnavailableError(f"TensorRT failed to build an engine from {source}: {detail}")
    warnings = notes + list(logger.warnings)
    try:
        compute = check_engine(parse_layer_table(logger.messages), info)
    except ValueError as exc:  # a builder that printed no table: say so, don't guess
        compute = None
        warnings.append(str(exc))
    if compute is not None and compute.problems:
        if contract == "error":
            raise EngineUnavailableError(f"{source}: the engine breaks the head's contract ({compute.expected}): "
                                         + "; ".join(compute.problems) + " (nothing written; [engine] contract = "
                                         "\"warn\" records it instead)")
        warnings += compute.problems
    if compute is not None:
        warnings += compute.notes
    digest = write_plan_atomic(plan_path, blob)
    if cache_path is not None:
        write_plan_atomic(cache_path, config.get_timing_cache().serialize())  # same atomic write
    return EngineBuild(
        plan_path=str(plan_path), sha256=digest, bytes=memoryview(blob).nbytes, onnx_path=str(source),
        onnx_bytes=_graph_bytes(source), graph=info.graph, mode=plan.mode, weight_format=info.weight_format,
        compiler=plan.kit.compiler.value, tensorrt_version=plan.kit.version, targets=plan.targets,
        device=plan.device, compute_capability=cc_name(plan.cc) if plan.cc is not None else None,
        profile=prof.model_dump(), workspace_bytes=workspace_bytes,
        timing_cache_path=str(cache_path) if cache_path is not None else None, inputs=sorted(network_inputs),
        outputs=[network.get_output(i).name for i in range(network.num_outputs)],
        build_seconds=round(time.monotonic() - started, 3), distributive_independence=info.deterministic,
        compute=compute, warnings=warnings,
    )
