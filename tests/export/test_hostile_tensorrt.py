"""Hostile TensorRT caches (``trtvocab/backends/tensorrt.py``, ``trtvocab/export/tensorrt.py``): the TensorRT-RTX
runtime cache lives outside the artifact, keyed by the plan, and is read on the second load; a
``timing_cache`` path naming a file that is not a timing cache is refused and left alone. Test doubles of
both runtimes.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.export.test_tensorrt_glue import PROFILE, FakeTensorRT, dense_graph
from tests.export.test_tensorrt_glue import fake_trt as fake_trt_fixture
from tests.hostile import build_art, copy_art
from trtvocab.artifact import store as artifacts
from trtvocab.errors import ConfigError
from trtvocab.export import tensorrt as T


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_art(tmp_path_factory)


# ==== the TensorRT-RTX runtime cache is kept outside the artifact =============================================
class _RtxDouble:
    """TEST DOUBLE of ``tensorrt_rtx`` as EngineRunner uses it: an engine with one input and one output,
    a runtime cache that records what it was given and serializes to fixed bytes."""

    __version__ = "1.7.1.fake"

    def __init__(self) -> None:
        self.loaded: list[bytes] = []
        double = self

        class Severity:
            INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        class ILogger:
            def __init__(self) -> None:
                pass

        ILogger.Severity = Severity  # type: ignore[attr-defined]
        self.ILogger = ILogger
        self.EngineValidity = types.SimpleNamespace(VALID=0, INVALID=2)
        self.DynamicShapesKernelSpecializationStrategy = types.SimpleNamespace(EAGER="eager")
        self.TensorIOMode = types.SimpleNamespace(INPUT="in", OUTPUT="out")

        class Cache:
            def deserialize(self, blob: bytes) -> bool:
                double.loaded.append(bytes(blob))
                return True

            def reset(self) -> None:
                pass

            def serialize(self) -> bytes:
                return b"KERNELS-FOR-THIS-GPU"

        class RuntimeConfig:
            dynamic_shapes_kernel_specialization_strategy = None

            def create_runtime_cache(self) -> Cache:
                return Cache()

            def set_runtime_cache(self, cache: Cache) -> None:
                pass

        class Engine:
            num_io_tensors = 2

            def create_runtime_config(self) -> RuntimeConfig:
                return RuntimeConfig()

            def create_execution_context(self, config: Any = None) -> object:
                return object()

            def get_tensor_name(self, i: int) -> str:
                return ["hidden_states", "logits"][i]

            def get_tensor_mode(self, name: str) -> str:
                return "in" if name == "hidden_states" else "out"

        class Runtime:
            def __init__(self, logger: Any) -> None:
                pass

            def get_engine_validity(self, blob: bytes) -> tuple[int, str]:
                return 0, ""

            def deserialize_cuda_engine(self, blob: bytes) -> Engine:
                return Engine()

        self.Runtime = Runtime


def test_p11_runtime_cache_is_kept_outside_the_artifact_and_read_on_the_second_load(
        art: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """p11 on the runner's side (a simulated GPU): the first load writes its cache under
    $TRTVOCAB_RUNTIME_CACHE_DIR keyed by the plan's sha256, nothing in the rank folder; the second
    load (a new runner, as a new process would) reads it; the artifact still verifies."""
    from trtvocab.backends import tensorrt as trt_backend
    from trtvocab.export.targets import Compiler
    from trtvocab.export.tensorrt import Toolkit

    double = _RtxDouble()
    monkeypatch.setattr(trt_backend, "import_compiler", lambda c: Toolkit(Compiler.TENSORRT_RTX, double))
    monkeypatch.setattr(trt_backend, "cuda_device", lambda: "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake RTX 5090 (test double)")
    monkeypatch.setenv("TRTVOCAB_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    root = copy_art(art, tmp_path / "a")
    plan = root / "rank0" / "lm_head.plan"
    built = plan.exists()  # an RTX plan where tensorrt_rtx is installed; else a stand-in the double accepts
    if not built:
        plan.write_bytes(b"FAKE-RTX-PLAN")
    before = sorted(p.name for p in (root / "rank0").iterdir())
    first = trt_backend.EngineRunner(plan, None, None, "tensorrt-rtx")
    first.save_runtime_cache()
    assert sorted(p.name for p in (root / "rank0").iterdir()) == before  # nothing written into the artifact
    assert first.cache_path is not None and first.cache_path.parent == tmp_path / "cache"
    assert first.cache_path.read_bytes() == b"KERNELS-FOR-THIS-GPU"
    second = trt_backend.EngineRunner(plan, None, None, "tensorrt-rtx")
    assert second.cache_path == first.cache_path and double.loaded == [b"KERNELS-FOR-THIS-GPU"]
    if not built:
        plan.unlink()
    artifacts.read_manifest(root)  # the second load's verification passes: the rank folder is as built


# ==== [engine] timing_cache never overwrites a file that is not a timing cache ================================
fake_trt = fake_trt_fixture  # test_tensorrt_glue.py's double of standard TensorRT on a pretended CC 9.0 GPU


def test_a1_timing_cache_path_naming_a_foreign_file_is_refused_and_left_alone(
        tmp_path: Path, fake_trt: Callable[..., FakeTensorRT]) -> None:
    """A1 (code reading): with standard TensorRT the build read ``[engine] timing_cache`` and then replaced
    it atomically, whatever it was (``~/.bashrc``, ``/etc/passwd``). A file TensorRT does not read as a
    timing cache is now refused before building and left byte for byte; a real cache is still updated."""
    fake_trt(cache_ok=lambda blob: blob.startswith(b"TIMING-CACHE") or blob == b"OLD-CACHE")
    graph = dense_graph(tmp_path)
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"export PATH=$HOME/bin:$PATH\n")
    with pytest.raises(ConfigError, match=r"timing_cache .*bashrc: exists but TensorRT"):
        T.build_engine(graph, tmp_path / "out" / "lm_head.plan", PROFILE, 1 << 30, victim)
    assert victim.read_bytes() == b"export PATH=$HOME/bin:$PATH\n"
    assert not (tmp_path / "out" / "lm_head.plan").exists()
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        T.build_engine(graph, tmp_path / "out" / "lm_head.plan", PROFILE, 1 << 30, folder)
    cache = tmp_path / "timing.cache"  # absent: created; then a cache TensorRT reads: updated
    T.build_engine(graph, tmp_path / "out" / "lm_head.plan", PROFILE, 1 << 30, cache)
    assert cache.read_bytes() == b"TIMING-CACHE"
    T.build_engine(graph, tmp_path / "out" / "lm_head.plan", PROFILE, 1 << 30, cache)
    assert cache.read_bytes() == b"TIMING-CACHE"
