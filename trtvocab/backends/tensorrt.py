"""The TensorRT backend: ``rank{r}/lm_head.plan`` on a CUDA GPU, where TensorRT and that GPU exist.

An engine is specific to the GPU model and the TensorRT version that built it, so the
artifact's engine record is checked against both before a plan is opened
(:func:`engine_mismatch`). Never run on the development machines (no TensorRT, no GPU):
its glue is tested with a named test double, never as verification of TensorRT.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from trtvocab.backends.base import RankLogits
from trtvocab.errors import ArtifactError, EngineUnavailableError, InputError
from trtvocab.export.tensorrt import cuda_device, import_tensorrt, recording_logger
from trtvocab.formats import HIDDEN, LOGITS, SEQ_LENS
from trtvocab.fsutil import read_regular, sha256_bytes
from trtvocab.inputs import check_hidden_states, last_token_rows
from trtvocab.recipe import EngineRecord, Manifest

MAX_PLAN_BYTES = 64 << 30  # a plan read without a recorded size (direct EngineRunner use)


def current_gpu() -> tuple[str, str] | None:
    """``(name, compute capability)`` of CUDA device 0, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def engine_mismatch(engine: EngineRecord, gpu: tuple[str, str] | None, trt_version: str | None) -> str | None:
    """Why the engine of ``engine`` cannot run on ``gpu`` with TensorRT ``trt_version`` (None: it can).

    TensorRT engines are specific to the GPU model and the TensorRT version that built
    them; running one elsewhere fails or, worse, runs kernels tuned for another chip.
    """
    if not engine.built or engine.build is None:
        return engine.reason or "no engine was built"
    if gpu is None:
        return "no CUDA GPU here"
    built = engine.build
    if (built.device, built.compute_capability) != gpu:
        return (f"engine was built for {built.device} (CC {built.compute_capability}), "
                f"this GPU is {gpu[0]} (CC {gpu[1]}); rebuild it here")
    if trt_version is not None and built.tensorrt_version != trt_version:
        return f"engine was built with TensorRT {built.tensorrt_version}, this is TensorRT {trt_version}; rebuild it"
    return None


class EngineRunner:
    """Deserialize a plan once; run it on torch CUDA tensors (``execute_async_v3`` on a torch stream).

    ``run(hidden [T, H], seq_lens [B] | None)`` -> float32 logits ``[B, V_local]`` (or
    ``[T, V_local]`` for a context engine) on the GPU. Inputs are validated on the host
    first (dtype, width, profile range, seq_lens) so that a bad input raises
    :class:`InputError` instead of reaching the engine.
    """

    def __init__(self, plan_path: str | Path, sha256: str | None = None, nbytes: int | None = None):
        self.trt = import_tensorrt()
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


class TensorRTBackend:
    """One rank's engine; logits come back to the CPU as float32."""

    name: ClassVar[str] = "tensorrt"

    def __init__(self, root: Path, manifest: Manifest, rank: int) -> None:
        entry = manifest.entry(rank)
        if entry.files.plan is None or entry.engine.build is None:
            raise EngineUnavailableError(f"rank {rank} of {root} has no engine: {entry.engine.reason}")
        self.runner = EngineRunner(Path(root) / entry.files.plan, entry.engine.build.sha256, entry.engine.build.bytes)
        self.context = manifest.head.context_logits

    def rank_logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> RankLogits:
        lens = None if self.context or seq_lens is None else seq_lens.to(torch.int32)
        return RankLogits(self.runner.run(hidden, lens).float().cpu(), self.name)
