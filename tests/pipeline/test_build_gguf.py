"""`trtvocab build` with ``[lm_head] gguf_blocks = true``: a GGUF head's artifact in its stored blocks.

References, none of them the code under test: the ``gguf`` package's reader (the stored bytes and
``gguf.quants.dequantize``'s weights), a float64 recomputation of the logits, and the head loaded straight from
the checkpoint (``LMHead.from_checkpoint``, stored blocks), whose bits the artifact's torch backend must give.
Tiers (docs/testing.md): the tiny-GGUF tests are fast (no engine: the standard TensorRT compiler is not
importable here, so its stage is skipped with a reason); the TensorRT-RTX builds are ``slow``
(ahead-of-time builds on the CPU); the SmolLM2 test is ``model``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.checkpoints.test_gguf import write_gguf
from trtvocab import LMHead, Mapping
from trtvocab.artifact import store as artifacts
from trtvocab.artifact.recipe import BuildRecipe
from trtvocab.backends.onnx import OnnxBackend
from trtvocab.backends.torch import TorchBackend
from trtvocab.base.formats import WeightFormat
from trtvocab.commands.cli import app
from trtvocab.errors import QuantizationError
from trtvocab.parallel.sharding import vocab_shard
from trtvocab.pipeline.build import build
from trtvocab.quant.gguf_blocks import GGUFConfig

Q = gguf.GGMLQuantizationType
V = 37  # prime: uneven shards
HIDDEN = {"Q8_0": 96, "Q4_0": 96, "Q4_1": 96, "Q6_K": 256, "Q5_0": 96, "Q4_K": 256}
ONE = torch.ones(6, dtype=torch.int32)  # seq_lens: each row its own sequence (the last-token graph)
HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied head (``token_embd.weight`` only) in each block type."""
    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("gguf_build")
    return {name: write_gguf(folder / f"{name}.gguf", {"token_embd.weight": (
        rng.standard_normal((V, h)).astype(np.float32), Q[name])}, hidden=h) for name, h in HIDDEN.items()}


def recipe(path: Path, out: Path, tp: int, *, blocks: bool = True, compiler: str = "tensorrt",
           onnx: bool = True, embedding: bool = False, dtype: str = "float32") -> BuildRecipe:
    engine = {"compiler": compiler, **({"targets": ["sm89"]} if compiler == "tensorrt-rtx" else {})}
    return BuildRecipe.model_validate({
        "name": "gguf", "checkpoint": {"path": str(path)}, "mapping": {"tp_size": tp},
        "lm_head": {"dtype": dtype, "gather_output": False, "gguf_blocks": blocks}, "engine": engine,
        "profile": {"min_tokens": 1, "opt_tokens": 4, "max_tokens": 16, "min_batch": 1, "opt_batch": 2,
                    "max_batch": 4},
        "embedding": {"export": embedding}, "output": {"dir": str(out), "onnx": onnx}})


def stored(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """The table's stored rows (uint8), ``gguf.quants.dequantize``'s weights and the block type's enum."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    raw = np.array(t.data).reshape(V, -1)
    return raw, np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32), t.tensor_type


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_artifact_keeps_the_blocks_and_its_graph_dequantizes_them(files: dict[str, Path], tmp_path: Path,
                                                                  block_type: str, tp: int) -> None:
    import onnx
    import onnxruntime as ort

    path = files[block_type]
    root, manifest = build(recipe(path, tmp_path / "art", tp, embedding=True))
    raw, weight, _ = stored(path)
    fmt = WeightFormat(f"GGUF_{block_type}")
    assert manifest.quant.weight_format is fmt and manifest.quant.stored == f"GGUF {block_type}"
    assert manifest.quant.config == GGUFConfig(block_type=block_type) and not manifest.quant.dequantized
    assert manifest.head.gguf_blocks and manifest.recipe.lm_head.gguf_blocks
    again = artifacts.read_manifest(root)  # the written manifest reads back (GGUFConfig in the union)
    assert again.quant.config == GGUFConfig(block_type=block_type)
    x = torch.randn(6, HIDDEN[block_type], generator=torch.Generator().manual_seed(tp))
    exact = x.double() @ torch.from_numpy(weight).double().t()
    bound = (x.double().abs() @ torch.from_numpy(weight).double().abs().t()) * 2 * (HIDDEN[block_type] + 3) * 2.0**-24
    for e in manifest.ranks:
        s = vocab_shard(V, tp, e.rank)
        assert e.weight_format is fmt and e.verify is not None and e.verify.ok and e.verify.tolerance > 0
        assert not e.engine.built and e.engine.reason  # no engine here, said
        assert e.embedding_verify is not None and e.embedding_verify.ok  # the lookup graph: a dense table, exact
        # weights.safetensors: the stored bytes of this rank's rows, nothing else
        saved = load_file(str(root / e.files.weights))["weight"]
        assert saved.dtype == torch.uint8 and torch.equal(saved, torch.from_numpy(raw[s.start : s.end].copy()))
        # the torch backend: the bits of the head loaded from the checkpoint in its blocks
        head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=tp, rank=e.rank, tp_size=tp),
                                      dtype=torch.float32, gather_output=False)
        assert head.weight_format is fmt
        got = TorchBackend(root, again, e.rank).rank_logits(x, ONE).logits[:, : s.size]
        assert torch.equal(got, head.column_logits(x))
        # the graph: blocked DequantizeLinear (opset >= 21, block 32 along H) of int8 / int4 codes
        model = onnx.load(str(root / e.files.onnx))
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert model.opset_import[0].version >= 21 and len(dq) == 1
        # the codes laid out [H, V_local]: blocks of 32 along axis 0 (the GEMM's K)
        assert {a.name: a.i for a in dq[0].attribute} == {"axis": 0, "block_size": 32}
        inits = {i.name: i for i in model.graph.initializer}
        want = onnx.TensorProto.INT8 if block_type == "Q8_0" else onnx.TensorProto.INT4
        codes = inits[dq[0].input[0]]
        assert codes.data_type == want and list(codes.dims) == [HIDDEN[block_type], s.size]
        assert list(inits[dq[0].input[1]].dims) == [HIDDEN[block_type] // 32, s.size] and len(dq[0].input) == 2
        # onnxruntime against the float64 recomputation on gguf's own weights
        # (optimizations off: onnxruntime rewrites int4 DequantizeLinear -> MatMul into MatMulNBits, whose
        # products round in another order; the backend below runs the optimized graph, within the bound)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(root / e.files.onnx), opts)
        eye = sess.run(None, {"hidden_states": torch.eye(HIDDEN[block_type]).numpy(),
                              "seq_lens": np.ones(HIDDEN[block_type], dtype=np.int32)})[0]
        assert np.array_equal(eye.T, weight[s.start : s.end])  # the graph's weight is gguf's, value for value
        onnx_logits = OnnxBackend(root, again, e.rank).rank_logits(x, ONE).logits[:, : s.size]
        err = (onnx_logits.double() - exact[:, s.start : s.end]).abs()
        assert bool((err <= bound[:, s.start : s.end] + 1e-6).all())
    result = CliRunner().invoke(app, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    assert f"stored=GGUF {block_type}" in result.output


def test_bfloat16_head_casts_its_activations_up(files: dict[str, Path], tmp_path: Path) -> None:
    """A bf16 head in blocks: bf16 hidden states, cast to float32 in the graph as the fallback's chain does."""
    import onnx

    path = files["Q4_1"]
    root, manifest = build(recipe(path, tmp_path / "art", 2, dtype="bfloat16"))
    x = torch.randn(6, HIDDEN["Q4_1"], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    _, weight, _ = stored(path)
    exact = x.double() @ torch.from_numpy(weight).double().t()
    bound = (x.double().abs() @ torch.from_numpy(weight).double().abs().t()) * 2 * (HIDDEN["Q4_1"] + 3) * 2.0**-24
    for e in manifest.ranks:
        model = onnx.load(str(root / e.files.onnx))
        assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
        assert e.verify is not None and e.verify.ok
        s = vocab_shard(V, 2, e.rank)
        for backend in (TorchBackend, OnnxBackend):
            got = backend(root, manifest, e.rank).rank_logits(x, ONE).logits[:, : s.size]
            assert bool(((got.double() - exact[:, s.start : s.end]).abs() <= bound[:, s.start : s.end] + 1e-6).all())


def test_default_recipe_dequantizes_as_before(files: dict[str, Path], tmp_path: Path) -> None:
    """``gguf_blocks`` left out: the artifact holds gguf's float32 weights (dense), as artifacts always did."""
    path = files["Q8_0"]
    rec = recipe(path, tmp_path / "art", 3)
    data = rec.model_dump()
    del data["lm_head"]["gguf_blocks"]
    data.pop("source", None)
    root, manifest = build(BuildRecipe.model_validate(data))
    assert not manifest.head.gguf_blocks and manifest.quant.weight_format is WeightFormat.DENSE
    _, weight, _ = stored(path)
    for e in manifest.ranks:
        s = vocab_shard(V, 3, e.rank)
        assert torch.equal(load_file(str(root / e.files.weights))["weight"], torch.from_numpy(weight[s.start : s.end]))


@pytest.mark.parametrize("block_type", ["Q6_K", "Q5_0", "Q4_K"])
def test_other_block_types_have_no_graph_refused_by_name(files: dict[str, Path], tmp_path: Path,
                                                         block_type: str) -> None:
    """No blocked-DQ graph for these: refused naming the type and the way out, nothing written; without a
    graph (``[output] onnx = false``) the artifact holds the blocks and its torch backend runs them."""
    path = files[block_type]
    out = tmp_path / "art"
    with pytest.raises(QuantizationError, match=f"GGUF {block_type} .*gguf_blocks = false"):
        build(recipe(path, out, 2))
    assert not out.exists()
    root, manifest = build(recipe(path, out, 2, onnx=False))
    assert manifest.quant.stored == f"GGUF {block_type}" and all(e.files.onnx is None for e in manifest.ranks)
    x = torch.randn(6, HIDDEN[block_type], generator=torch.Generator().manual_seed(0))
    for e in manifest.ranks:
        head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=2, rank=e.rank, tp_size=2),
                                      dtype=torch.float32, gather_output=False)
        got = TorchBackend(root, manifest, e.rank).rank_logits(x, ONE).logits[:, : e.end - e.start]
        assert torch.equal(got, head.column_logits(x))


@pytest.mark.slow  # an ahead-of-time TensorRT-RTX build on the CPU
@pytest.mark.skipif(not HAVE_RTX, reason="tensorrt_rtx is not installed")
def test_rtx_layer_table_says_what_the_engine_multiplies_by(files: dict[str, Path], tmp_path: Path) -> None:
    """TensorRT-RTX on the Q8_0 graph (one target): the build records what the engine runs for the weight
    (a fused int8 weight-only GEMM, or a dequantized copy), the contract holds, the CLI says it."""
    root, manifest = build(recipe(files["Q8_0"], tmp_path / "art", 1, compiler="tensorrt-rtx"))
    b = manifest.ranks[0].engine.build
    assert b is not None and b.compute is not None and b.compute.ok, manifest.ranks[0].engine
    c = b.compute
    assert c.gemm is not None and c.weight_path is not None
    if c.gemm.weight == "int8":
        assert c.weight_path.startswith("fused weight-only GEMM")
    else:  # what TensorRT-RTX 1.x does: a float32 weight dequantized from the int8 constant
        assert c.gemm.weight == "float32" and c.weight_path.startswith("dequantized copy")
        assert c.gemm.weight_resident or c.gemm.weight_source == "int8"
    assert any(c.weight_path in note for note in c.notes)
    result = CliRunner().invoke(app, ["inspect", str(root)])
    assert result.exit_code == 0 and c.weight_path.split(":")[0] in result.output.replace("\n", " ")


@pytest.mark.model
def test_smollm2_artifact_generates_the_torch_heads_tokens(smollm2: Path, tmp_path: Path) -> None:
    """SmolLM2's tied Q8_0 head built in its blocks at tp 2: ``generate --artifact`` (torch and onnx
    backends) gives the greedy tokens of the model's own head (no artifact)."""
    pytest.importorskip("transformers")
    root, manifest = build(recipe(smollm2, tmp_path / "art", 2))
    assert manifest.quant.stored == "GGUF Q8_0" and all(e.verify is not None and e.verify.ok for e in manifest.ranks)
    runs = {}
    for name, extra in (("head", []), ("torch", ["--artifact", str(root), "--backend", "torch"]),
                        ("onnx", ["--artifact", str(root), "--backend", "onnx"])):
        result = CliRunner().invoke(app, ["generate", str(smollm2), "--prompt", "The capital of France is",
                                          "--max-new-tokens", "8", "--json", *extra])
        assert result.exit_code == 0, result.output
        runs[name] = [r["token_ids"] for r in json.loads(result.output)["results"]]
    assert runs["torch"] == runs["head"] and runs["onnx"] == runs["head"]


@pytest.mark.slow  # an ahead-of-time TensorRT-RTX build on the CPU
@pytest.mark.skipif(not HAVE_RTX, reason="tensorrt_rtx is not installed")
def test_rtx_fuses_a_q4_0_shard_of_real_shape(tmp_path: Path) -> None:
    """A Q4_0 shard of a real shape (4096 x 576): TensorRT-RTX multiplies float32 activations by the resident
    int4 codes (the table of docs/architecture.md, "GGUF heads in their stored blocks"; update it if this
    changes with the compiler's version), and the record says so."""
    rng = np.random.default_rng(2)
    rows, hidden = 4096, 576
    path = write_gguf(tmp_path / "q4_0.gguf", {"token_embd.weight": (
        rng.standard_normal((rows, hidden)).astype(np.float32), Q.Q4_0)}, hidden=hidden, tokens=rows)
    _, manifest = build(recipe(path, tmp_path / "art", 1, compiler="tensorrt-rtx"))
    e = manifest.ranks[0]
    assert e.verify is not None and e.verify.ok
    c = e.engine.build.compute if e.engine.build is not None else None
    assert c is not None and c.ok and c.gemm is not None, e.engine
    assert (c.gemm.activation, c.gemm.weight, c.gemm.weight_resident) == ("float32", "int4", True)
    assert c.weight_path == "fused weight-only GEMM: float32 x int4 on the stored codes resident in the engine"
