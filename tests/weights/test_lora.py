"""LoRA adapters on the head and the embedding (trtvocab.weights.lora), against PEFT's own models.

The references are ``PeftModel.from_pretrained(base, adapter)`` runs of tiny random Llama models (untied
and tied): ``hidden_states[0]`` is the embedding's output, ``logits`` the head's, ``hidden_states[-1]``
what the head takes. One batch mixes two LoRA adapters and none (PEFT's ``adapter_names``), another
mixes trainable tokens, a modules_to_save copy and none (each row against its adapter's own PEFT run).
At tp 1, 3 (uneven) and 4 (padded); ``merge_and_unload`` is the second reference. The refusals need no
model: their adapter folders are written by hand.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.weights.lora_rank_fns import disagreeing_picks, lora_cases, refusals
from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.base.family import EmbeddingOps, HeadOps
from trtvocab.errors import AdapterError, InputError

V, H = 50, 16
SPECS: dict[str, dict[str, Any]] = {
    "one": {"target_modules": ["lm_head", "embed_tokens"], "r": 4, "lora_alpha": 8},
    "two": {"target_modules": ["lm_head", "embed_tokens"], "r": 2, "lora_alpha": 4, "use_rslora": True},
    "tok": {"target_modules": ["q_proj"], "trainable_token_indices": [3, 17, 40], "r": 2},
    "copy": {"target_modules": ["q_proj"], "r": 2, "modules_to_save": ["lm_head", "embed_tokens"]},
}


def _build(root: Path, tied: bool) -> dict[str, Any]:
    """A base checkpoint, four adapter folders and PEFT's outputs for them (``ids [3, 5]``)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(11 + tied)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base_dir = root / f"base{int(tied)}"
    base.save_pretrained(base_dir)
    for name, spec in SPECS.items():
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**spec), adapter_name=name)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname or "modules_to_save" in pname or "trainable_tokens_delta" in pname:
                    p.add_(torch.randn_like(p) * 0.3)
        model.save_pretrained(root / f"ad{int(tied)}", selected_adapters=[name])
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(3))
    ids[0, 1], ids[2, 2], ids[1, 0] = 17, 3, 40  # trainable tokens in every row

    def run(names: list[str] | None, *adapters: str) -> Any:
        model = transformers.LlamaForCausalLM.from_pretrained(base_dir)
        if adapters:
            model = peft.PeftModel.from_pretrained(model, root / f"ad{int(tied)}" / adapters[0],
                                                   adapter_name=adapters[0])
            for extra in adapters[1:]:
                model.load_adapter(root / f"ad{int(tied)}" / extra, adapter_name=extra)
        with torch.no_grad():
            kw = {"adapter_names": names} if names else {}
            return model.eval()(ids, output_hidden_states=True, **kw)

    mixed = run(["one", "__base__", "two"], "one", "two")
    plain, tok, cp = run(None), run(None, "tok"), run(None, "copy")
    merged_model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base_dir),
                                                  root / f"ad{int(tied)}" / "one").merge_and_unload()
    with torch.no_grad():
        merged = merged_model(ids, output_hidden_states=True)
    pick = [tok, cp, plain]  # batch B: rows use tok, copy, none
    return {
        "base": str(base_dir), "dir": root / f"ad{int(tied)}", "ids": ids, "mixed": mixed, "merged": merged,
        "b_rows": torch.stack([pick[i].hidden_states[0][i] for i in range(3)]),
        "b_logits": torch.stack([pick[i].logits[i] for i in range(3)]),
        "b_hidden": torch.stack([pick[i].hidden_states[-1][i] for i in range(3)]),
    }


@pytest.fixture(scope="module")
def peft_refs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict[str, Any]]:
    root = tmp_path_factory.mktemp("lora")
    return {tied: _build(root, tied) for tied in (False, True)}


def _cases(refs: dict[bool, dict[str, Any]]) -> list[dict[str, Any]]:
    cases = []
    for tied in (False, True):
        ref = refs[tied]
        folders = [(str(ref["dir"] / n), "ignore" if n in ("tok", "copy") else "refuse") for n in SPECS]
        cases.append({"base": ref["base"], "adapters": folders, "ids": ref["ids"],
                      "adapter_ids": torch.tensor([0, -1, 1]), "hidden": ref["mixed"].hidden_states[-1].reshape(-1, H)})
        cases.append({"base": ref["base"], "adapters": folders, "ids": ref["ids"],
                      "adapter_ids": torch.tensor([2, 3, -1]), "hidden": ref["b_hidden"].reshape(-1, H)})
    return cases


def _check(results: list[dict[str, Any]], refs: dict[bool, dict[str, Any]], what: str) -> None:
    for i, tied in enumerate((False, True)):
        ref = refs[tied]
        expected = [(ref["mixed"].hidden_states[0], ref["mixed"].logits), (ref["b_rows"], ref["b_logits"])]
        for got, (rows, logits) in zip(results[2 * i : 2 * i + 2], expected, strict=True):
            label = f"{what} tied={tied}"
            torch.testing.assert_close(got["rows"], rows, rtol=0, atol=1e-6, msg=label)
            flat = logits.reshape(-1, V)
            torch.testing.assert_close(got["logits"], flat, rtol=1e-5, atol=1e-5, msg=label)
            assert torch.equal(got["tokens"], flat.argmax(-1)), label
            assert torch.equal(got["streamed"], flat.argmax(-1)), label


@pytest.mark.model
def test_lora_matches_peft_tp1(peft_refs: dict[bool, dict[str, Any]]) -> None:
    """Replicated: two LoRA adapters (one rsLoRA) and none in one batch; trainable tokens, a copy and none."""
    _check(lora_cases(0, 1, _cases(peft_refs), "uneven"), peft_refs, "tp1")


@pytest.mark.model
def test_lora_matches_merged_model(peft_refs: dict[bool, dict[str, Any]]) -> None:
    """merge_and_unload of adapter "one" is the second reference: its rows and logits, adapter 0 on every row.
    Untied only: merging a tied model's two LoRAs adds both into its one shared table (PEFT warns about it)."""
    for tied in (False,):
        ref = peft_refs[tied]
        emb = VocabParallelEmbedding.from_checkpoint(ref["base"], dtype=torch.float32)
        head = LMHead.from_checkpoint(ref["base"], dtype=torch.float32)
        emb.load_adapter(ref["dir"] / "one")
        head.load_adapter(ref["dir"] / "one")
        merged = ref["merged"]
        everyone = torch.zeros(3, dtype=torch.int64)
        torch.testing.assert_close(emb(ref["ids"], everyone), merged.hidden_states[0], rtol=1e-5, atol=1e-5)
        logits = head(merged.hidden_states[-1].reshape(-1, H), everyone.repeat_interleave(5))
        torch.testing.assert_close(logits, merged.logits.reshape(-1, V), rtol=1e-4, atol=1e-4)


@pytest.mark.ranks
@pytest.mark.model
def test_lora_matches_peft_tp3_uneven_tp4_padded(peft_refs: dict[bool, dict[str, Any]], launch_ranks: Any) -> None:
    """Vocab-split: each rank holds its rows of B (head) / columns of A (embedding); gathered logits, the
    sampler and the chunked decode see each row's own adapter; rank 3 of tp 4 ends in padding."""
    cases = _cases(peft_refs)
    single = lora_cases(0, 1, cases, "uneven")
    for tp, layout in ((3, "uneven"), (4, "padded")):
        results = launch_ranks(lora_cases, tp, cases, layout, timeout_s=240)
        for rank in range(tp):
            _check(results[rank], peft_refs, f"tp{tp} {layout} rank {rank}")
            for got, ref in zip(results[rank], single, strict=True):  # seeded draws: keyed by token id
                assert torch.equal(got["drawn"], ref["drawn"]) and torch.equal(got["drawn_streamed"], ref["drawn"])
        # Adapter bytes per rank: the split parts shrink with tp, the replicated ones do not.
        assert results[0][0]["adapter_bytes"] < single[0]["adapter_bytes"]


# ---- refusals (hand-written adapter folders, no model) ---------------------------------------------------
def _adapter(folder: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _head_lora(r: int = 2, rows: int = V) -> dict[str, torch.Tensor]:
    return {"base_model.model.lm_head.lora_A.weight": torch.randn(r, H),
            "base_model.model.lm_head.lora_B.weight": torch.randn(rows, r)}


def _head() -> LMHead:
    head = LMHead(V, H, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(V, H)})
    return head


@pytest.mark.parametrize(("tensors", "config", "match"), [
    (_head_lora(), {"use_dora": True}, "use_dora is set: DoRA"),
    (_head_lora(), {"peft_type": "IA3"}, "peft_type 'IA3' is not LoRA"),
    (_head_lora(r=3), {}, r"lm_head.lora_A.weight is \[3, 16\], expected \[r=2, H=16\]"),
    (_head_lora(rows=V + 1), {}, r"lm_head.lora_B.weight has 51 token rows, more than the base vocabulary 50"),
    (_head_lora(rows=V - 1), {}, r"lm_head.lora_B.weight is \[49, 2\], expected \[50, 2\]"),
    ({**_head_lora(), "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 4)}, {},
     "targets modules other than the head"),
    ({**_head_lora(), "base_model.model.lm_head.lora_magnitude_vector": torch.ones(V)}, {}, "DoRA magnitude"),
    ({"base_model.model.lm_head.lora_embedding_A": torch.zeros(2, V),
      "base_model.model.lm_head.lora_embedding_B": torch.zeros(H, 2)}, {}, "embedding LoRA tensor on lm_head"),
    ({"base_model.model.lm_head.lora_A.weight": torch.randn(2, H)}, {}, "no lora_B partner"),
    (_head_lora(), {"rank_pattern": {"lm_.*": 4}}, "is a regular expression"),
    ({"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": torch.zeros(1, H)},
     {"trainable_token_indices": [V + 2]}, "outside the vocabulary"),
])
def test_bad_adapters_are_refused(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                                  match: str) -> None:
    folder = _adapter(tmp_path / "bad", tensors, **config)
    head, emb = _head(), VocabParallelEmbedding(V, H, dtype=torch.float32)
    emb.load_weights({"weight": torch.randn(V, H)})
    with pytest.raises(AdapterError, match=match):
        head.load_adapter(folder)
        emb.load_adapter(folder)
    assert head.adapters == [] or emb.adapters == []


def test_nan_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    tensors = _head_lora()
    tensors["base_model.model.lm_head.lora_B.weight"][V - 1, 0] = float("nan")
    folder = _adapter(tmp_path / "nan", tensors)
    with pytest.raises(AdapterError, match=r"nan/adapter_model.safetensors: tensor base_model.model.lm_head.lora_B"
                                           r".weight holds NaN or inf"):
        _head().load_adapter(folder)


@pytest.mark.ranks
def test_split_refusals_fail_every_rank(tmp_path: Path, launch_ranks: Any) -> None:
    """Only the last rank reads the NaN row of B: it raises AdapterError, its peers PeerRankError, no hang;
    ranks picking different adapters for the same rows all raise RankMismatchError."""
    tensors = _head_lora()
    tensors["base_model.model.lm_head.lora_B.weight"][V - 1, 0] = float("nan")
    folder = _adapter(tmp_path / "nan", tensors)
    assert launch_ranks(refusals, 2, str(folder), timeout_s=120) == [("PeerRankError", 0), ("AdapterError", 0)]
    # Ranks that pick different adapters for the same rows: every rank refuses (no silent divergence).
    good = _adapter(tmp_path / "good", _head_lora())
    assert launch_ranks(disagreeing_picks, 2, str(good), timeout_s=120) == ["RankMismatchError"] * 2


def test_rslora_scaling_and_row_picks(tmp_path: Path) -> None:
    """rsLoRA scales by alpha / sqrt(r); -1 rows are the base head bitwise; bad indices are InputErrors."""
    tensors = _head_lora(r=4)
    folder = _adapter(tmp_path / "rs", tensors, r=4, lora_alpha=6, use_rslora=True)
    head = _head()
    assert head.load_adapter(folder) == 0 and head.adapter_names == ["rs"]
    x = torch.randn(3, H)
    a, b = tensors["base_model.model.lm_head.lora_A.weight"], tensors["base_model.model.lm_head.lora_B.weight"]
    expected = x @ head.weight.t() + (x @ a.t()) @ b.t() * (6 / math.sqrt(4))
    got = head(x, torch.tensor([0, -1, 0]))
    torch.testing.assert_close(got[[0, 2]], expected[[0, 2]], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], head(x)[1])
    for bad in (torch.tensor([0, 1, 0]), torch.tensor([0, 0]), torch.tensor([0.0, 0.0, 0.0]), [0, 0, 0]):
        with pytest.raises(InputError, match="adapter_ids"):
            head(x, bad)
    with pytest.raises(AdapterError, match="loaded already"):
        head.load_adapter(folder)


def test_family_ops_follow_the_lora_gemm(tmp_path: Path) -> None:
    """A soft-capped, biased head: softcap((x @ W.T + delta + b) * scale); a scaled embedding (Gemma's
    sqrt(H)): (W[ids] + delta) * scale, as PEFT scales the adapter's output too."""
    r = 2
    emb_a, emb_b = torch.randn(r, V), torch.randn(H, r)
    tensors = {**_head_lora(r), "base_model.model.model.embed_tokens.lora_embedding_A": emb_a,
               "base_model.model.model.embed_tokens.lora_embedding_B": emb_b}
    folder = _adapter(tmp_path / "ops", tensors, r=r, lora_alpha=3)
    w, bias = torch.randn(V, H), torch.randn(V)
    head = LMHead(V, H, dtype=torch.float32, head_ops=HeadOps(bias=True, scale=0.5, softcap=5.0))
    head.load_weights({"weight": w, "bias": bias})
    head.load_adapter(folder)
    x = torch.randn(4, H)
    a, b = tensors["base_model.model.lm_head.lora_A.weight"], tensors["base_model.model.lm_head.lora_B.weight"]
    z = (x @ w.t() + (x @ a.t()) @ b.t() * 1.5 + bias) * 0.5
    torch.testing.assert_close(head(x, torch.zeros(4, dtype=torch.int64)), 5.0 * torch.tanh(z / 5.0),
                               rtol=1e-5, atol=1e-5)
    emb = VocabParallelEmbedding(V, H, dtype=torch.float32, embedding_ops=EmbeddingOps(scale=4.0))
    emb.load_weights({"weight": w})
    emb.load_adapter(folder)
    ids = torch.tensor([[1, 7, 49], [0, 3, 3]])
    expected = (w[ids] + (emb_a.t()[ids] @ emb_b.t()) * 1.5) * 4.0
    got = emb(ids, torch.tensor([0, -1]))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], emb(ids)[1])


def test_plan_counts_adapter_bytes_per_rank(tmp_path: Path) -> None:
    """`trtvocab plan --lora`: each rank's figure is what its bf16 head and embedding hold for the adapter."""
    from trtvocab import Mapping
    from trtvocab.pipeline.plan import make_plan
    from trtvocab.weights.lora import open_adapter

    tensors = {**_head_lora(3), "base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(3, V),
               "base_model.model.model.embed_tokens.lora_embedding_B": torch.randn(H, 3),
               "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": torch.randn(3, H)}
    folder = _adapter(tmp_path / "plan", tensors, r=3, trainable_token_indices=[0, 20, 49])
    plan = make_plan(V, H, 3, 4, adapters=[open_adapter(folder)])
    assert plan.adapters == ["plan"]
    for rank in range(3):
        mapping = Mapping(world_size=3, rank=rank, tp_size=3)
        head, emb = LMHead(V, H, mapping=mapping), VocabParallelEmbedding(V, H, mapping=mapping)
        for module in (head, emb):
            module.load_weights({"weight": torch.randn(V, H)})
            module.load_adapter(folder)
        assert plan.ranks[rank].adapter_bytes == head.adapter_bytes() + emb.adapter_bytes() > 0


def test_quantized_head_adds_the_same_delta_and_export_refuses_adapters(tmp_path: Path) -> None:
    """An FP8 head: the adapter adds exactly its LoRA term to the head's own float32 logits. ONNX export of
    a head or a table holding adapters is refused (the graph would drop them)."""
    pytest.importorskip("onnx")
    from trtvocab import QuantAlgo, QuantConfig
    from trtvocab.base.formats import Activation
    from trtvocab.errors import ConfigError
    from trtvocab.export.embedding import build_embedding_model
    from trtvocab.export.onnx import build_model_for_head
    from trtvocab.quant import fp8

    tensors = _head_lora()
    folder = _adapter(tmp_path / "q", tensors)
    w = torch.randn(V, H)
    scale = w.abs().max() / 448
    head = LMHead(V, H, dtype=torch.float32,
                  quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, activation=Activation.NONE))
    q, scale = fp8.quantize_fp8(w, scale)
    head.load_weights({"weight": q, "weight_scale": scale})
    head.load_adapter(folder)
    x = torch.randn(3, H)
    a, b = tensors["base_model.model.lm_head.lora_A.weight"], tensors["base_model.model.lm_head.lora_B.weight"]
    delta = head(x, torch.zeros(3, dtype=torch.int64)) - head(x)
    torch.testing.assert_close(delta, (x @ a.t()) @ b.t() * 2.0, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="holds LoRA adapters"):
        build_model_for_head(head)
    emb = VocabParallelEmbedding(V, H, dtype=torch.float32)
    emb.load_weights({"weight": w})
    prefix = "base_model.model.model.embed_tokens"
    emb.load_adapter(_adapter(tmp_path / "e", {f"{prefix}.lora_embedding_A": torch.randn(2, V),
                                                f"{prefix}.lora_embedding_B": torch.randn(H, 2)}))
    with pytest.raises(ConfigError, match="holds LoRA adapters"):
        build_embedding_model(emb)


def test_cli_plan_lora(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from trtvocab.commands.cli import app

    folder = _adapter(tmp_path / "cli", _head_lora())
    result = CliRunner().invoke(app, ["plan", "--vocab", str(V), "--hidden", str(H), "--tp", "3", "--lora", str(folder),
                                      "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["adapters"] == ["cli"]
    assert [r["adapter_bytes"] for r in plan["ranks"]] == [4 * 2 * (size + H) for size in (17, 17, 16)]


def test_logits_processor_gives_each_sequence_its_adapter(tmp_path: Path) -> None:
    """LogitsProcessor(adapter_ids=[B]): every selected row of a sequence uses that sequence's adapter."""
    from trtvocab import LogitsProcessor

    head = _head()
    head.load_adapter(_adapter(tmp_path / "a", _head_lora()))
    head.load_adapter(_adapter(tmp_path / "b", _head_lora(r=2)))
    hidden, lens, per_seq = torch.randn(9, H), [4, 2, 3], torch.tensor([1, -1, 0])
    rows = torch.repeat_interleave(per_seq, torch.tensor(lens))
    lp = LogitsProcessor()
    torch.testing.assert_close(lp(hidden, head, lens, adapter_ids=per_seq), head(hidden[[3, 5, 8]], per_seq))
    torch.testing.assert_close(lp(hidden, head, lens, return_context_logits=True, adapter_ids=per_seq),
                               head(hidden, rows))
    picked = [2, 3, 4, 5, 7, 8]
    torch.testing.assert_close(lp(hidden, head, lens, num_logits_per_seq=2, adapter_ids=per_seq),
                               head(hidden[picked], rows[picked]))
    with pytest.raises(InputError, match="one per sequence"):
        lp(hidden, head, lens, adapter_ids=torch.tensor([0, 1]))


def test_compare_takes_an_adapter_as_a_variant(tmp_path: Path, hf_checkpoint: Any) -> None:
    """compare --lora NAME=DIR: the baseline's head with the adapter on every row; a zero adapter is the
    baseline itself (KL 0, same top-1 everywhere), a real one moves the distribution."""
    from trtvocab.accuracy.compare import compare

    w = torch.randn(V, H)
    base = hf_checkpoint({"lm_head.weight": w, "model.embed_tokens.weight": torch.randn(V, H)},
                         {"model_type": "llama", "vocab_size": V, "hidden_size": H})
    zero = _head_lora()
    zero["base_model.model.lm_head.lora_B.weight"].zero_()
    real = _head_lora()
    real["base_model.model.lm_head.lora_B.weight"] *= 3.0
    folders = {"zero": _adapter(tmp_path / "zero", zero), "real": _adapter(tmp_path / "real", real)}
    hidden = torch.randn(12, H)
    report = compare(base, hidden=hidden, seq_lens=torch.tensor([5, 7]), bootstrap=0,
                     loras=[f"{n}={f}" for n, f in folders.items()])
    by_name = {v.name: v for v in report.variants}
    assert set(by_name) == {"lora:zero", "lora:real"}
    assert by_name["lora:zero"].metrics.kl_mean == 0.0 and by_name["lora:zero"].metrics.top1_agreement == 1.0
    assert by_name["lora:real"].metrics.kl_mean > 1e-3
    with pytest.raises(Exception, match="expected NAME=DIR"):
        compare(base, hidden=hidden, bootstrap=0, loras=["nodir"])


def test_adapter_config_must_be_a_small_regular_json_file(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "cfg", _head_lora())
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        _head().load_adapter(folder)
    (folder / "adapter_config.json").unlink()
    (folder / "adapter_config.json").mkdir()
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        _head().load_adapter(folder)
    with pytest.raises(AdapterError, match="not a PEFT adapter folder"):
        _head().load_adapter(tmp_path / "missing")


def test_onnx_bakes_in_one_lora_adapter(tmp_path: Path) -> None:
    """export_onnx(head, adapter=k): two float32 MatMuls added to x @ W.T before the family's ops; the graph's
    logits equal the head's with adapter k on every row (float32 and bf16 heads, soft-capped, last rows)."""
    pytest.importorskip("onnx")
    from trtvocab.backends.onnx import run_onnx
    from trtvocab.errors import ConfigError
    from trtvocab.export.onnx import GraphSpec, build_model_for_head

    folder = _adapter(tmp_path / "x", _head_lora(r=3), r=3, lora_alpha=5)
    copy_folder = _adapter(tmp_path / "c", {"base_model.model.lm_head.weight": torch.randn(V, H)})
    w = torch.randn(V, H)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        head = LMHead(V, H, dtype=dtype, head_ops=HeadOps(softcap=8.0))
        head.load_weights({"weight": w.to(dtype)})
        head.load_adapter(folder)
        head.load_adapter(copy_folder)
        model = build_model_for_head(head, adapter=0)
        assert GraphSpec.from_model(model).lora_rank == 3
        x, lens = torch.randn(7, H).to(dtype), torch.tensor([3, 4])
        got = torch.as_tensor(run_onnx(model, x, lens).logits)
        expected = head(x[[2, 6]], torch.zeros(2, dtype=torch.int64)).float()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        assert (got - head(x[[2, 6]]).float()).abs().max() > 10 * tol  # the adapter is in the graph
        with pytest.raises(ConfigError, match="only LoRA factors are exported"):
            build_model_for_head(head, adapter=1)
        with pytest.raises(ConfigError, match="adapter must be an index"):
            build_model_for_head(head, adapter=2)
