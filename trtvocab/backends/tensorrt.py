"""The TensorRT backend: ``rank{r}/lm_head.plan`` (and ``embedding.plan``) on a CUDA GPU.

Which GPU may run a plan depends on its compiler (the engine record says which):

* standard TensorRT: the GPU model and TensorRT version that built it, exactly;
* TensorRT-RTX: any GPU whose compute capability is one of the plan's targets, checked
  by the runtime itself (``Runtime.get_engine_validity`` reads the plan's header). Such a
  plan is run with an ``IRuntimeConfig``: a runtime cache file beside the plan keeps the
  kernels compiled for this GPU across processes, and the EAGER kernel-specialization
  strategy compiles shape-specialized kernels before the first call rather than during
  decode.

Never run on the development machines (no GPU): :func:`engine_mismatch` says so in one
line, and the standard-TensorRT glue is tested with a named test double.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from trtvocab.artifact.manifest import EngineRecord, Manifest
from trtvocab.backends.base import RankLogits
from trtvocab.base.formats import EMBED_IDS, EMBED_ROWS, HIDDEN, LOGITS, SEQ_LENS, Runtime
from trtvocab.base.inputs import check_hidden_states, last_token_rows
from trtvocab.base.publish import atomic_write_bytes
from trtvocab.base.safe_read import read_regular, sha256_bytes
from trtvocab.errors import ArtifactError, EngineUnavailableError, InputError
from trtvocab.export.targets import Compiler, target_name
from trtvocab.export.tensorrt import cuda_device, import_compiler, recording_logger

MAX_PLAN_BYTES = 64 << 30  # a plan read without a recorded size (direct EngineRunner use)
MAX_RUNTIME_CACHE_BYTES = 1 << 30
RUNTIME_CACHE_ENV = "TRTVOCAB_RUNTIME_CACHE_DIR"


def runtime_cache_dir() -> Path:
    """Where TensorRT-RTX runtime caches live: ``$TRTVOCAB_RUNTIME_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/trtvocab/rtx-runtime-cache``, else ``~/.cache/trtvocab/rtx-runtime-cache``.
    Never inside an artifact: its rank folders hold only the files its manifest lists."""
    if os.environ.get(RUNTIME_CACHE_ENV):
        return Path(os.environ[RUNTIME_CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trtvocab" / "rtx-runtime-cache"


def runtime_cache_path(plan_sha256: str, gpu: str) -> Path:
    """The runtime cache of one plan on one GPU model: keyed by the plan's sha256 and the GPU's name."""
    return runtime_cache_dir() / f"{plan_sha256}-{sha256_bytes(gpu.encode())[:16]}.runtime-cache"


def _gpu_name(device: Any) -> str:
    try:
        return str(torch.cuda.get_device_name(device))
    except Exception:  # a name only keys the cache
        return "unknown GPU"


def current_gpu() -> tuple[str, str] | None:
    """``(name, compute capability)`` of CUDA device 0, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def engine_mismatch(engine: EngineRecord, gpu: tuple[str, str] | None, trt_version: str | None) -> str | None:
    """Why the engine of ``engine`` cannot run on ``gpu`` with compiler version ``trt_version`` (None: it can).

    Standard TensorRT engines are specific to the GPU model and the TensorRT version that
    built them; TensorRT-RTX engines to their targets and the TensorRT-RTX version.
    """
    if not engine.built or engine.build is None:
        return engine.reason or "no engine was built"
    built = engine.build
    if built.compiler == Compiler.TENSORRT_RTX:
        where = f"built ahead of time by TensorRT-RTX {built.tensorrt_version} for {', '.join(built.targets)}"
        if gpu is None:
            return f"the engine was {where}; this machine has no CUDA GPU to run it"
        major, minor = (int(p) for p in gpu[1].split("."))
        if target_name((major, minor)) not in built.targets:
            return f"the engine was {where}; this GPU is {gpu[0]} ({target_name((major, minor))}): rebuild with it"
    else:
        if gpu is None:
            return "no CUDA GPU here"
        if (built.device, built.compute_capability) != gpu:
            return (f"engine was built for {built.device} (CC {built.compute_capability}), "
                    f"this GPU is {gpu[0]} (CC {gpu[1]}); rebuild it here")
    if trt_version is not None and built.tensorrt_version != trt_version:
        name = "TensorRT-RTX" if built.compiler == Compiler.TENSORRT_RTX else "TensorRT"
        return f"engine was built with {name} {built.tensorrt_version}, this is {name} {trt_version}; rebuild it"
    return None


class EngineRunner:
    """Deserialize a plan once; run it on torch CUDA tensors (``execute_async_v3`` on a torch stream).

    Args:
        plan_path: the plan file (a regular file, at most ``nbytes`` bytes when given).
        sha256: the recorded digest (None: not checked).
        nbytes: the recorded size.
        compiler: ``"tensorrt"`` or ``"tensorrt-rtx"`` (which runtime deserializes it).

    ``run(hidden [T, H], seq_lens [B] | None)`` -> float32 logits ``[B, V_local]`` (or
    ``[T, V_local]`` for a context engine) on the GPU; an embedding plan's
    ``run(input_ids [T] int64)`` -> partial rows ``[T, H]``. Inputs are validated on the host
    first (dtype, width, profile range, seq_lens) so that a bad input raises
    :class:`InputError` instead of reaching the engine.
    """

    def __init__(self, plan_path: str | Path, sha256: str | None = None, nbytes: int | None = None,
                 compiler: str = "tensorrt") -> None:
        kit = import_compiler(compiler)
        self.trt = kit.trt
        self.device = cuda_device()
        path = Path(plan_path)
        if not os.path.lexists(path):
            raise ArtifactError(f"no TensorRT plan at {path}")
        # A regular file only, and no more bytes than recorded (a FIFO or /dev/zero never blocks).
        blob = read_regular(path, "TensorRT plan", max_bytes=nbytes if nbytes is not None else MAX_PLAN_BYTES)
        if nbytes is not None and len(blob) != nbytes:
            raise ArtifactError(f"{path}: {len(blob)} bytes, the artifact records {nbytes} (partial or replaced plan)")
        if sha256 is not None and sha256_bytes(blob) != sha256:
            raise ArtifactError(f"{path}: sha256 does not match the recorded one (partial or replaced plan)")
        self.logger = recording_logger(self.trt, self.trt.ILogger.Severity.WARNING)
        self.runtime = self.trt.Runtime(self.logger)
        if kit.aot:
            validity, diagnostics = self.runtime.get_engine_validity(blob)
            if validity == self.trt.EngineValidity.INVALID:  # SUBOPTIMAL runs (JIT fills the gap)
                raise ArtifactError(f"{path}: TensorRT-RTX {kit.version} says this plan cannot run on this GPU "
                                    f"({validity}, diagnostics {diagnostics})")
        self.engine = self.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise ArtifactError(f"{path}: {compiler} {kit.version} cannot deserialize this plan (built by "
                                f"another version or for another GPU): {'; '.join(self.logger.errors)}")
        self.cache_path = runtime_cache_path(sha256 or sha256_bytes(blob), _gpu_name(self.device)) if kit.aot \
            else None
        self._cache_saved = False
        self.runtime_config = self._runtime_config() if kit.aot else None
        self.context = (self.engine.create_execution_context(self.runtime_config) if self.runtime_config is not None
                        else self.engine.create_execution_context())
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode_in = self.trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode_in]
        self.outputs = [n for n in names if n not in self.inputs]
        self.kind = "embedding" if self.inputs == [EMBED_IDS] and self.outputs == [EMBED_ROWS] else "lm_head"
        if self.kind == "lm_head" and (HIDDEN not in self.inputs or self.outputs != [LOGITS]):
            raise ArtifactError(f"{path}: engine I/O {names} is not a trtvocab LM head or embedding")

    def _runtime_config(self) -> Any:
        """TensorRT-RTX: compiled kernels cached beside the plan; shape-specialized kernels built eagerly."""
        config = self.engine.create_runtime_config()
        config.dynamic_shapes_kernel_specialization_strategy = \
            self.trt.DynamicShapesKernelSpecializationStrategy.EAGER
        cache = config.create_runtime_cache()
        assert self.cache_path is not None
        if self.cache_path.is_file():
            blob = read_regular(self.cache_path, "TensorRT-RTX runtime cache", max_bytes=MAX_RUNTIME_CACHE_BYTES)
            if not cache.deserialize(blob):  # a stale or foreign cache is rebuilt, not trusted
                cache.reset()
        config.set_runtime_cache(cache)
        self._cache = cache
        return config

    def save_runtime_cache(self) -> None:
        """Write the kernels compiled so far to :func:`runtime_cache_path` (atomically; a private folder),
        for the next process. Nothing is written into the artifact."""
        if self.cache_path is not None:
            self.cache_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write_bytes(self.cache_path, memoryview(self._cache.serialize()))

    def _torch_dtype(self, name: str) -> Any:
        dt = self.engine.get_tensor_dtype(name)
        table = {self.trt.DataType.FLOAT: torch.float32, self.trt.DataType.HALF: torch.float16,
                 self.trt.DataType.BF16: torch.bfloat16, self.trt.DataType.INT32: torch.int32,
                 self.trt.DataType.INT64: torch.int64}
        if dt not in table:
            raise ArtifactError(f"engine tensor {name} has unsupported type {dt}")
        return table[dt]

    def _check_range(self, name: str, extent: int, what: str) -> None:
        lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
        if not lo[0] <= extent <= hi[0]:
            raise InputError(f"{what} = {extent} is outside the engine's profile [{lo[0]}, {hi[0]}]; "
                             "rebuild with a wider [profile]")

    def _execute(self, feeds: dict[str, torch.Tensor], output: str, stream: Any) -> torch.Tensor:
        for name, tensor in feeds.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        out = torch.empty(tuple(self.context.get_tensor_shape(output)), dtype=self._torch_dtype(output),
                          device=self.device)
        self.context.set_tensor_address(output, out.data_ptr())
        stream = stream or torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineUnavailableError(f"TensorRT execution failed: {'; '.join(self.logger.errors[-3:])}")
        # Inputs may be temporaries: keep them alive until the engine has read them.
        for tensor in feeds.values():
            tensor.record_stream(stream)
        if self.cache_path is not None and not self._cache_saved:
            self._cache_saved = True
            with contextlib.suppress(OSError):  # an unwritable cache folder: it still runs, only slower next time
                stream.synchronize()
                self.save_runtime_cache()
        return out

    def lookup(self, input_ids: Any, stream: Any = None) -> torch.Tensor:
        """An embedding plan: ``input_ids [T]`` (int64) -> this rank's partial rows ``[T, H]``."""
        if self.kind != "embedding":
            raise ArtifactError("lookup() needs an embedding plan; this one is an LM head")
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{EMBED_IDS}: expected a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
        self._check_range(EMBED_IDS, ids.shape[0], "T (tokens)")
        return self._execute({EMBED_IDS: ids.to(self.device, torch.int64).contiguous()}, EMBED_ROWS, stream)

    def run(self, hidden: Any, seq_lens: Any = None, stream: Any = None) -> Any:
        if self.kind != "lm_head":
            raise ArtifactError("run() needs an LM-head plan; use lookup() for an embedding plan")
        want_dtype = self._torch_dtype(HIDDEN)
        check_hidden_states(hidden, hidden_size=self.engine.get_tensor_shape(HIDDEN)[1], dtype=want_dtype,
                            what=HIDDEN)
        total = hidden.shape[0]
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
        return self._execute(feeds, LOGITS, stream)


class TensorRTBackend:
    """One rank's engine; logits come back to the CPU as float32.

    Args:
        root: the artifact folder.
        manifest: its manifest.
        rank: the rank whose plan to run.
    """

    name: ClassVar[str] = "tensorrt"

    def __init__(self, root: Path, manifest: Manifest, rank: int) -> None:
        entry = manifest.entry(rank)
        if entry.files.plan is None or entry.engine.build is None:
            raise EngineUnavailableError(f"rank {rank} of {root} has no engine: {entry.engine.reason}")
        build = entry.engine.build
        self.runner = EngineRunner(Path(root) / entry.files.plan, build.sha256, build.bytes, build.compiler)
        self.context = manifest.head.context_logits

    def rank_logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> RankLogits:
        lens = None if self.context or seq_lens is None else seq_lens.to(torch.int32)
        return RankLogits(self.runner.run(hidden, lens).float().cpu(), Runtime.TENSORRT)
