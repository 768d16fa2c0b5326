"""The TensorRT builder's glue: everything around TensorRT that can be checked without it.

``FakeTensorRT`` below is a TEST DOUBLE of the ``tensorrt`` module. It exists only to
drive the glue in :func:`build_engine` (compute-capability gate, profile shapes, parser
error messages, timing cache and the atomic plan write with a fake serialized blob).
It verifies nothing about TensorRT or about an engine: the one test that does
(``test_real_engine_matches_fallback``) needs ``import tensorrt`` and a CUDA GPU and is
skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from trtvocab import LMHead, Mapping
from trtvocab.backends.tensorrt import EngineRunner
from trtvocab.errors import ArtifactError, ConfigError, EngineUnavailableError
from trtvocab.export import tensorrt as T
from trtvocab.export.onnx import export_onnx

PROFILE = {"min_tokens": 1, "opt_tokens": 16, "max_tokens": 64, "min_batch": 1, "opt_batch": 4, "max_batch": 32}
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def dense_graph(tmp_path: Path, context: bool = False, dtype=torch.bfloat16) -> Path:
    head = LMHead(37, 64, dtype=dtype, mapping=Mapping(world_size=3, rank=1, tp_size=3))
    head.load_weights({"weight": (torch.randn(37, 64, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)})
    return Path(export_onnx(head, tmp_path / "lm_head.onnx", context_logits=context).path)


# ---- without standard TensorRT (this machine) ----------------------------------------------------------
@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is importable here")
def test_unavailable_reason_is_one_line():
    ok, reason = T.tensorrt_available("tensorrt")
    assert not ok and "TensorRT" in reason and "\n" not in reason


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is importable here")
def test_build_engine_without_tensorrt_raises_one_line(tmp_path):
    graph = dense_graph(tmp_path)
    with pytest.raises(EngineUnavailableError) as err:
        T.build_engine(graph, tmp_path / "lm_head.plan", PROFILE, 1 << 30, compiler="tensorrt")
    assert "TensorRT is not importable" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "lm_head.plan").exists()
    with pytest.raises(EngineUnavailableError, match="TensorRT is not importable"):
        EngineRunner(tmp_path / "lm_head.plan")


def test_module_imports_without_tensorrt():
    assert "tensorrt" not in sys.modules or HAVE_TRT  # importing trtvocab.export.tensorrt did not need it


# ---- compute capability -------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "cc", "dequant", "want"), [
    ("dense", (7, 5), False, "native"),
    ("FP8", (8, 9), False, "native"),
    ("FP8", (9, 0), False, "native"),
    ("NVFP4", (10, 0), False, "native"),
    ("NVFP4", (12, 0), False, "native"),
    ("NVFP4", (10, 0), True, "native"),  # native FP4 wins where the GPU has it
    ("NVFP4", (9, 0), True, "dequantize_fp4"),
    ("NVFP4", (8, 9), True, "dequantize_fp4"),
])
def test_compute_capability_allows(fmt, cc, dequant, want):
    assert T.check_compute_capability(fmt, cc, dequantize_fp4=dequant) == want


@pytest.mark.parametrize(("fmt", "cc", "dequant", "message"), [
    ("FP8", (8, 6), False, "FP8 engines need compute capability >= 8.9"),
    ("FP8", (8, 0), True, "FP8 engines need compute capability >= 8.9"),
    ("NVFP4", (9, 0), False, "NVFP4 engines need compute capability >= 10.0.*dequantize_fp4=True"),
    ("NVFP4", (7, 5), True, "NVFP4 engines need compute capability >= 10.0"),
    ("INT8", (9, 0), False, "no TensorRT engine for weight format"),
])
def test_compute_capability_refuses(fmt, cc, dequant, message):
    with pytest.raises(EngineUnavailableError, match=message) as err:
        T.check_compute_capability(fmt, cc, dequantize_fp4=dequant)
    assert "\n" not in str(err.value)


def test_bf16_needs_ampere():
    with pytest.raises(EngineUnavailableError, match="bfloat16"):
        T.check_compute_capability("dense", (7, 5), dtype="bfloat16")
    assert T.check_compute_capability("dense", (7, 5), dtype="float16") == "native"


# ---- profile --------------------------------------------------------------------------------------------
def test_profile_validation():
    p = T.validate_profile(PROFILE)
    assert p.shapes(64, True) == {"hidden_states": ((1, 64), (16, 64), (64, 64)), "seq_lens": ((1,), (4,), (32,))}
    assert set(p.shapes(64, False)) == {"hidden_states"}
    assert T.validate_profile(p) is p
    assert T.validate_profile({}).max_tokens == 8192  # defaults
    bad = [
        ({**PROFILE, "max_tokenz": 5}, "unknown keys \\['max_tokenz'\\]"),
        ({**PROFILE, "min_tokens": 32}, "min_tokens <= opt_tokens"),
        ({**PROFILE, "opt_batch": 64}, "opt_batch <= max_batch"),
        ({**PROFILE, "max_batch": 65, "opt_batch": 4}, "max_batch \\(65\\) > max_tokens"),
        ({**PROFILE, "min_batch": 2, "min_tokens": 1}, "min_batch \\(2\\) > min_tokens"),
        ({**PROFILE, "min_tokens": 0}, "min_tokens"),
        ({**PROFILE, "max_tokens": "many"}, "max_tokens"),
        ([1, 2], "must be a dict"),
    ]
    for profile, message in bad:
        with pytest.raises(ConfigError, match=message):
            T.validate_profile(profile)


def test_bad_profile_is_reported_before_tensorrt(tmp_path):
    with pytest.raises(ConfigError, match="min_tokens <= opt_tokens"):
        T.build_engine(dense_graph(tmp_path), tmp_path / "p.plan", {**PROFILE, "min_tokens": 99})
    with pytest.raises(ArtifactError, match="no ONNX graph"):
        T.build_engine(tmp_path / "missing.onnx", tmp_path / "p.plan", PROFILE)


# ---- atomic plan write (fake serialized blob) ---------------------------------------------------------------
def test_write_plan_atomic(tmp_path):
    path = tmp_path / "sub" / "lm_head.plan"
    digest = T.write_plan_atomic(path, b"engine-v1")
    assert path.read_bytes() == b"engine-v1" and digest == T.sha256_bytes(b"engine-v1")
    T.write_plan_atomic(path, memoryview(bytearray(b"engine-v2")))  # any buffer, like IHostMemory
    assert path.read_bytes() == b"engine-v2"
    with pytest.raises(EngineUnavailableError, match="empty engine"):
        T.write_plan_atomic(path, b"")
    assert sorted(p.name for p in path.parent.iterdir()) == ["lm_head.plan"]


def test_write_plan_failure_leaves_old_plan(tmp_path, monkeypatch):
    path = tmp_path / "lm_head.plan"
    T.write_plan_atomic(path, b"good")

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        T.write_plan_atomic(path, b"half-written-new-engine")
    assert path.read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_head.plan"]
    with pytest.raises(OSError):
        T.write_plan_atomic(tmp_path / "new.plan", b"x")
    assert not (tmp_path / "new.plan").exists()


# ---- build_engine's glue, driven by a TEST DOUBLE of tensorrt (not an engine check) ------------------------------
class FakeTensorRT(types.ModuleType):
    """TEST DOUBLE of the ``tensorrt`` module: records the calls build_engine makes.

    It accepts whatever it is given and returns a fake serialized blob; it says nothing
    about whether TensorRT would parse or build the graph.
    """

    def __init__(self, *, parse_ok: bool = True, blob: bytes | None = b"FAKE-PLAN",
                 cache_ok: Callable[[bytes], bool] = lambda blob: True) -> None:
        super().__init__("tensorrt")
        self.__version__ = "11.0.0.fake"
        self.calls: dict = {"profile": {}}
        fake = self

        class Severity:
            INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        class ILogger:
            def __init__(self) -> None:
                pass

        ILogger.Severity = Severity
        self.ILogger = ILogger
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
        self.BuilderFlag = types.SimpleNamespace(TF32="tf32", DISTRIBUTIVE_INDEPENDENCE="di")
        self.ProfilingVerbosity = types.SimpleNamespace(DETAILED="detailed")

        class Tensor:
            def __init__(self, name):
                self.name = name

        class Network:
            def __init__(self):
                self.inputs: list[Tensor] = []

            num_inputs = property(lambda self: len(self.inputs))
            num_outputs = 1

            def get_input(self, i):
                return self.inputs[i]

            def get_output(self, i):
                return Tensor("logits")

        class ParserError:
            def node_name(self):
                return "lm_head/TRT_FP4DynamicQuantize_9"

            def node(self):
                return 9

            def node_operator(self):
                return "TRT_FP4DynamicQuantize"

            def desc(self):
                return "unsupported on this platform"

            def code(self):
                return "UNSUPPORTED_NODE"

        class OnnxParser:
            def __init__(self, network, logger):
                self.network = network
                self.num_errors = 0 if parse_ok else 1

            def parse_from_file(self, path):
                model = onnx.load(path, load_external_data=False)
                fake.calls["parsed"] = path
                fake.calls["initializer_types"] = {t.data_type for t in model.graph.initializer}
                self.network.inputs = [Tensor(vi.name) for vi in model.graph.input]
                return parse_ok

            def get_error(self, i):
                return ParserError()

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls["profile"][name] = (lo, opt, hi)

        class Cache:
            def serialize(self):
                return b"TIMING-CACHE"

        class Config:
            builder_optimization_level = 3

            def set_memory_pool_limit(self, pool, size):
                fake.calls["workspace"] = (pool, size)

            def clear_flag(self, flag):
                fake.calls["cleared"] = flag

            def set_flag(self, flag):
                fake.calls.setdefault("set_flags", []).append(flag)

            def add_optimization_profile(self, profile):
                fake.calls["profiles_added"] = fake.calls.get("profiles_added", 0) + 1

            def create_timing_cache(self, blob):
                fake.calls["cache_in"] = bytes(blob)
                return Cache() if cache_ok(bytes(blob)) else None  # TensorRT: None for a blob it cannot read

            def set_timing_cache(self, cache, ignore_mismatch):
                fake.calls["cache_set"] = ignore_mismatch

            def get_timing_cache(self):
                return Cache()

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls["network_flags"] = flags
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return None if blob is None else memoryview(blob)

        self.Builder, self.OnnxParser = Builder, OnnxParser


@pytest.fixture
def fake_trt(monkeypatch):
    """Install the test double as ``tensorrt`` and pretend a CUDA GPU of CC 9.0 exists."""

    def install(**kwargs):
        fake = FakeTensorRT(**kwargs)
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H100 (test double)")
        return fake

    return install


def test_glue_with_test_double_writes_plan_and_cache(tmp_path, fake_trt):
    fake = fake_trt()
    assert T.tensorrt_available() == (True, "TensorRT 11.0.0.fake on Fake H100 (test double) (CC 9.0)")
    graph = dense_graph(tmp_path)
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"OLD-CACHE")
    info = T.build_engine(graph, tmp_path / "out" / "lm_head.plan", PROFILE, 1 << 30, cache)
    assert (tmp_path / "out" / "lm_head.plan").read_bytes() == b"FAKE-PLAN"
    assert info.sha256 == T.sha256_bytes(b"FAKE-PLAN") and info.bytes == 9 and info.mode == "native"
    assert info.weight_format == "dense" and info.compute_capability == "9.0"
    assert info.compiler == "tensorrt" and info.targets == ["sm90"] and info.device == "Fake H100 (test double)"
    assert info.compute is None and any("no layer table" in w for w in info.warnings)  # the double prints none
    assert fake.calls["network_flags"] == 1  # STRONGLY_TYPED
    assert fake.calls["cleared"] == "tf32" and fake.calls["workspace"] == ("workspace", 1 << 30)
    assert fake.calls["profile"] == {"hidden_states": ((1, 64), (16, 64), (64, 64)),
                                     "seq_lens": ((1,), (4,), (32,))}
    assert fake.calls["cache_in"] == b"OLD-CACHE" and cache.read_bytes() == b"TIMING-CACHE"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lm_head.plan"]  # scratch removed
    assert info.model_dump()["inputs"] == ["hidden_states", "seq_lens"]


def test_glue_context_graph_profiles_tokens_only(tmp_path, fake_trt):
    fake = fake_trt()
    T.build_engine(dense_graph(tmp_path, context=True), tmp_path / "p.plan", PROFILE)
    assert set(fake.calls["profile"]) == {"hidden_states"}


def test_glue_parser_errors_name_the_node(tmp_path, fake_trt):
    fake_trt(parse_ok=False)
    with pytest.raises(EngineUnavailableError, match=r"node lm_head/TRT_FP4DynamicQuantize_9 "
                                                     r"\(TRT_FP4DynamicQuantize\): unsupported") as err:
        T.build_engine(dense_graph(tmp_path), tmp_path / "p.plan", PROFILE)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "p.plan").exists()


def test_glue_failed_build_writes_nothing(tmp_path, fake_trt):
    fake_trt(blob=None)
    with pytest.raises(EngineUnavailableError, match="failed to build"):
        T.build_engine(dense_graph(tmp_path), tmp_path / "p.plan", PROFILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_head.onnx"]


def test_glue_gates_fp8_and_nvfp4_on_hopper(tmp_path, fake_trt):
    from tests.export.test_export_onnx import make_head

    fake = fake_trt()
    fp8 = export_onnx(make_head("FP8", activation="static"), tmp_path / "fp8.onnx").path
    assert T.build_engine(fp8, tmp_path / "fp8.plan", PROFILE).mode == "native"  # CC 9.0 >= 8.9
    w4a16 = export_onnx(make_head("NVFP4", activation="none"), tmp_path / "w4a16.onnx").path
    with pytest.raises(EngineUnavailableError, match=r">= 10\.0.*dequantize_fp4=True"):
        T.build_engine(w4a16, tmp_path / "w4a16.plan", PROFILE)
    info = T.build_engine(w4a16, tmp_path / "w4a16.plan", PROFILE, dequantize_fp4=True)
    assert info.mode == "dequantize_fp4" and info.onnx_path == w4a16
    # What the (fake) parser was handed: the rebuilt graph, with no FP4 tensor left in it.
    assert onnx.TensorProto.FLOAT4E2M1 not in fake.calls["initializer_types"]
    assert onnx.TensorProto.BFLOAT16 in fake.calls["initializer_types"]
    pre = export_onnx(make_head("NVFP4", activation="none"), tmp_path / "pre.onnx", dequantize_fp4=True).path
    info = T.build_engine(pre, tmp_path / "pre.plan", PROFILE)  # exported dequantized: no FP4 gate
    assert info.mode == "dequantize_fp4" and fake.calls["parsed"] == pre
    w4a4 = export_onnx(make_head("NVFP4", activation="static"), tmp_path / "w4a4.onnx").path
    with pytest.raises(EngineUnavailableError, match="W4A4"):
        T.build_engine(w4a4, tmp_path / "w4a4.plan", PROFILE, dequantize_fp4=True)
    with pytest.raises(ConfigError, match="exported as 'NVFP4'"):
        T.build_engine(w4a4, tmp_path / "x.plan", PROFILE, weight_format="FP8")


# ---- the real thing ------------------------------------------------------------------------------------------
def _real_engine_reason() -> str | None:
    if not HAVE_TRT:
        return "tensorrt is not importable"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.skipif(_real_engine_reason() is not None, reason=f"real engine test: {_real_engine_reason()}")
def test_real_engine_matches_fallback(tmp_path):
    from tests.export.test_export_onnx import HAVE_REAL_METHODS, SEQ_LENS, fallback, hidden_states, make_head

    impl = "real" if HAVE_REAL_METHODS else "stand-in"
    cc = torch.cuda.get_device_capability()
    cases = [("dense", "none", False, 2.0**-7), ("dense", "none", True, 2.0**-7)]
    if cc >= (8, 9):
        cases += [("FP8", "static", False, 1e-2), ("FP8", "dynamic", False, 1e-2), ("FP8", "none", False, 1e-2)]
    if cc >= (10, 0):
        cases += [("NVFP4", "static", False, 1e-2), ("NVFP4", "none", False, 1e-2)]
    x = hidden_states(torch.bfloat16)
    for fmt, activation, context, rtol in cases:
        head = make_head(fmt, activation=activation, tp=3, rank=1, impl=impl)
        name = f"{fmt}-{activation}-{'context' if context else 'last'}"
        graph = export_onnx(head, tmp_path / f"{name}.onnx", context_logits=context).path
        info = T.build_engine(graph, tmp_path / f"{name}.plan", PROFILE, 1 << 30)
        runner = EngineRunner(info.plan_path, info.sha256)
        got = runner.run(x.cuda(), None if context else SEQ_LENS).float().cpu()
        want = fallback(head, x, context)
        # GPU GEMMs (and TensorRT's own quantizer kernels) round differently from CPU float32.
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item(), msg=name)


def test_glue_manifest_engine_entry_drives_backend_choice(tmp_path, fake_trt, monkeypatch):
    """build -> manifest -> runtime, with the TensorRT test double: checks only trtvocab's glue
    (what the manifest records and how the runtime reads it), never TensorRT itself."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.backends import available_backends, pick_backend
    from trtvocab.pipeline.build import build

    fake_trt()
    recipe = parse_recipe({"checkpoint": {"synthetic": {"vocab_size": 101, "hidden_size": 64}},
                           "mapping": {"tp_size": 2}, "output": {"dir": str(tmp_path / "a")}})
    root, manifest = build(recipe)
    for entry in manifest.ranks:
        engine = entry.engine
        assert engine.built and engine.build.plan_path == "lm_head.plan"  # relative: staging paths go stale
        assert (engine.build.device, engine.build.compute_capability) == ("Fake H100 (test double)", "9.0")
        assert (root / entry.files.plan).read_bytes() == b"FAKE-PLAN"
    assert available_backends(manifest)["tensorrt"] is None
    assert pick_backend(manifest, "auto")[0] == "tensorrt"
    # The same artifact on another GPU: refused, naming the plan file, and auto falls back.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Other GPU")
    why = available_backends(manifest)["tensorrt"]
    assert why is not None and "rank0/lm_head.plan" in why and "built for Fake H100" in why
    assert pick_backend(manifest, "auto")[0] == "onnx"
