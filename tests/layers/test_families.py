"""Model families: what a real output layer and input embedding compute (bias, logit scale or divisor,
soft-capping; Gemma's scaled embedding), on every path that computes logits or rows.

References: transformers' own model classes (tiny random checkpoints, ``tools/model_zoo.prepare``:
the head's input captured by a hook, ``model(ids).logits``, ``get_input_embeddings()(ids)``) and
float64 recomputations of their formulas; never trtvocab's own output.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy import stats

from trtvocab import ArchitectureError, CheckpointError, LMHead, Mapping, VocabParallelEmbedding
from trtvocab.base.family import EmbeddingOps, HeadOps
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.checkpoints.families import family_of
from trtvocab.logits import shard_logits
from trtvocab.sampling import SamplingParams, decode, sample

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
V, H = 101, 32


def softcapped(z: torch.Tensor, ops: HeadOps, bias: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' formula in float64: softcap(((z + b) * scale) / divisor)."""
    z = z.double()
    if bias is not None:
        z = z + bias.double()
    z = z * ops.scale / ops.divisor
    if ops.softcap is not None:
        z = ops.softcap * torch.tanh(z / ops.softcap)
    return z


def _head(ops: HeadOps, dtype: torch.dtype = torch.float32, mapping: Mapping | None = None,
          **kwargs) -> tuple[LMHead, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(V, H, generator=gen) * 2
    b = torch.randn(V, generator=gen) * 5
    head = LMHead(V, H, dtype=dtype, mapping=mapping, head_ops=ops, gather_output=False, **kwargs)
    head.load_weights({"weight": w.to(dtype), **({"lm_head.bias": b} if ops.bias else {})})
    return head, w, b


OPS = [HeadOps(softcap=10.0), HeadOps(bias=True), HeadOps(scale=0.0625), HeadOps(divisor=4.0),
       HeadOps(bias=True, scale=0.5, divisor=3.0, softcap=7.5)]


# ---- the ops, against a float64 recomputation -----------------------------------------------------
@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.describe())
def test_head_ops_equal_the_float64_formula(ops: HeadOps) -> None:
    head, w, b = _head(ops)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    want = softcapped(x.double() @ w.double().T, ops, b if ops.bias else None)
    got = head(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.describe())
def test_column_ranges_have_the_bits_of_the_whole_shard(ops: HeadOps) -> None:
    """The chunked decode streams column ranges: elementwise ops keep every range's bits."""
    for kwargs in ({}, {"deterministic": True}):
        head, _, _ = _head(ops, **kwargs)
        x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
        whole = head.column_logits(x)
        parts = torch.cat([head.column_logits(x, a, b) for a, b in ((0, 37), (37, 64), (64, V))], 1)
        assert torch.equal(whole, parts)


def test_half_head_applies_the_ops_in_its_dtype_and_float32_output() -> None:
    ops = HeadOps(bias=True, softcap=10.0)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    for output_dtype in (None, torch.float32):
        head, w, b = _head(ops, dtype=torch.bfloat16, output_dtype=output_dtype)
        got = head(x.to(torch.bfloat16))
        want = softcapped(x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T, ops, b)
        assert got.dtype == (output_dtype or torch.bfloat16)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0.1)  # bf16: ~3 significant digits of 10


def test_chunked_decode_equals_the_materialized_step() -> None:
    """sampling.decode streams the vocab in chunks above the logits budget: the same tokens and, for
    a greedy row and a seeded one, the materialized head's choice."""
    ops = HeadOps(bias=True, scale=0.5, softcap=7.5)
    head, _, _ = _head(ops)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_p=0.8, seed=4), SamplingParams(temperature=1.0, min_p=0.1, seed=5)]
    want = sample(head.local_logits(x), head, params, step=2)
    head.logits_budget_bytes = 4 * 4 * 16  # 16 columns a chunk
    got = decode(x, head, params, step=2)
    assert torch.equal(got, want)


def test_padded_layout_keeps_padding_minus_inf_never_bias() -> None:
    ops = HeadOps(bias=True, softcap=10.0)
    mapping = Mapping(world_size=4, rank=3, tp_size=4)
    head, w, b = _head(ops, mapping=mapping, vocab_layout="padded", pad_to=8)
    assert head.shard.padding > 0
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(7))
    local = head.local_logits(x)
    assert torch.isinf(local[:, head.shard.size:]).all() and (local[:, head.shard.size:] < 0).all()
    s = slice(head.vocab_start, head.vocab_end)
    want = softcapped(x.double() @ w[s].double().T, ops, b[s])
    torch.testing.assert_close(local[:, : head.shard.size].double(), want, rtol=0, atol=1e-4)


def test_seeded_draws_follow_the_softcapped_softmax_tp1() -> None:
    """20000 seeded draws from a soft-capped head (raw logits up to 40, cap 5): chi-square against the
    true soft-capped softmax in float64; the raw softmax would put all the mass on one id."""
    from tests.layers.family_rank_fns import softcap_draws

    z, cap, n = _draw_logits(), 5.0, 20000
    counts = torch.bincount(torch.tensor(softcap_draws(0, 1, z, cap, n, 1.0)), minlength=16).double()
    _chi_square(counts, z, cap, n)


def _draw_logits() -> torch.Tensor:
    return torch.linspace(-40.0, 40.0, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(4))]


def _chi_square(counts: torch.Tensor, z: torch.Tensor, cap: float, n: int) -> None:
    expected = torch.softmax(cap * torch.tanh(z.double() / cap), 0) * n
    result = stats.chisquare(counts.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (result, counts.tolist(), expected.tolist())
    raw = torch.softmax(z.double(), 0) * n
    assert stats.chisquare(counts.numpy(), (raw + 1e-9).numpy()).pvalue < 1e-12  # the uncapped head is refuted


@pytest.mark.ranks
def test_seeded_draws_follow_the_softcapped_softmax_tp3(launch_ranks) -> None:
    from tests.layers.family_rank_fns import softcap_draws

    z, cap, n = _draw_logits(), 5.0, 20000
    by_rank = launch_ranks(softcap_draws, 3, z, cap, n, 1.0)
    assert by_rank[0] == by_rank[1] == by_rank[2]
    assert by_rank[0] == softcap_draws(0, 1, z, cap, n, 1.0)  # the same tokens at every tp (keyed noise)
    _chi_square(torch.bincount(torch.tensor(by_rank[0]), minlength=16).double(), z, cap, n)


# ---- loading: bias, refusals -------------------------------------------------------------------------
def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": H, **config}))
    return folder


def test_bias_is_read_shard_only_and_validated(tmp_path: Path) -> None:
    w, b = torch.randn(V, H), torch.randn(V)
    path = _write(tmp_path / "ok", {"lm_head.weight": w, "lm_head.bias": b}, {"model_type": "phi"})
    head = LMHead.from_checkpoint(path, dtype=torch.float32, mapping=Mapping(world_size=3, rank=1, tp_size=3),
                                  gather_output=False)
    assert head.head_ops.bias and torch.equal(head.bias, b[head.vocab_start : head.vocab_end])
    bad = _write(tmp_path / "short", {"lm_head.weight": w, "lm_head.bias": b[:-1]}, {"model_type": "phi"})
    with pytest.raises(CheckpointError, match=r"lm_head.bias.*\[101\]"):
        LMHead.from_checkpoint(bad, dtype=torch.float32)
    nan = _write(tmp_path / "nan", {"lm_head.weight": w, "lm_head.bias": b.clone().fill_(float("nan"))},
                 {"model_type": "phi"})
    with pytest.raises(CheckpointError, match="NaN"):
        LMHead.from_checkpoint(nan, dtype=torch.float32)
    plain = LMHead(V, H, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="has no bias"):  # never dropped silently
        plain.load_weights({"weight": w, "lm_head.bias": b})
    with pytest.raises(CheckpointError, match="no 'bias'"):
        LMHead(V, H, dtype=torch.float32, head_ops=HeadOps(bias=True)).load_weights({"weight": w})
    for dtype in (torch.int32, torch.bool, torch.float8_e4m3fn):  # through the API: never converted silently
        with pytest.raises(CheckpointError, match=r"bias must be float16.*got torch\."):
            LMHead(V, H, dtype=torch.float32, head_ops=HeadOps(bias=True)).load_weights(
                {"weight": w, "bias": torch.zeros(V).to(dtype)})


@pytest.mark.parametrize(("config", "field"), [
    ({"model_type": "my_new_arch", "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"model_type": "my_new_arch", "logits_scaling": 8.0}, "logits_scaling"),
    ({"model_type": "my_new_arch", "text_config": {"scale_emb": 12}}, "scale_emb"),
    ({"model_type": "dory"}, "logit scale"),
    ({"model_type": "gemma2", "final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"model_type": "cohere", "logit_scale": 1e30}, "logit_scale"),
    ({"model_type": "granite", "logits_scaling": "8"}, "logits_scaling"),
])
def test_unmodeled_families_are_refused_by_name(tmp_path: Path, config: dict, field: str) -> None:
    path = _write(tmp_path / "m", {"lm_head.weight": torch.randn(V, H), "model.embed_tokens.weight": torch.randn(V, H)},
                  {**config, "tie_word_embeddings": False})
    with pytest.raises(ArchitectureError, match=field) as info:
        LMHead.from_checkpoint(path, dtype=torch.float32)
    assert config["model_type"] in str(info.value)


def test_neutral_fields_of_unknown_types_and_body_fields_load(tmp_path: Path) -> None:
    path = _write(tmp_path / "m", {"lm_head.weight": torch.randn(V, H), "model.embed_tokens.weight": torch.randn(V, H)},
                  {"model_type": "my_new_arch", "logits_scaling": 1.0, "final_logit_softcapping": None,
                   "tie_word_embeddings": False})
    assert LMHead.from_checkpoint(path, dtype=torch.float32).head_ops.is_identity
    granite = _write(tmp_path / "g", {"lm_head.weight": torch.randn(V, H), "model.embed_tokens.weight":
                                      torch.randn(V, H)},
                     {"model_type": "granite", "logits_scaling": 8.0, "embedding_multiplier": 12.0,
                      "tie_word_embeddings": False})
    head = LMHead.from_checkpoint(granite, dtype=torch.float32)
    assert head.head_ops == HeadOps(divisor=8.0)
    assert "embedding_multiplier (on inputs_embeds)" in head.family.body[0]  # the body's, documented
    assert VocabParallelEmbedding.from_checkpoint(granite, dtype=torch.float32).embedding_ops.is_identity


def _gguf(path: Path, arch: str, meta: dict[str, float], bias: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(H)
    writer.add_token_list([f"t{i}" for i in range(V)])
    for key, value in meta.items():
        writer.add_float32(f"{arch}.{key}", value)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((V, H)).astype(np.float32))
    if bias:
        writer.add_tensor("output.weight", rng.standard_normal((V, H)).astype(np.float32))
        writer.add_tensor("output.bias", rng.standard_normal(V).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata_gives_the_same_ops(tmp_path: Path) -> None:
    """llama.cpp's keys: <arch>.final_logit_softcapping, <arch>.logit_scale (Command-R multiplies,
    Granite divides), Gemma's sqrt(n_embd) embedding scale, output.bias."""
    gemma2 = family_of(open_checkpoint(_gguf(tmp_path / "g2.gguf", "gemma2", {"final_logit_softcapping": 30.0})),
                       hidden_size=H)
    assert gemma2.head == HeadOps(softcap=30.0) and gemma2.embedding == EmbeddingOps(scale=math.sqrt(H))
    cmd = open_checkpoint(_gguf(tmp_path / "c.gguf", "command-r", {"logit_scale": 0.0625}))
    assert family_of(cmd).head == HeadOps(scale=0.0625)
    granite = open_checkpoint(_gguf(tmp_path / "gr.gguf", "granite", {"logit_scale": 8.0}))
    assert family_of(granite).head == HeadOps(divisor=8.0)
    phi = _gguf(tmp_path / "phi2.gguf", "phi2", {}, bias=True)
    head = LMHead.from_checkpoint(phi, dtype=torch.float32)
    assert head.head_ops == HeadOps(bias=True)
    with pytest.raises(ArchitectureError, match=r"newarch\.logit_scale"):
        LMHead.from_checkpoint(_gguf(tmp_path / "n.gguf", "newarch", {"logit_scale": 2.0}), dtype=torch.float32)


# ---- transformers' own model classes --------------------------------------------------------------------
FAMILIES = ["gemma2", "gemma3_text", "cohere", "granite", "phi", "hyperclovax", "falcon_h1", "xglm", "minicpm3",
            "bert", "recurrent_gemma", "llama"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    import model_zoo

    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for mt in FAMILIES:
        model_zoo.prepare(mt, root / mt)
        out[mt] = root / mt
    return out


def _ref(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "zoo_reference.safetensors"))


def _head_tol(ref: dict[str, torch.Tensor]) -> float:
    return max(1e-4, 2.0**-20 * float(ref["max_logit"]))


@pytest.mark.model
@pytest.mark.parametrize("mt", FAMILIES)
def test_head_and_embedding_equal_transformers(zoo: dict[str, Path], mt: str) -> None:
    """transformers: the log-softmax of model(ids).logits for the rows lm_head receives (≤ 1e-4 nats,
    or the float32 GEMM's rounding of the suite's x 40 logits) and get_input_embeddings()(ids)."""
    ref = _ref(zoo[mt])
    head = LMHead.from_checkpoint(zoo[mt], dtype=torch.float32)
    got = torch.log_softmax(head(ref["hidden"]).double(), -1)
    assert float((got - ref["logprobs"]).abs().max()) <= _head_tol(ref), head.head_ops
    emb = VocabParallelEmbedding.from_checkpoint(zoo[mt], dtype=torch.float32)
    rows = emb(ref["ids"])
    assert float((rows - ref["rows"]).abs().max()) <= 1e-6 * float(ref["rows"].abs().max()), emb.embedding_ops


@pytest.mark.ranks
@pytest.mark.model
@pytest.mark.parametrize(("tp", "layout"), [(3, "uneven"), (4, "padded")])
def test_families_split_over_ranks_equal_transformers(zoo: dict[str, Path], launch_ranks, tp: int,
                                                      layout: str) -> None:
    from tests.layers.family_rank_fns import load_and_run

    for mt in ("gemma2", "phi", "granite", "bert"):
        ref = _ref(zoo[mt])
        by_rank = launch_ranks(load_and_run, tp, str(zoo[mt]), ref["hidden"], ref["ids"], layout)
        scale = float(ref["rows"].abs().max())
        for r in by_rank:
            got = torch.log_softmax(r["logits"].double(), -1)
            assert float((got - ref["logprobs"]).abs().max()) <= _head_tol(ref), (mt, tp)
            assert float((r["rows"] - ref["rows"]).abs().max()) <= 1e-6 * scale, (mt, tp)
            assert torch.equal(r["rows"], r["tied_rows"]) or mt in ("phi", "granite")
            local = r["local"]
            assert torch.isinf(local[:, r["size"]:]).all()  # padding columns -inf, never the bias
        stitched = torch.cat([r["local"][:, : r["size"]] for r in by_rank], 1)
        torch.testing.assert_close(stitched, by_rank[0]["logits"], rtol=0, atol=0)


# ---- export: ONNX graphs and the embedding graph ------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 3])
def test_onnx_graph_of_a_softcapped_scaled_biased_head(tp: int) -> None:
    pytest.importorskip("onnxruntime")
    from trtvocab.backends.onnx import run_onnx
    from trtvocab.export.onnx import build_model_for_head

    ops = HeadOps(bias=True, scale=0.5, divisor=3.0, softcap=7.5)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(8))
    seq = torch.tensor([3, 1, 3], dtype=torch.int32)
    for rank in range(tp):
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
        head, _, _ = _head(ops, mapping=mapping)
        model = build_model_for_head(head)
        assert {"Add", "Mul", "Div", "Tanh"} <= {n.op_type for n in model.graph.node}
        run = run_onnx(model, x, seq)
        want = shard_logits(head, x, seq, return_context_logits=False)
        torch.testing.assert_close(torch.from_numpy(run.logits), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_graph_scales_like_the_module(dtype: torch.dtype) -> None:
    pytest.importorskip("onnxruntime")
    from trtvocab.backends.onnx_embedding import run_embedding_onnx
    from trtvocab.export.embedding import build_embedding_model

    ops = EmbeddingOps(scale=math.sqrt(640))  # Gemma 3 270M: sqrt(640) rounded to the table's dtype
    emb = VocabParallelEmbedding(V, H, dtype=dtype, mapping=Mapping(world_size=3, rank=1, tp_size=3),
                                 embedding_ops=ops, reduce_output=False)
    emb.load_weights({"weight": torch.randn(V, H).to(dtype)})
    model = build_embedding_model(emb)
    ids = torch.tensor([-1, 0, emb.vocab_start, emb.vocab_end - 1, emb.vocab_end, V, 40])
    rows, scales = emb.local_rows(ids)
    want = ops.apply(emb.dequantize_rows(rows, scales))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        import onnx

        onnx.save(model, f"{tmp}/e.onnx")
        got = run_embedding_onnx(Path(tmp) / "e.onnx", ids)
    assert torch.equal(got, want)
    assert float(got[2].float().abs().max()) > 0  # an owned id, scaled


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (3, 0)])  # rank 0 of 3: 86 rows (the builder pads odd ones)
def test_engine_layer_table_shows_the_ops(tp: int, rank: int) -> None:
    """TensorRT-RTX builds the soft-capped, scaled, biased head (and a tp 3 rank's shard of it) ahead of
    time; its layer table shows the GEMM and the elementwise / activation layers after it (the GEMM
    contract still holds)."""
    pytest.importorskip("tensorrt_rtx")
    from tests.export import test_engine_graphs as eg
    from tests.export.test_engine_graphs import build, gemm
    from trtvocab.export.onnx import build_model_for_head

    ops = HeadOps(bias=True, scale=0.5, softcap=30.0)
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
    head = LMHead(eg.V, eg.H, dtype=torch.bfloat16, head_ops=ops, mapping=mapping, gather_output=False)
    head.load_weights({"weight": eg._weight().to(torch.bfloat16), "bias": torch.randn(eg.V)})
    table = build(build_model_for_head(head))
    g = gemm(table, rows=head.local_vocab_size)
    assert (g.activation, g.weight, g.resident) == ("bfloat16", "bfloat16", True)
    nodes = {n for layer in table.layers for n in layer.onnx_nodes}
    assert any("Tanh" in n for n in nodes) and any("Add" in n for n in nodes), sorted(nodes)


# ---- quantize and compare keep the family ----------------------------------------------------------------
def _moderate(tmp_path: Path, model_type: str, **config) -> tuple[Path, torch.Tensor]:
    """A checkpoint at a real model's scale (logits of a few units to tens), with a bias for Phi."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(V, H, generator=gen) * (1.5 if model_type == "gemma2" else 0.05)
    tensors = {"lm_head.weight": w, "model.embed_tokens.weight": torch.randn(V, H, generator=gen)}
    if model_type == "phi":
        tensors["lm_head.bias"] = torch.randn(V, generator=gen) * 2
    path = _write(tmp_path / model_type, tensors, {"model_type": model_type, "tie_word_embeddings": False, **config})
    return path, torch.randn(16, H, generator=gen)


@pytest.mark.model
def test_quantize_writes_the_bias_and_the_family(tmp_path: Path) -> None:
    """`trtvocab quantize` of a biased head (Phi) writes lm_head.bias beside the FP8 weight, and a GGUF
    Gemma 2 source's soft-cap reaches the output's config.json under transformers' name."""
    pytest.importorskip("modelopt")
    from trtvocab.quant.quantize import quantize_checkpoint

    path, x = _moderate(tmp_path, "phi")
    quantize_checkpoint(path, tmp_path / "phi-fp8", algo="fp8")
    head = LMHead.from_checkpoint(tmp_path / "phi-fp8", dtype=torch.float32)
    assert head.weight_format.value == "FP8" and head.head_ops == HeadOps(bias=True)
    base = torch.log_softmax(LMHead.from_checkpoint(path, dtype=torch.float32)(x).double(), -1)
    got = torch.log_softmax(head(x).double(), -1)
    assert float((base.exp() * (base - got)).sum(-1).max()) < 1e-3  # FP8 noise, not a lost bias
    src = _gguf(tmp_path / "g2.gguf", "gemma2", {"final_logit_softcapping": 30.0})
    quantize_checkpoint(src, tmp_path / "g2-fp8", algo="fp8")
    config = json.loads((tmp_path / "g2-fp8" / "config.json").read_text())
    assert config["model_type"] == "gemma2" and config["final_logit_softcapping"] == 30.0
    assert LMHead.from_checkpoint(tmp_path / "g2-fp8", dtype=torch.float32).head_ops == HeadOps(softcap=30.0)


@pytest.mark.parametrize(("model_type", "config"), [("phi", {}), ("gemma2", {"final_logit_softcapping": 5.0})])
def test_compare_simulates_the_family_head(tmp_path: Path, model_type: str, config: dict) -> None:
    """compare --simulate fp8 / nvfp4: the simulated heads keep the bias and the soft-cap; their KL divergence
    from the true distribution is the quantization's, far below that of the head without its ops."""
    from trtvocab.accuracy.compare import compare

    path, x = _moderate(tmp_path, model_type, **config)
    head = LMHead.from_checkpoint(path, dtype=torch.float32)
    base = torch.log_softmax(head(x).double(), -1)
    plain = torch.log_softmax((x.double() @ head.weight.double().T), -1)
    dropped = float((base.exp() * (base - plain)).sum(-1).mean())
    report = compare(path, hidden=x, simulate=["fp8", "nvfp4"])
    for v in report.variants:
        assert v.metrics.kl_mean < 0.02 * dropped, (v.name, v.metrics.kl_mean, dropped)
