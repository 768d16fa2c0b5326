"""Adapters that add tokens (modules_to_save copies of a resized embed_tokens / lm_head), against PEFT's own models.

The adapter ``add`` was trained (here: perturbed) after ``model.resize_token_embeddings(V + K)``; its
reference is ``PeftModel.from_pretrained(resized base, add)``. A row without an adapter -- or with ``lora``,
an adapter that adds nothing -- has the base vocabulary only: its references are the base model and PEFT's
``lora`` run, with ``-inf`` logits on the added ids (vLLM's layout: ids outside a row's vocabulary are
nobody's). At tp 1, 3 (uneven) and 4 (padded, pad_to 4: rank 3 owns no added id); the local columns are
checked against the added-vocabulary layout's real shard offsets. The refusals need no model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.sampling.lora_added_rank_fns import KNOB_H, KNOB_V, added_case, disagreeing_params, knobs_case
from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.base.family import HeadOps
from trtvocab.errors import AdapterError, ConfigError, InputError
from trtvocab.sampling import SamplingParams, chunked, decode

V, H, K, T = 50, 16, 5, 6
PROBE = torch.tensor([[3, V, V + K - 1, V - 1]])


def _llama(transformers: Any) -> Any:
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("added")
    torch.manual_seed(21)
    base = _llama(transformers)
    base.save_pretrained(root / "base")
    resized = copy.deepcopy(base)
    resized.resize_token_embeddings(V + K, mean_resizing=False)
    add = peft.get_peft_model(resized, peft.LoraConfig(target_modules=["q_proj"], r=2,
                                                       modules_to_save=["lm_head", "embed_tokens"]), adapter_name="add")
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=["lm_head", "embed_tokens"], r=4,
                                                                    lora_alpha=8), adapter_name="plain")
    with torch.no_grad():
        for model in (add, lora):
            for name, p in model.named_parameters():
                if "lora_" in name or "modules_to_save" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        for name, p in add.named_parameters():  # the added head rows: large enough to win some argmaxes
            if "modules_to_save" in name and "lm_head" in name:
                p[V:] *= 4.0
    add.save_pretrained(root / "ad")
    lora.save_pretrained(root / "ad", save_embedding_layers=False)
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(4))
    ids[0, 1], ids[0, 4] = V, V + K - 1  # the adapter's row holds added ids

    def run(name: str | None, row: torch.Tensor) -> Any:
        model = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        if name == "add":
            model.resize_token_embeddings(V + K, mean_resizing=False)  # the copies replace both tables
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, root / "ad" / name, adapter_name=name)
        with torch.no_grad():
            out = model.eval()(row[None], output_hidden_states=True)
            probe = model.get_input_embeddings()(PROBE.clamp(max=model.get_input_embeddings().weight.shape[0] - 1))
        return out, probe

    (a, a_probe), (b, b_probe), (c, c_probe) = run("add", ids[0]), run(None, ids[1]), run("plain", ids[2])
    pad = torch.full((T, K), float("-inf"))
    logits = torch.cat([a.logits[0], torch.cat([b.logits[0], pad], 1), torch.cat([c.logits[0], pad], 1)])
    assert (logits[:T].argmax(-1) >= V).any() and (logits[:T].argmax(-1) < V).any()  # the added ids matter
    return {
        "case": {"base": str(root / "base"), "adapters": [str(root / "ad" / "add"), str(root / "ad" / "plain")],
                 "ids": ids, "adapter_ids": torch.tensor([0, -1, 1]), "probe_ids": PROBE,
                 "hidden": torch.cat([a.hidden_states[-1][0], b.hidden_states[-1][0], c.hidden_states[-1][0]])},
        "rows": torch.stack([a.hidden_states[0][0], b.hidden_states[0][0], c.hidden_states[0][0]]),
        "logits": logits, "probes": {-1: b_probe[0], 0: a_probe[0], 1: c_probe[0]},
    }


def _check(got: dict[str, Any], refs: dict[str, Any], what: str) -> None:
    torch.testing.assert_close(got["rows"], refs["rows"], rtol=0, atol=1e-6, msg=what)
    expected = refs["logits"]
    assert torch.equal(torch.isinf(got["logits"]), torch.isinf(expected)), what  # the per-row vocabulary limits
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got["logits"][finite], expected[finite], rtol=1e-5, atol=1e-5, msg=what)
    # The local columns are the layout's: base piece then added piece, padding -inf.
    cols = torch.tensor(got["columns"])
    assert got["local"].shape[1] == cols.numel(), what
    own = cols >= 0
    torch.testing.assert_close(got["local"][:, own], expected[:, cols[own]], rtol=1e-5, atol=1e-5, msg=what)
    assert torch.isneginf(got["local"][:, ~own]).all(), what
    assert got["columns"] == got["emb_columns"], what
    assert torch.equal(got["greedy"], expected.argmax(-1)), what
    assert torch.equal(got["gathered"], got["greedy"]), what  # gather-free greedy == greedy in token order
    assert (got["drawn"][T:] < V).all(), what  # rows without the adapter never draw an added id
    assert torch.equal(got["raced"], got["raced_gathered"]), what  # gather-free race == token-order race
    assert (got["raced"][T:] < V).all(), what
    # Lookups without an adapter, with the adapter and with one that adds nothing: added ids are zero rows
    # unless the row's adapter adds them (the positions a row cannot hold are compared with zeros).
    for k, rows in zip((-1, 0, 1), got["probes"], strict=True):
        ref = refs["probes"][k].clone()
        if k != 0:
            ref[1:3] = 0.0
        torch.testing.assert_close(rows[0], ref, rtol=0, atol=1e-6, msg=f"{what} probe {k}")
    assert got["added_vocab"] == (K, K)


@pytest.mark.model
def test_added_tokens_match_peft_tp1(refs: dict[str, Any]) -> None:
    _check(added_case(0, 1, refs["case"], "uneven"), refs, "tp1")


@pytest.mark.model
@pytest.mark.ranks
def test_added_tokens_match_peft_tp3_uneven_tp4_padded(refs: dict[str, Any], launch_ranks: Any) -> None:
    """Every rank holds its base rows and its slice of the added segment; the gathered logits are in token
    order, the sampler sees each row's limits, and seeded draws are the same at every tp size."""
    single = added_case(0, 1, refs["case"], "uneven")
    for tp, layout in ((3, "uneven"), (4, "padded")):
        results = launch_ranks(added_case, tp, refs["case"], layout, timeout_s=240)
        for rank, got in enumerate(results):
            _check(got, refs, f"tp{tp} {layout} rank {rank}")
            assert torch.equal(got["drawn"], single["drawn"]), f"tp{tp} rank {rank}"
            assert torch.equal(got["raced"], single["raced"]), f"tp{tp} rank {rank}"
        assert results[0]["adapter_bytes"] < single["adapter_bytes"]  # the copies are split too
        if layout == "padded":  # the last rank owns no added id: its added piece is all padding
            assert set(results[tp - 1]["columns"][-4:]) == {-1}


# ---- refusals (hand-written adapter folders, no model) ---------------------------------------------------
def _adapter(folder: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            "modules_to_save": ["lm_head", "embed_tokens"], **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


EMB, HEAD = "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"


def _ends(**head_kw: Any) -> tuple[VocabParallelEmbedding, LMHead]:
    emb = VocabParallelEmbedding(V, H, dtype=torch.float32)
    emb.load_weights({"weight": torch.randn(V, H)})
    head = LMHead(V, H, dtype=torch.float32, **head_kw)
    head.load_weights({"weight": torch.randn(V, H), **({"bias": torch.zeros(V)} if "head_ops" in head_kw else {})})
    return emb, head


@pytest.mark.parametrize(("tensors", "match"), [
    ({EMB: torch.randn(V + 3, H), HEAD: torch.randn(V + 2, H)},
     rf"tensor {EMB} adds 3 tokens but tensor {HEAD} adds 2"),
    ({EMB: torch.randn(V + 3, H)}, rf"tensor {EMB} adds 3 tokens to the embedding, but the adapter has no "
                                   r"\[V \+ 3, H\] copy of lm_head"),
    ({HEAD: torch.randn(V + 3, H), EMB: torch.randn(V, H)}, rf"tensor {HEAD} adds 3 tokens to the head"),
    ({HEAD: torch.randn(V + 3, H), "base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(2, V + 3),
      "base_model.model.model.embed_tokens.lora_embedding_B": torch.randn(H, 2)},
     r"lora_embedding_A has 53 token rows, more than the base vocabulary 50: LoRA on a resized model.embed_tokens"),
])
def test_inconsistent_added_rows_are_refused(tmp_path: Path, tensors: dict[str, torch.Tensor], match: str) -> None:
    folder = _adapter(tmp_path / "bad", tensors)
    for module in _ends():
        with pytest.raises(AdapterError, match=match) as info:
            module.load_adapter(folder)
        assert "bad/adapter_model.safetensors" in str(info.value)
        assert module.adapters == [] and module.added_vocab == 0


def test_nan_in_added_rows_and_larger_segments(tmp_path: Path) -> None:
    head_rows = torch.randn(V + 3, H)
    head_rows[V + 1, 2] = float("nan")
    bad = _adapter(tmp_path / "nan", {EMB: torch.randn(V + 3, H), HEAD: head_rows})
    _, head = _ends()
    with pytest.raises(AdapterError, match=rf"nan/adapter_model.safetensors: tensor {HEAD} holds NaN"):
        head.load_adapter(bad)
    assert head.added_vocab == 0  # the refused adapter leaves no segment behind
    three = _adapter(tmp_path / "three", {EMB: torch.randn(V + 3, H), HEAD: torch.randn(V + 3, H)})
    five = _adapter(tmp_path / "five", {EMB: torch.randn(V + 5, H), HEAD: torch.randn(V + 5, H)})
    emb, head = _ends()
    head.load_adapter(three)
    with pytest.raises(AdapterError, match=r"five: adds 5 tokens, more than the added segment of 3"):
        head.load_adapter(five)
    emb.set_added_vocab(5)  # the largest segment first: both fit
    assert [emb.load_adapter(three), emb.load_adapter(five)] == [0, 1]
    rows = emb(torch.tensor([[V + 4, V + 2]]), torch.tensor([0]))[0]
    assert torch.equal(rows[0], torch.zeros(H))  # adapter "three" does not add id V + 4
    with pytest.raises(ConfigError, match="adds 3 tokens to a head with a bias"):
        _ends(head_ops=HeadOps(bias=True))[1].load_adapter(three)


def test_sampler_paths_and_export_with_added_tokens(tmp_path: Path) -> None:
    """decode samples in token order (the added ids of the adapter's rows included), and so does the chunked
    head; ONNX export refuses such a head by name; a row's vocabulary limit holds under any temperature."""
    copy_rows = torch.randn(V + 3, H)
    copy_rows[V:] *= 10.0
    folder = _adapter(tmp_path / "add", {EMB: torch.randn(V + 3, H), HEAD: copy_rows})
    _, head = _ends()
    head.load_adapter(folder)
    hidden = torch.randn(8, H)
    picks = torch.tensor([0, -1] * 4)
    expected = torch.where(picks[:, None] >= 0, hidden @ copy_rows.t(),
                           torch.cat([hidden @ head.weight.t(), torch.full((8, 3), float("-inf"))], 1))
    with head.use_adapters(picks):
        assert torch.equal(decode(hidden, head, SamplingParams(temperature=0.0)), expected.argmax(-1))
        drawn = decode(hidden, head, SamplingParams(temperature=5.0, seed=3))
        assert (drawn[1::2] < V).all() and (drawn[0::2] >= V).any()
        limited = decode(hidden, head, SamplingParams(temperature=0.0), vocab_limit=10)
        masked = expected.clone()
        masked[:, 10:V] = float("-inf")
        assert torch.equal(limited, masked.argmax(-1))
        assert torch.equal(chunked.stream_greedy(hidden, head), expected.argmax(-1))  # the stream holds both segments
    # Packed rows with seq_lens: each sequence's last row is drawn (sequence ends 1, 4, 6, 7 of 8 rows), with
    # one adapter pick per sequence
    lens, ends, seq_picks = torch.tensor([2, 3, 2, 1]), [1, 4, 6, 7], torch.tensor([-1, 0, 0, -1])
    last = hidden[ends]
    want = torch.where(seq_picks[:, None] >= 0, last @ copy_rows.t(),
                       torch.cat([last @ head.weight.t(), torch.full((4, 3), float("-inf"))], 1))
    with head.use_adapters(seq_picks):
        assert torch.equal(decode(hidden, head, SamplingParams(temperature=0.0), seq_lens=lens), want.argmax(-1))
        with pytest.raises(InputError, match="seq_lens"):  # lengths that do not add up to the 8 rows
            decode(hidden, head, SamplingParams(temperature=0.0), seq_lens=torch.tensor([2, 3]))
    from trtvocab.export.onnx import export_onnx

    with pytest.raises(ConfigError, match="adds 3 tokens"):
        export_onnx(head, tmp_path / "g.onnx", adapter=0)


# ---- generate --lora with an adapter that adds tokens ---------------------------------------------------
GEN_PROMPTS = ["w3 w7 w9 w12", "w5 w8"]
NEW = 8


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny random Llama with a word-level tokenizer, and an adapter holding only the modules_to_save copies
    of its resized embedding and head (the q_proj LoRA PEFT needs as a target is stripped from the file, so
    PEFT's reference keeps it at its zero init); references: PEFT's and the base model's own greedy ``generate``."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    tokenizers = pytest.importorskip("tokenizers")
    from safetensors.torch import load_file

    from trtvocab.pipeline import generate as G

    root = tmp_path_factory.mktemp("gen")
    torch.manual_seed(3)
    base = _llama(transformers)
    base.generation_config.eos_token_id = 2
    base.save_pretrained(root / "base")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", bos_token="w1",
                                         eos_token="w2").save_pretrained(root / "base")
    resized = copy.deepcopy(base)
    resized.resize_token_embeddings(V + K, mean_resizing=False)
    config = peft.LoraConfig(target_modules=["q_proj"], r=2, modules_to_save=["lm_head", "embed_tokens"])
    model = peft.get_peft_model(resized, config, adapter_name="add")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.3)
                if "lm_head" in name:
                    p[V:] *= 1.5
    model.save_pretrained(root / "ad")
    weights = root / "ad" / "add" / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if "q_proj" not in k}, str(weights))
    spec, _ = G.prepare(root / "base", GEN_PROMPTS, tp=1, max_new_tokens=NEW)
    prompts = [torch.tensor([list(p)]) for p in spec.prompt_ids]
    plain = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
    grown = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    grown.resize_token_embeddings(V + K, mean_resizing=False)
    peft_model = peft.PeftModel.from_pretrained(grown, root / "ad" / "add").eval()

    def greedy(m: Any, ids: torch.Tensor) -> list[int]:
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             pad_token_id=0)[0, ids.shape[1]:].tolist()
        return out[: next((i + 1 for i, t in enumerate(out) if t == 2), len(out))]

    reference = [greedy(peft_model, prompts[0]), greedy(plain, prompts[1])]
    assert any(t >= V for t in reference[0]) and any(t < V for t in reference[0])  # both vocabularies in play
    return {"model": root / "base", "folder": root / "ad" / "add", "reference": reference,
            "peft_second": greedy(peft_model, prompts[1])}


@pytest.mark.ranks
@pytest.mark.model
def test_generate_with_added_tokens_equals_peft(gen_run: dict[str, Any]) -> None:
    """Greedy tokens of a batch mixing the adapter (prompt 0) and none (prompt 1) at tp 1, 3 and 4 (uneven)."""
    from trtvocab.pipeline import generate as G

    for tp in (1, 3, 4):
        spec, loaded = G.prepare(gen_run["model"], GEN_PROMPTS, tp=tp, max_new_tokens=NEW,
                                 loras={"add": gen_run["folder"]}, lora_for={0: "add"})
        report = G.generate(spec, loaded)
        assert [r.token_ids for r in report.results] == gen_run["reference"], tp
    # The adapter on both prompts: the second follows PEFT too.
    spec, loaded = G.prepare(gen_run["model"], GEN_PROMPTS, tp=1, max_new_tokens=NEW, loras={"add": gen_run["folder"]})
    assert G.generate(spec, loaded).results[1].token_ids == gen_run["peft_second"]


def test_compare_scores_an_adapter_that_adds_tokens_over_the_grown_vocabulary(tmp_path: Path,
                                                                              hf_checkpoint: Any) -> None:
    """``compare --lora`` with an adapter that adds tokens: the variant's logits cover ``V + A``, the baseline's
    added ids get probability 0, so KL(base || variant) is finite and equals a float64 recomputation; the logit
    error is over the shared ``V`` columns; KLD(Q || base) is infinite when the variant puts mass on an added
    id (it does: its added rows are large); the report renders."""
    from trtvocab.accuracy.compare import compare

    weight, copy_rows = torch.randn(V, H), torch.randn(V + 3, H)
    copy_rows[V:] *= 3.0
    base = hf_checkpoint({"lm_head.weight": weight, "model.embed_tokens.weight": torch.randn(V, H)},
                         {"model_type": "llama", "vocab_size": V, "hidden_size": H})
    folder = _adapter(tmp_path / "add", {EMB: torch.randn(V + 3, H), HEAD: copy_rows})
    hidden = torch.randn(6, H)
    nxt = torch.tensor([1, 2, 3, 4, 5, -1])
    report = compare(base, hidden=hidden, bootstrap=0, loras=[f"add={folder}"], dtype="float32", next_token_ids=nxt)
    m = report.variants[0].metrics
    lb = torch.log_softmax((hidden.double() @ weight.double().t()), -1)
    lv = torch.log_softmax((hidden.double() @ copy_rows.double().t()), -1)
    kl = (lb.exp() * (lb - lv[:, :V])).sum(-1)  # the added ids: p_base = 0, no term
    torch.testing.assert_close(torch.as_tensor(m.kl_per_row).double(), kl, rtol=1e-4, atol=1e-6)
    err = (hidden.double() @ copy_rows[:V].double().t() - hidden.double() @ weight.double().t()).abs().max()
    assert abs(m.max_abs_logit_err - float(err)) < 1e-4
    assert m.tokens is not None and np.isinf(m.tokens.kl_rev).all()
    assert "adds 3 tokens" in report.variants[0].note
    assert "lora:add" in report.to_markdown()
    json.dumps(report.as_dict())


@pytest.mark.parametrize("layout", ["uneven", "padded"])
def test_plan_footprint_counts_the_added_rows_each_rank_holds(tmp_path: Path, layout: str) -> None:
    """The ledger's per-rank adapter bytes (header only) equal what each rank's two ends hold after loading."""
    from trtvocab import Mapping
    from trtvocab.weights.lora import footprint, open_adapter

    folder = _adapter(tmp_path / "add", {EMB: torch.randn(V + 5, H), HEAD: torch.randn(V + 5, H)})
    for rank in range(2):
        mapping = Mapping(world_size=2, rank=rank, tp_size=2)
        kw: dict[str, Any] = {"dtype": torch.float32, "mapping": mapping, "vocab_layout": layout, "pad_to": 4}
        emb, head = VocabParallelEmbedding(V, H, **kw), LMHead(V, H, **kw)
        emb.load_weights({"weight": torch.randn(V, H)})
        head.load_weights({"weight": torch.randn(V, H)})
        emb.load_adapter(folder)
        head.load_adapter(folder)
        held = emb.adapter_bytes() + head.adapter_bytes()
        assert footprint(open_adapter(folder), head.shard, H, 4, pad_to=4) == held, (layout, rank)


@pytest.mark.ranks
@pytest.mark.model
def test_generate_with_added_tokens_and_penalties_is_tp_invariant(gen_run: dict[str, Any]) -> None:
    """Penalties read a token-order state (docs/architecture.md, "Adapters that add tokens"): the same tokens
    at tp 1 and 3, and the penalty changes the adapter's repetitive greedy run."""
    from trtvocab.pipeline import generate as G

    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    runs = []
    for tp in (1, 3):
        spec, loaded = G.prepare(gen_run["model"], GEN_PROMPTS, tp=tp, max_new_tokens=NEW, params=params,
                                 loras={"add": gen_run["folder"]}, lora_for={0: "add"})
        runs.append([r.token_ids for r in G.generate(spec, loaded).results])
    assert runs[0] == runs[1]
    assert runs[0][0] != gen_run["reference"][0]


@pytest.mark.ranks
def test_ranks_that_disagree_raise_everywhere(tmp_path: Path, launch_ranks: Any) -> None:
    folder = _adapter(tmp_path / "add", {EMB: torch.randn(V + 3, H), HEAD: torch.randn(V + 3, H)})
    assert launch_ranks(disagreeing_params, 2, str(folder), timeout_s=120) == [
        "RankMismatchError PeerRankError", "RankMismatchError InputError"]


def test_family_ops_apply_to_the_added_columns(tmp_path: Path) -> None:
    """Gemma-style soft-capping and a scale follow the added rows' GEMM as they follow the base copy's
    (float64 reference); the -inf of a row without the adapter stays -inf (never ``-c``)."""
    copy_rows = torch.randn(V + 3, H) * 3
    folder = _adapter(tmp_path / "add", {EMB: torch.randn(V + 3, H), HEAD: copy_rows})
    head = LMHead(V, H, dtype=torch.float32, head_ops=HeadOps(scale=0.5, softcap=4.0))
    head.load_weights({"weight": torch.randn(V, H)})
    head.load_adapter(folder)
    hidden = torch.randn(4, H)
    logits = head(hidden, torch.tensor([0, -1, 0, -1]))
    z = hidden.double() @ copy_rows.double().t() * 0.5
    torch.testing.assert_close(logits[0::2], (4.0 * torch.tanh(z / 4.0))[0::2].float(), rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[1::2, V:]).all() and torch.isfinite(logits[1::2, :V]).all()


# ---- every sampler knob on the shards, against the gathered token-order reference ------------------------
def _knob_adapter(folder: Path) -> str:
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(KNOB_V + 5, KNOB_H, generator=gen)
    rows[KNOB_V:] *= 2.0  # the added ids win some draws
    return str(_adapter(folder, {EMB: torch.randn(KNOB_V + 5, KNOB_H, generator=gen), HEAD: rows}))


def _same_output(got: Any, ref: Any, what: str) -> None:
    assert torch.equal(got.token_ids, ref.token_ids), what
    assert (got.logprobs is None) == (ref.logprobs is None), what
    if ref.logprobs is not None:
        for field in ("ids", "values", "ranks"):
            assert torch.equal(getattr(got.logprobs, field), getattr(ref.logprobs, field)), f"{what} {field}"


def _check_knobs(out: dict[str, Any], what: str) -> None:
    for name, (got, ref, streamed) in out.items():
        _same_output(got, ref, f"{what} {name}")
        _same_output(streamed, ref, f"{what} {name} streamed")
        assert (got.token_ids[[1, 4]] < KNOB_V).all(), f"{what} {name}"  # rows without the adapter: base ids only
    assert any(bool((got.token_ids >= KNOB_V).any()) for got, _, _ in out.values()), what  # added ids are drawn


@pytest.mark.parametrize("layout", ["uneven", "padded"])
def test_every_knob_on_the_shards_equals_the_token_order_reference_tp1(tmp_path: Path, layout: str) -> None:
    """Filters, penalties, bias, bans, allowed ids, bitmask, vocab limit and logprobs on a head with an added
    segment: the sharded draw (no column gather) equals the gathered token-order draw, ids and logprobs."""
    _check_knobs(knobs_case(0, 1, layout, _knob_adapter(tmp_path / "add")), f"tp1 {layout}")


@pytest.mark.ranks
def test_every_knob_on_the_shards_tp3_uneven_tp4_padded(tmp_path: Path, launch_ranks: Any) -> None:
    """As at tp 1, on every rank of tp 3 (uneven) and tp 4 (padded: the last rank's added piece is padding);
    and the draws (ids, logprobs) are those of tp 1."""
    folder = _knob_adapter(tmp_path / "add")
    single = knobs_case(0, 1, "uneven", folder)
    for tp, layout in ((3, "uneven"), (4, "padded")):
        for rank, out in enumerate(launch_ranks(knobs_case, tp, layout, folder, timeout_s=240)):
            _check_knobs(out, f"tp{tp} {layout} rank {rank}")
            for name, (got, _, _) in out.items():  # seeded draws: the same ids at every tp
                mine = single[name][0]
                assert torch.equal(got.token_ids, mine.token_ids), f"tp{tp} {layout} rank {rank} {name} vs tp1"
                if mine.logprobs is not None:  # the head's float32 logits of a shard may differ by an ulp from tp 1's
                    assert torch.equal(got.logprobs.ids, mine.logprobs.ids), f"tp{tp} rank {rank} {name}"
                    torch.testing.assert_close(got.logprobs.values, mine.logprobs.values, rtol=0, atol=1e-5)


def test_streamed_added_head_over_several_chunks_equals_the_token_order_reference(tmp_path: Path) -> None:
    """A base vocabulary of several GEMM tiles plus an added segment: every streamed function equals the same
    function of the gathered token-order logits (greedy, top-k, logsumexp, logprobs, prompt logprobs, decode),
    and decode streams above the head's logits budget with the same ids and logprobs."""
    from trtvocab.sampling import logsumexp, prompt_logprobs, topk
    from trtvocab.sampling.added_vocab import gathered_output, token_order_view

    v, a = 300, 7
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(v + a, H, generator=gen)
    rows[v:] *= 3.0
    folder = _adapter(tmp_path / "big", {EMB: torch.randn(v + a, H, generator=gen), HEAD: rows})
    head = LMHead(v, H, dtype=torch.float32)
    head.load_weights({"weight": torch.randn(v, H, generator=gen)})
    head.load_adapter(folder)
    hidden = torch.randn(4, H, generator=gen)
    view = token_order_view(head)
    with head.use_adapters(torch.tensor([0, -1, 0, -1])):
        full = head(hidden).float()  # [B, V + A] in token order: the reference's logits
        assert torch.equal(chunked.stream_greedy(hidden, head, chunk=128), full.argmax(-1))
        values, ids = chunked.stream_topk(hidden, head, 9, chunk=128)
        ref_values, ref_ids = topk(full, view, 9)
        assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)
        assert torch.equal(chunked.stream_logsumexp(hidden, head, chunk=128), logsumexp(full, view))
        picks = torch.tensor([[v + 1, 3], [5, 6], [v + 6, 299], [0, 1]])
        from trtvocab.sampling import logprobs
        assert torch.equal(chunked.stream_logprobs(hidden, head, picks, chunk=128), logprobs(full, view, picks))
        nxt = torch.tensor([v, 2, v + 3, 4])
        got, ref = chunked.stream_prompt_logprobs(hidden, head, nxt, 3, chunk=128), prompt_logprobs(full, view, nxt, 3)
        assert all(torch.equal(getattr(got, f), getattr(ref, f)) for f in ("ids", "values", "ranks"))
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1, logprobs=2),
                  SamplingParams(temperature=0.8, min_p=0.1, seed=2, logprobs=2),
                  SamplingParams(temperature=1.4, top_k=20, seed=3, logprobs=2),
                  SamplingParams(temperature=0.0, logprobs=2)]
        ref_out = gathered_output(hidden, head, params, step=1, vocab_limit=250)
        head.logits_budget_bytes = 4 * 200  # decode streams: [4, 307] float32 is over the budget
        from trtvocab.sampling import decode_output
        from trtvocab.sampling.step import streams

        assert streams(head, 4)
        out = decode_output(hidden, head, params, step=1, vocab_limit=250)
        assert torch.equal(out.token_ids, ref_out.token_ids)
        assert all(torch.equal(getattr(out.logprobs, f), getattr(ref_out.logprobs, f)) for f in ("ids", "values",
                                                                                                 "ranks"))
        assert (out.token_ids[[1, 3]] < 250).all()
