"""Hostile inputs, third round (each test named by its probe id: c25, n02, ...).

compressed-tensors config content (``re:`` patterns, nesting, ``quant_method``), the dequantize path's
scales, the TensorRT-RTX runtime cache beside an artifact's plan, the timing cache, forced kernel ISAs,
the engine requirement without ONNX, a full disk during ``quantize``. Cases that used to hang run under
a deadline, so a regression fails in seconds.
"""

from __future__ import annotations

import json
import random
import re
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.checkpoints.test_hostile_checkpoint import deadline
from tests.commands.test_hostile import assert_cli_error, cli, copy_art, recipe_dict
from tests.export.test_tensorrt_glue import PROFILE, FakeTensorRT, dense_graph
from tests.export.test_tensorrt_glue import fake_trt as fake_trt_fixture
from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.artifact import store as artifacts
from trtvocab.artifact.recipe import parse_recipe
from trtvocab.errors import ArtifactError, CheckpointError, ConfigError, PatternError, QuantizationError
from trtvocab.export import tensorrt as T
from trtvocab.pipeline.build import build
from trtvocab.quant import patterns
from trtvocab.quant.config import resolve_lm_head_quant

pytest.importorskip("compressed_tensors")
from tests.quant import ct_writer as ctw

V, H = 64, 32
CATASTROPHIC = "re:(" + "|".join(["."] * 24) + ")*Z"  # re.match: minutes on 'lm_head', hours at 48


def _ct(tmp_path: Path, name: str, preset: str = "FP8_W8A16_TENSOR") -> Path:
    return ctw.write_ct(tmp_path / name, V, H, head=preset, embed=None, seed=2)


# ==== H1 / M3: re: patterns and nesting in config.json ======================================================
def test_c25_catastrophic_ignore_pattern_is_answered_in_seconds(tmp_path: Path) -> None:
    """c25: ``ignore = ["re:(.|.|...24...)*Z"]`` hung every command that opens the checkpoint; the bounded
    matcher answers it (no match: no ``Z`` in ``lm_head``), so the head loads quantized."""
    path = _ct(tmp_path, "c25")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", [CATASTROPHIC]))
    with deadline(20):
        head = LMHead.from_checkpoint(path)
    assert head.weight_format.value == "FP8"


def test_c25b_catastrophic_target_pattern_matches_in_bounded_time(tmp_path: Path) -> None:
    """c25b: the same pattern as a config group's target: answered (no match), not hung."""
    path = _ct(tmp_path, "c25b")
    ctw.edit_config(path, lambda qc: qc["config_groups"]["group_0"]["targets"].append(CATASTROPHIC))
    with deadline(20):
        decision = resolve_lm_head_quant(path)
    assert decision.config is not None and decision.config.quant_algo.value == "FP8"


@pytest.mark.parametrize(("pattern", "needle"), [
    ("re:" + "(" * 1200 + "x" + ")" * 1200, "nest 1200 deep"),  # c27: RecursionError in re's parser
    ("re:" + "a" * 70000, "70000 characters"),
    ("re:(a)\\1|x", "back-reference"),
    ("re:(", "not a valid regular expression"),
])
def test_c27_deep_long_or_unsupported_patterns_name_the_file_and_entry(tmp_path: Path, pattern: str,
                                                                       needle: str) -> None:
    """c27 (and neighbours): a typed PatternError naming config.json, ``ignore`` and the entry."""
    path = _ct(tmp_path, "c27")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", [pattern]))
    with deadline(20), pytest.raises(PatternError) as err:
        resolve_lm_head_quant(path)
    text = str(err.value)
    for part in (str(path / "config.json"), "ignore entry", repr(pattern[:20])[:-1], needle):
        assert part in text, (part, text)


@pytest.mark.parametrize("depth", [400, 900, 100_000])
def test_c36_deeply_nested_sparsity_config_is_refused_not_recursed(tmp_path: Path, depth: int) -> None:
    """c36 / c36b: ``sparsity_config`` lists nested 400 / 900 deep raised an untyped RecursionError."""
    path = _ct(tmp_path, "c36")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["sparsity_config"] = {"groups": "NESTED"}
    nested = "[" * depth + '{"targets": ["x"]}' + "]" * depth
    (path / "config.json").write_text(json.dumps(cfg).replace('"NESTED"', nested))
    with deadline(20), pytest.raises((QuantizationError, CheckpointError)) as err:  # json's own limit past ~1000
        resolve_lm_head_quant(path)
    assert "deep" in str(err.value) and "config.json" in str(err.value), str(err.value)


REAL_PATTERNS = [r".*lm_head", r".*lm_head$", r"lm_hea", r"lm_head|", r".*", r".*self_attn.*",
                 r"model.layers.\d+.mlp.*", r".*mlp\.(gate|up|down)_proj$", r".*(q|k|v)_proj$", r"^lm_head$",
                 r"(?!.*lm_head).*", r".*(?<!lm_)head", r".*embed.*", r"[^.]+$", r"(?s).*head", r"lm_head\b",
                 r"(?:lm_){1,2}head", r".*layers\.(?!0\.).*", r"(?P<x>lm)_head", r".*?head", r"\Alm_head\Z",
                 r"(lm|model)(_head|\.embed_tokens)$", r"(?m)^lm", r"[\w.]*tokens", r".{7}", r".{8}", r"(?a)\w+$",
                 r"(?x) lm _ head", r"(?<=model\.)embed", r"(a|ab)(c|bcd)(d*)", r"x*", r"lm_head\n?$"]
NAMES = ["lm_head", "model.embed_tokens", "transformer.wte", "model.layers.0.mlp.gate_proj", "", "lm_head\n",
         "model.layers.1.self_attn.q_proj", "LM_HEAD"]


def test_bounded_matcher_answers_as_re_match_for_real_patterns() -> None:
    """The semantics kept: for the patterns real checkpoints use, the bounded matcher is ``re.match``."""
    for pattern in REAL_PATTERNS:
        compiled = patterns.compile_pattern(pattern)
        for name in NAMES:
            assert patterns.match(compiled, name) == (re.match(pattern, name) is not None), (pattern, name)


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", "_", r"\.", "[ab]", "[^a]", r"\w", r"\d", "1", "^", "$", r"\b", r"\B"]
    k = rng.random()
    if depth > 3 or k < 0.35:
        return rng.choice(atoms)
    if k < 0.55:
        return "".join(_random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3)))
    if k < 0.7:
        return "(" + "|".join(_random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"
    if k < 0.8:
        return f"(?:{_random_pattern(rng, depth + 1)})" + rng.choice(["*", "+", "?", "{0,2}", "{2}", "*?", "{1,}"])
    if k < 0.88:
        return rng.choice(["(?=", "(?!"]) + _random_pattern(rng, depth + 1) + ")"
    if k < 0.93:
        return rng.choice(["(?<=", "(?<!"]) + rng.choice(["a", "ab", r"\.", "[ab]"]) + ")"
    return _random_pattern(rng, depth + 1) + rng.choice(["*", "+", "?"])


def test_bounded_matcher_answers_as_re_match_on_random_patterns() -> None:
    """A differential check on 1500 random small patterns (anchors, ``\\b`` / ``\\B``, lookarounds, nested
    and lazy repeats) against every short name: the bounded matcher's answer is ``re.match``'s."""
    rng = random.Random(37)
    names = ["", "a", "b", "ab", "ba", "a.b", "a_1", "lm_head", "aab", "b.a.", "1a", "a\n"]
    checked = 0
    for _ in range(1500):
        pattern = _random_pattern(rng)
        try:
            compiled_re = re.compile(pattern)
        except re.error:
            continue
        try:
            compiled = patterns.compile_pattern(pattern)
        except PatternError:  # a possessive repeat ('a?+'): refused, not run
            continue
        for name in names:
            assert patterns.match(compiled, name) == (compiled_re.match(name) is not None), (pattern, name)
            checked += 1
    assert checked > 10_000


def test_bounded_matcher_stays_bounded_on_nested_repeats() -> None:
    """Nested and alternated repeats (exponential for a backtracking matcher) take a few hundred steps."""
    for pattern in ["(" + "|".join(["."] * 48) + ")*Z", "(a*)*" * 20 + "b", "((a|aa)+)+c", "(.*)*" * 8 + "Z"]:
        assert not patterns.match(patterns.compile_pattern(pattern), "a" * 30 + "lm_head")


# ==== H2: the dequantize path refuses the scales the quantized path refuses ==================================
def _set(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    return lambda t: {**t, name: make(t[name])}


def _neg_e4m3(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) | 0x80).view(torch.float8_e4m3fn)


def _one_sign_bit(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.uint8).clone()
    bits[3, 0] |= 0x80  # the sign of row 3's first block scale
    return bits.view(torch.float8_e4m3fn)


def _neg_row5(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[5] = -out[5]
    return out


SCALE_CASES = {  # probe id -> (preset, tensor, edit)
    "N02_all_block_scales_negative": ("NVFP4A16", "lm_head.weight_scale", _neg_e4m3),
    "N03_all_block_scales_zero": ("NVFP4A16", "lm_head.weight_scale", lambda t: torch.zeros_like(t)),
    "N07_fp8_row_scale_negative": ("FP8_W8A16_CHANNEL", "lm_head.weight_scale", _neg_row5),
    "N07b_fp8_row_scale_zero": ("FP8_W8A16_CHANNEL", "lm_head.weight_scale", lambda t: torch.zeros_like(t)),
    "N09_one_block_scale_sign_bit": ("NVFP4A16", "lm_head.weight_scale", _one_sign_bit),
}


@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_n02_n09_dequantize_path_refuses_what_the_quantized_path_refuses(tmp_path: Path, case: str) -> None:
    """N02 / N03 / N07 / N09: quant='none' loaded negative or zero scales (silently wrong logits) that
    quant='auto' refuses; both paths now give the same QuantizationError naming the tensor."""
    preset, name, edit = SCALE_CASES[case]
    path = _ct(tmp_path, case, preset)
    ctw.rewrite_tensors(path, _set(name, edit))
    for quant in ("auto", "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(QuantizationError) as err:
                LMHead.from_checkpoint(path, quant=quant)
        assert name in str(err.value) and "finite and > 0" in str(err.value), (quant, str(err.value))


def test_n02_nvfp4_embedding_refuses_negative_block_scales(tmp_path: Path) -> None:
    """N02 through the other user of the decompressed rows: an NVFP4 embedding (always dequantized)."""
    path = ctw.write_ct(tmp_path / "emb", V, H, head=None, embed="NVFP4A16", seed=2)
    ctw.rewrite_tensors(path, _set("model.embed_tokens.weight_scale", _neg_e4m3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(QuantizationError, match=r"model\.embed_tokens\.weight_scale: block scales"):
            VocabParallelEmbedding.from_checkpoint(path)


def test_t24_subnormal_global_scale_names_the_stored_tensor(tmp_path: Path) -> None:
    """t24 (Low): a subnormal ``weight_global_scale`` was reported as ``weight_scale_2``, a tensor the file
    does not have; both paths now name ``lm_head.weight_global_scale``."""
    path = _ct(tmp_path, "t24", "NVFP4A16")
    ctw.rewrite_tensors(path, _set("lm_head.weight_global_scale", lambda t: torch.full_like(t, 1e-45)))
    for quant in ("auto", "none"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(QuantizationError, match=r"lm_head\.weight_global_scale"):
                LMHead.from_checkpoint(path, quant=quant)


# ==== H3: the TensorRT-RTX runtime cache never lands in (and never bricks) an artifact =======================
@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tp-2 artifact (ONNX graphs and fallback weights; no engine on this machine)."""
    out = tmp_path_factory.mktemp("round3") / "art"
    root, _manifest = build(parse_recipe(recipe_dict(out), "round3.toml"))
    return root


def test_p11_x10_runtime_cache_an_earlier_run_left_does_not_brick_the_artifact(art: Path, tmp_path: Path) -> None:
    """p11 / x10: ``rank0/lm_head.plan.runtime-cache`` (what the RTX runner wrote after its first run) made
    every later ``inspect`` / ``infer`` / ``generate --artifact`` refuse the artifact. It is never opened
    (caches live outside artifacts now), so it is passed over; any other unlisted file is still refused."""
    root = copy_art(art, tmp_path / "p11")
    for name in ("lm_head.plan.runtime-cache", "embedding.plan.runtime-cache"):
        (root / "rank0" / name).write_bytes(bytes(range(256)) * 16)
    artifacts.read_manifest(root)
    code, output = cli("inspect", str(root))
    assert code == 0, output
    (root / "rank1" / "lm_head.plan.runtime-cache.tmp").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"runtime-cache\.tmp: not listed"):
        artifacts.read_manifest(root)


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


# ==== A1: [engine] timing_cache never overwrites a file that is not a timing cache ==========================
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


# ==== M1 / Lows of the [engine] options ======================================================================
@pytest.mark.parametrize("how", ["e26_recipe_require", "f11_cli_require_engine"])
def test_e26_f11_required_engine_without_onnx_fails_before_writing(tmp_path: Path, how: str) -> None:
    """e26 / f11: ``require = true`` (or ``--require-engine``) with ``[output] onnx = false`` exited 0 with no
    engine; now one EngineUnavailableError line, exit 2, nothing written."""
    out = tmp_path / "art"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n'
                      f'onnx = false\n' + ('[engine]\nrequire = true\n' if how.startswith("e26") else ""))
    code, output = cli("build", str(recipe), *([] if how.startswith("e26") else ["--require-engine"]))
    assert_cli_error(code, output, "EngineUnavailableError", "onnx = false")
    assert not out.exists()


def test_e27_notice_without_onnx_says_what_was_written(tmp_path: Path) -> None:
    """e27 (Low): with ``onnx = false`` the notice said "Wrote the ONNX graphs"; it names what was written."""
    out = tmp_path / "art"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n'
                      'onnx = false\n')
    code, output = cli("build", str(recipe))
    assert code == 0, output
    assert "Wrote the ONNX graphs" not in output and "PyTorch fallback weights only" in output


@pytest.mark.parametrize(("args", "needles"), [
    (["--compiler", "bogus"], ["--compiler 'bogus'"]),  # f01
    (["--compiler", ""], ["--compiler ''"]),  # f02
    (["--compiler", "tensorrt", "--targets", "sm89"], ["TensorRT-RTX targets", "compiler 'tensorrt'"]),  # f08
])
def test_f01_f02_f08_engine_flags_name_the_flag_and_value(tmp_path: Path, args: list[str],
                                                          needles: list[str]) -> None:
    """f01 / f02 / f08 (Low): a bad ``--compiler`` names the flag and its value; ``--compiler tensorrt`` with
    TensorRT-RTX ``--targets`` is a contradiction refused before any work."""
    recipe = tmp_path / "r.toml"
    out = tmp_path / "a"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = 101\nhidden_size = 16\n[output]\ndir = "{out}"\n')
    code, output = cli("build", str(recipe), *args)
    assert_cli_error(code, output, "ConfigError", *needles)
    assert not out.exists()


# ==== A2: a forced TRTVOCAB_KERNELS_ISA the CPU lacks is refused before building =============================
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a2_forced_isa_the_cpu_lacks_falls_back_to_torch_with_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, isa: str) -> None:
    """A2 (code reading): ``TRTVOCAB_KERNELS_ISA=avx512`` on a CPU without AVX-512 built ``-march=x86-64-v4``
    and ran its self-check (SIGILL, here and in every later process through the cached library). A CPU
    without the flags (simulated) now gets the torch path with one log line; nothing is built or loaded."""
    from trtvocab import kernels
    from trtvocab.kernels import compile as kbuild
    from trtvocab.kernels import library

    built: list[str | None] = []
    monkeypatch.setattr(kbuild, "_library", lambda verbose, isa=None: built.append(isa) or 1 / 0)
    monkeypatch.setattr(kbuild.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: {"sse2", "sse4_2", "popcnt"})  # an old x86-64
    monkeypatch.delenv(kernels.library.ENV_VAR, raising=False)
    monkeypatch.setenv(kbuild.ISA_ENV_VAR, isa)
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setattr(library, "_by_isa", {})
    with caplog.at_level("WARNING", logger="trtvocab.kernels"):
        assert kernels.load() is None
        assert kernels.load() is None
    assert built == []  # refused before building or opening a cached library
    lines = [r.getMessage() for r in caplog.records if "torch path" in r.getMessage()]
    assert len(lines) == 1 and f"{kbuild.ISA_ENV_VAR}={isa}" in lines[0] and "fma" in lines[0], lines
    with pytest.raises(RuntimeError, match="lacks"):
        library.load_isa(isa)
    monkeypatch.setenv(kbuild.ISA_ENV_VAR, "portable")  # what every x86-64 runs is not refused
    assert kbuild.isa_problem("portable") is None


def test_k05_a_huge_isa_value_is_not_echoed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """k05 (Low): a 100 000-character ``TRTVOCAB_KERNELS_ISA`` was echoed whole in a 100 179-character log line."""
    from trtvocab.kernels import compile as kbuild

    monkeypatch.setenv(kbuild.ISA_ENV_VAR, "x" * 100_000)
    with pytest.raises(ValueError) as err:
        kbuild.requested_isa()
    assert len(str(err.value)) < 300 and "100000 characters" in str(err.value)


# ==== M2: an unrecognised quant_method is named, not a symptom ==============================================
def _qm_null(cfg: dict) -> None:
    cfg["quantization_config"] = None


def _qm_missing(cfg: dict) -> None:
    del cfg["quantization_config"]["quant_method"]


def _qm_case(cfg: dict) -> None:
    cfg["quantization_config"]["quant_method"] = "Compressed-Tensors"


def _qm_list(cfg: dict) -> None:
    cfg["quantization_config"]["quant_method"] = ["compressed-tensors"]


QUANT_METHOD_CASES = {  # probe id -> (preset, edit of config.json, what the message quotes)
    "c03_qc_null": ("FP8", _qm_null, "quantization_config is None"),
    "c04_no_quant_method_fp8": ("FP8", _qm_missing, "has no quant_method"),
    "c05_quant_method_case_fp8": ("FP8", _qm_case, "quant_method is 'Compressed-Tensors'"),
    "c05b_quant_method_case_nvfp4": ("NVFP4", _qm_case, "quant_method is 'Compressed-Tensors'"),
    "c48_quant_method_list": ("FP8", _qm_list, "quant_method is ['compressed-tensors']"),
}


@pytest.mark.parametrize("case", sorted(QUANT_METHOD_CASES))
def test_c03_c48_unrecognised_quant_method_is_named(tmp_path: Path, case: str) -> None:
    """c03 / c04 / c05 / c05b / c48: the file fell to the ModelOpt rules and the error was a symptom
    ("expected a float32 scale", "weight_scale_2 is missing"); it now names config.json and quant_method."""
    preset, edit, quoted = QUANT_METHOD_CASES[case]
    path = _ct(tmp_path, case, preset)
    cfg = ctw.read_config(path)
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    for quant in ("auto", "none"):
        with pytest.raises(QuantizationError) as err:
            LMHead.from_checkpoint(path, quant=quant)
        for part in (str(path / "config.json"), quoted, "compressed-tensors tensors"):
            assert part in str(err.value), (part, str(err.value))


# ==== M4 and the --out Lows of quantize =======================================================================
def _dense_ckpt(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(0)).bfloat16()
    save_file({"lm_head.weight": weight}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": H}))
    return folder


def _quantize_cli(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    return cli("quantize", str(src), "--algo", "fp8", "--format", "compressed-tensors", "--out", str(out), *extra)


def test_q26_full_disk_during_quantize_is_one_error_line_and_keeps_the_old_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """q26: a full disk (EFBIG under RLIMIT_FSIZE) during ``quantize --force`` printed a SafetensorError
    traceback; now one WriteError line naming ``--out``, the old output byte for byte, no private folder."""
    import safetensors.torch

    src = _dense_ckpt(tmp_path / "dense")
    out = tmp_path / "q"
    code, output = _quantize_cli(src, out)
    assert code == 0, output
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def too_large(*args: Any, **kwargs: Any) -> None:
        raise safetensors.SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", too_large)
    code, output = _quantize_cli(src, out, "--force")
    assert_cli_error(code, output, "WriteError", f"quantize --out {out}", "EFBIG", "is as it was")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "q"]


@pytest.mark.parametrize("case", ["q07_out_in_proc", "q08_out_under_a_file", "q22_name_too_long"])
def test_q07_q08_q22_out_problems_are_refused_before_the_work_naming_out(tmp_path: Path, case: str) -> None:
    """q07 / q08 / q22 (Low): ``--out`` under /proc, under a file, or with a 300-character name failed after
    the quantization work with a raw OSError naming the private build folder; now an ArtifactError naming
    ``--out`` before any work."""
    src = _dense_ckpt(tmp_path / "dense")
    (tmp_path / "afile").write_text("x")
    out = {"q07_out_in_proc": Path("/proc/trtvocab_q37"), "q08_out_under_a_file": tmp_path / "afile" / "sub",
           "q22_name_too_long": tmp_path / ("n" * 300)}[case]
    code, output = _quantize_cli(src, out)
    assert_cli_error(code, output, "ArtifactError", "--out")
    assert ".building-" not in output


# ==== the compressed-tensors Lows, messages and modes ==========================================================
@pytest.mark.parametrize(("case", "edit", "needles"), [
    ("t40_nv_packed_1d", _set("lm_head.weight_packed", lambda t: t.reshape(-1)), ["must be 2-D", "[V, H/2]"]),
    ("t43_ct_plus_weight_scale_2", lambda t: {**t, "lm_head.weight_scale_2": torch.tensor(123.0)},
     ["lm_head.weight_scale_2 (ModelOpt's global scale)", "one module has one quantization format"]),
    ("t46_zero_point", lambda t: {**t, "lm_head.weight_zero_point": torch.zeros(V, 1, dtype=torch.int8)},
     ["lm_head.weight_zero_point is stored"]),
])
def test_t40_t43_t46_refusals_name_the_real_cause(tmp_path: Path, case: str, edit: Callable[[dict], dict],
                                                  needles: list[str]) -> None:
    """t40 / t43 / t46 (Low): a 1-D packed weight was reported as "block scales [1024, 0]", a stray ModelOpt
    ``weight_scale_2`` loaded without a word, a ``weight_zero_point`` was reported as "symmetric"."""
    path = _ct(tmp_path, case, "FP8_W8A16_CHANNEL" if case.startswith("t46") else "NVFP4A16")
    ctw.rewrite_tensors(path, edit)
    with pytest.raises(QuantizationError) as err:
        LMHead.from_checkpoint(path)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_v05_v08_user_names_never_become_emoji(capsys: pytest.CaptureFixture[str]) -> None:
    """v05 / v08 (Low): rich turned ``:X:`` / ``:b:`` inside a user-supplied name into an emoji."""
    from trtvocab.commands.cli import _fail

    _fail(ConfigError("--variant 'a:b:c=ck/ct_fp8' and compressed-tensors:X: logits"))
    err = capsys.readouterr().err
    assert "'a:b:c=ck/ct_fp8'" in err and "compressed-tensors:X:" in err, err


def test_t30_m01_m02_cli_dequantize_build_refuses_bad_scales_warns_in_one_line_and_writes_readable_files(
        tmp_path: Path) -> None:
    """t30_cli_build_mode_none (H2 through the CLI): ``[quantization] mode = "none"`` over negative block scales
    built and published; now one error line. m02 (Low): the dequantize warning printed in raw Python form
    (file, line number, source line); now one ``warning:`` line. m01 (Low): ``weights.safetensors`` was written
    0600 while the manifest was 0644; now every file of the artifact has the same mode."""
    good = _ct(tmp_path, "ok", "NVFP4A16")
    bad = _ct(tmp_path, "bad", "NVFP4A16")
    ctw.rewrite_tensors(bad, _set("lm_head.weight_scale", _neg_e4m3))

    def recipe(ckpt: Path, out: Path) -> Path:
        path = tmp_path / f"{out.name}.toml"
        path.write_text(f'[checkpoint]\npath = "{ckpt}"\n[quantization]\nmode = "none"\n'
                        f'[output]\ndir = "{out}"\nonnx = false\n')
        return path

    code, output = cli("build", str(recipe(good, tmp_path / "art")))  # first: a warning is shown once
    assert code == 0, output
    assert "UserWarning" not in output and ".py:" not in output, output
    assert sum("warning:" in line and "dequantizing" in line for line in output.splitlines()) == 1, output
    code, output = cli("build", str(recipe(bad, tmp_path / "art_bad")))
    assert_cli_error(code, output, "QuantizationError", "lm_head.weight_scale: block scales must be finite and > 0")
    assert not (tmp_path / "art_bad").exists()
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "art").rglob("*")
             if p.is_file()}
    assert len(set(modes.values())) == 1, modes
