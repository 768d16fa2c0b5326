"""GGUF heads kept in their stored blocks (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K): values, the chain, shard-only
reads, ties.

References: ``gguf.quants.dequantize`` (the gguf package's own numpy decode) for the weights, a float64
recomputation for the logits, and the torch chain for the fused kernel's bits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.checkpoints.test_gguf import write_gguf
from trtvocab import LMHead, Mapping, kernels
from trtvocab.base.formats import WeightFormat
from trtvocab.checkpoints.gguf import GGUFCheckpoint, GGUFRows
from trtvocab.embedding import load_tied, resident_bytes
from trtvocab.errors import ConfigError
from trtvocab.parallel.sharding import vocab_shard
from trtvocab.quant import gguf_blocks as gb

Q = gguf.GGMLQuantizationType
V = 37  # prime: uneven shards
# every row of the table: 3 blocks of 32 values, or 2 of 256
HIDDEN = {t.name: 3 * t.values if t.values == 32 else 2 * t.values for t in gb.BLOCK_TYPES.values()}
STORED = list(HIDDEN)


def random_blocks(block_type: str, rows: int, hidden: int, seed: int = 0) -> np.ndarray:
    """Random stored rows of ``block_type`` with finite fp16 scales of mixed sign and size."""
    rng = np.random.default_rng(seed)
    block, size = gb.BLOCKS[block_type]
    raw = rng.integers(0, 256, size=(rows, hidden // block, size), dtype=np.uint8)
    for _, at in gb.BLOCK_TYPES[block_type].scales:
        d = (rng.standard_normal((rows, hidden // block)) * 10.0 ** rng.integers(-4, 1, (rows, hidden // block)))
        raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, hidden // block, 2)
    return raw.reshape(rows, -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("block_type", STORED)
def test_decode_is_gguf_quants_dequantize_bitwise(block_type: str) -> None:
    raw = random_blocks(block_type, 19, HIDDEN[block_type])
    want = gguf.quants.dequantize(raw, Q[block_type]).astype(np.float32)
    got = gb.DEQUANTIZE[block_type](torch.from_numpy(raw))
    assert torch.equal(_bits(got), _bits(torch.from_numpy(want)))


def test_chain_is_within_the_float32_bound_of_float64() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 256, generator=g), torch.randn(50, 256, generator=g)
    exact = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * (256 // 8 + 3) * 2.0**-24
    assert bool(((gb.chain_logits(x, w).double() - exact).abs() <= bound).all())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untied heads (output.weight in every stored type, gguf's quantizer where it has one, and Q5_1, which
    has no stored-format kernel) and a tied Q8_0 table."""
    rng = np.random.default_rng(3)
    out = {}
    folder = tmp_path_factory.mktemp("gguf_blocks")
    for name in [*STORED, "Q5_1"]:
        qtype = Q[name]
        h = HIDDEN.get(name, 64)
        tensors = {"output.weight": (rng.standard_normal((V, h)).astype(np.float32), qtype),
                   "token_embd.weight": (rng.standard_normal((V, h)).astype(np.float32), Q.F16)}
        out[name] = write_gguf(folder / f"{name}.gguf", tensors, hidden=h)
    out["tied"] = write_gguf(folder / "tied.gguf", {"token_embd.weight": (
        rng.standard_normal((V, 64)).astype(np.float32), Q.Q8_0)}, hidden=64)
    return out


def _reference(path: Path, name: str = "output.weight") -> torch.Tensor:
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))


def _paths() -> list[str]:
    paths = ["torch"]
    if kernels.available():
        paths.append("kernel")
    return paths


@pytest.mark.parametrize("block_type", STORED)
def test_head_stays_in_its_blocks_and_computes_the_chain(files: dict[str, Path], block_type: str) -> None:
    path = files[block_type]
    ref = _reference(path)
    hidden = ref.shape[1]
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(1))
    want = gb.chain_logits(x, ref)
    exact = x.double() @ ref.double().t()
    assert float((want.double() - exact).abs().max()) <= float((x.double().abs() @ ref.double().abs().t()).max()) \
        * (hidden // 8 + 3) * 2.0**-24
    row_bytes = gb.GGUFConfig(block_type=block_type).row_bytes(hidden)
    for how in _paths():
        for tp in (1, 3):
            pieces = []
            for rank in range(tp):
                head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=tp, rank=rank, tp_size=tp),
                                              dtype=torch.float32)
                assert head.weight_format is WeightFormat(f"GGUF_{block_type}") and "stored" in head.load_note
                s = vocab_shard(V, tp, rank)
                assert head.weights.resident_bytes() == s.size * row_bytes  # the stored bytes, nothing more
                assert torch.equal(_bits(head.weights.dense_weight()[: s.size]), _bits(ref[s.start : s.end]))
                with kernels.library.disabled() if how == "torch" else _nothing():
                    got = head.column_logits(x)
                    assert got.dtype == torch.float32
                    # batch invariance: each row alone; partition invariance: two column ranges
                    for n in (0, 5):
                        assert torch.equal(_bits(head.column_logits(x[n : n + 1])), _bits(got[n : n + 1]))
                    mid = s.size // 2
                    parts = torch.cat([head.column_logits(x, 0, mid), head.column_logits(x, mid)], 1)
                    assert torch.equal(_bits(parts), _bits(got))
                pieces.append(got)
            assert torch.equal(_bits(torch.cat(pieces, 1)), _bits(want)), (how, tp)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_reads_only_the_shards_byte_range(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[tuple[int, int]] = []
    real = GGUFRows._pread

    def spy(self: GGUFRows, offset: int, buf: np.ndarray) -> None:
        reads.append((offset, buf.nbytes))
        real(self, offset, buf)

    monkeypatch.setattr(GGUFRows, "_pread", spy)
    info = GGUFCheckpoint(files["Q8_0"]).info("output.weight")
    LMHead.from_checkpoint(files["Q8_0"], mapping=Mapping(world_size=3, rank=1, tp_size=3), dtype=torch.float32)
    s = vocab_shard(V, 3, 1)
    assert reads == [(info.offset + s.start * info.row_bytes, s.size * info.row_bytes)]


def test_float32_path_and_other_block_types_are_dequantized(files: dict[str, Path]) -> None:
    head = LMHead.from_checkpoint(files["Q8_0"], dtype=torch.float32, gguf_blocks=False)
    assert head.weight_format is WeightFormat.DENSE and "gguf_blocks=False" in head.load_note
    assert torch.equal(head.weight, _reference(files["Q8_0"]))
    head = LMHead.from_checkpoint(files["Q5_1"], dtype=torch.float32)
    assert head.weight_format is WeightFormat.DENSE and "no stored-format kernel for Q5_1" in head.load_note
    assert torch.equal(head.weight, _reference(files["Q5_1"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_table_is_one_copy_of_stored_blocks(files: dict[str, Path], dtype: torch.dtype) -> None:
    ref = _reference(files["tied"], "token_embd.weight")
    embedding, head = load_tied(files["tied"], dtype=dtype)
    assert head.weight_format is WeightFormat.GGUF_Q8_0 and embedding.weights is head.weights
    assert resident_bytes(embedding, head) == V * gb.GGUFConfig(block_type="Q8_0").row_bytes(64)
    ids = torch.tensor([[0, 36, -1, 37, 5], [12, 12, 3, 99, 1]])
    rows = embedding(ids)
    want = ref[ids.clamp(0, V - 1)].to(dtype) * ((ids >= 0) & (ids < V))[..., None].to(dtype)
    assert rows.dtype == dtype and torch.equal(rows, want)
    dense_emb, dense_head = load_tied(files["tied"], dtype=dtype, gguf_blocks=False)
    assert dense_head.weight_format is WeightFormat.DENSE and torch.equal(dense_emb(ids), rows)


@pytest.mark.model
def test_smollm2_greedy_tokens_and_logits_match_the_float32_head(smollm2: Path) -> None:
    """SmolLM2's tied Q8_0 head in its blocks: the same greedy tokens as the float32-dequantized head on
    the README's prompts, and logits within the chain's float32 bound of a float64 recomputation."""
    pytest.importorskip("transformers")
    G = pytest.importorskip("trtvocab.pipeline.generate")
    prompts = ["The capital of France is", "def add(a, b):"]
    tokens = {}
    for blocks in (True, False):
        spec, loaded = G.prepare(smollm2, prompts, max_new_tokens=8, gguf_blocks=blocks)
        tokens[blocks] = [r.token_ids for r in G.generate(spec, loaded).results]
    assert tokens[True] == tokens[False]
    head = LMHead.from_checkpoint(smollm2, dtype=torch.float32)
    assert head.weight_format is WeightFormat.GGUF_Q8_0
    x = torch.randn(4, head.hidden_size, generator=torch.Generator().manual_seed(2))
    w = head.weights.dense_weight().double()
    got = head.column_logits(x).double()
    bound = (x.double().abs() @ w.abs().t()) * (head.hidden_size // 8 + 3) * 2.0**-24
    assert bool(((got - x.double() @ w.t()).abs() <= bound).all())


# ---- the GGUF kernel: every build (ISA) this CPU runs (each runs its top tier), against the torch chain ------
@pytest.mark.parametrize("isa", list(kernels.library.ISAS))
def test_kernel_paths_equal_the_torch_chain_bitwise(isa: str) -> None:
    from trtvocab.kernels import gemm

    if kernels.library.disabled_reason() is not None:
        pytest.skip(kernels.library.disabled_reason())
    missing = kernels.compile.ISA_CPU_FLAGS[isa] - kernels.compile.cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    try:
        loaded = kernels.library.load_isa(isa)
    except Exception as exc:  # no compiler here
        pytest.skip(f"{isa} build unavailable: {exc}")
    g = torch.Generator().manual_seed(5)
    # 608 = 19 chunks: the 32-value blocks' groups of 8, 8 and 3 chunks the kernel unpacks at once (Chunks8)
    for block_type, hidden in (("Q8_0", 640), ("Q4_0", 608), ("Q4_1", 608), ("Q5_0", 608), *HIDDEN.items()):
        raw = torch.from_numpy(random_blocks(block_type, 41, hidden, seed=hidden))
        w = gb.DEQUANTIZE[block_type](raw)
        x = torch.randn(65, hidden, generator=g)
        x[0, :5] = torch.tensor([0.0, -0.0, 1e-40, 3e38, -1e-30])  # zeros, a subnormal, huge and tiny values
        want = gb.chain_logits(x, w)
        for n in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 65):
            got = gemm.gguf_logits(loaded, x[:n].contiguous(), hidden, block_type, raw)
            assert torch.equal(_bits(got), _bits(want[:n])), (isa, block_type, hidden, n)
        parts = torch.cat([gemm.gguf_logits(loaded, x[:3].contiguous(), hidden, block_type, raw[a:b])
                           for a, b in ((0, 1), (1, 12), (12, 41))], 1)
        assert torch.equal(_bits(parts), _bits(want[:3])), (isa, block_type, "row split")


# ---- ONNX: blocked DequantizeLinear (opset 21, block 32 along H) on onnxruntime ---------------------------
@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_onnx_graph_equals_the_fallback_on_onnxruntime(files: dict[str, Path], tmp_path: Path,
                                                           block_type: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from trtvocab.base.family import HeadOps
    from trtvocab.export.gguf_onnx import export_gguf, export_q8_0

    hidden = HIDDEN[block_type]
    ref = _reference(files[block_type])
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(4))
    for tp, rank in ((1, 0), (3, 2)):
        head = LMHead.from_checkpoint(files[block_type], mapping=Mapping(world_size=tp, rank=rank, tp_size=tp),
                                      dtype=torch.float32)
        s = vocab_shard(V, tp, rank)
        # the graph's weight is gguf.quants.dequantize's, value for value: one-hot rows read it out through the
        # Gemm (exactly: every other product is a zero; a zero weight's sign is not kept by the sum)
        plain = export_gguf(head, tmp_path / f"{block_type}_{tp}_{rank}_plain.onnx")
        eye = torch.eye(hidden).numpy()
        weight_t = torch.from_numpy(ort.InferenceSession(str(plain)).run(None, {"hidden_states": eye})[0])
        assert torch.equal(weight_t.t(), ref[s.start : s.end]), (tp, rank)
        head.head_ops = HeadOps(softcap=30.0) if rank else head.head_ops  # a family's ops ride after the GEMM
        export = export_q8_0 if block_type == "Q8_0" else export_gguf
        path = export(head, tmp_path / f"{block_type}_{tp}_{rank}.onnx")
        model = onnx.load(str(path))
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert model.opset_import[0].version == 21 and len(dq) == 1
        assert {a.name: a.i for a in dq[0].attribute} == {"axis": 1, "block_size": 32}
        types = {i.name: i.data_type for i in model.graph.initializer}
        want_q = onnx.TensorProto.INT8 if block_type == "Q8_0" else onnx.TensorProto.INT4
        assert types["weight_q"] == want_q and types["weight_d"] == onnx.TensorProto.FLOAT
        got = torch.from_numpy(ort.InferenceSession(str(path)).run(None, {"hidden_states": x.numpy()})[0])
        want = head.column_logits(x)
        w = head.weights.dense_weight()[: head.shard.size].double()
        bound = (x.double().abs() @ w.abs().t()) * 2 * (hidden + 3) * 2.0**-24
        assert bool(((got.double() - want.double()).abs() <= bound + 1e-4).all()), (tp, rank)
    if block_type != "Q8_0":
        with pytest.raises(ConfigError, match="a GGUF Q8_0 head"):
            export_q8_0(head, tmp_path / "refused.onnx")


def test_embedding_from_checkpoint_keeps_gguf_blocks(files: dict[str, Path]) -> None:
    from trtvocab.embedding import VocabParallelEmbedding

    ref = _reference(files["tied"], "token_embd.weight")
    ids = torch.tensor([3, -1, 36, 0, 40])
    for tp in (1, 3):
        parts = []
        for rank in range(tp):
            emb = VocabParallelEmbedding.from_checkpoint(files["tied"], dtype=torch.float32, reduce_output=False,
                                                         mapping=Mapping(world_size=tp, rank=rank, tp_size=tp))
            assert emb.weight_format is WeightFormat.GGUF_Q8_0
            assert emb.resident_bytes() == vocab_shard(V, tp, rank).size * 68
            parts.append(emb(ids) if tp == 1 else emb.dequantize_rows(*emb.local_rows(ids)))
        rows = sum(parts[1:], parts[0])
        want = ref[ids.clamp(0, V - 1)] * ((ids >= 0) & (ids < V))[:, None]
        assert torch.equal(rows, want), tp
    dense = VocabParallelEmbedding.from_checkpoint(files["tied"], dtype=torch.float32, gguf_blocks=False)
    assert dense.weight_format is WeightFormat.DENSE and torch.equal(dense(ids), rows)


@pytest.mark.model
def test_cli_generate_no_gguf_blocks_gives_the_same_tokens(smollm2: Path) -> None:
    import json

    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from trtvocab.commands.cli import app

    args = ["generate", str(smollm2), "--prompt", "The capital of France is", "--max-new-tokens", "4", "--json"]
    runs = [CliRunner().invoke(app, [*args, *flag]) for flag in ([], ["--no-gguf-blocks"])]
    assert all(r.exit_code == 0 for r in runs), [r.output[-500:] for r in runs]
    ids = [json.loads(r.stdout)["results"][0]["token_ids"] for r in runs]
    assert ids[0] == ids[1] and len(ids[0]) == 4
