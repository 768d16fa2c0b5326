"""Gemma 3 270M, the second real model: a tied 262144 x 640 head and a scaled embedding (``sqrt(640)``
rounded to the table's dtype, inside transformers' ``Gemma3TextScaledWordEmbedding``).

References are transformers' own: ``from_pretrained(dir, gguf_file=...)`` on the same GGUF, its
``get_input_embeddings()``, its logits and its greedy ``generate``. One model load for the module
(``trtvocab.pipeline.generate.load_model`` caches it; tp > 1 ranks get it in shared memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.base.family import EmbeddingOps

G = pytest.importorskip("trtvocab.pipeline.generate")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]
PROMPT = "The capital of France is"
K = 8


@pytest.fixture(scope="module")
def loaded(gemma3: Path):
    return G.load_model(gemma3)


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    """transformers' greedy tokens, its embedding rows, and the logits of the prompt's last rows."""
    tok, model = loaded.tokenizer, loaded.model
    enc = tok([PROMPT], return_tensors="pt")
    captured: dict[str, torch.Tensor] = {}
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: captured.update(x=args[0].detach()))
    with torch.no_grad():
        logits = model(**enc).logits[0]
        hook.remove()
        out = model.generate(**enc, do_sample=False, max_new_tokens=K)
        rows = model.get_input_embeddings()(enc["input_ids"][0])
    return {"ids": enc["input_ids"][0], "tokens": out[0, enc["input_ids"].shape[1]:].tolist(), "rows": rows,
            "hidden": captured["x"][0], "logits": logits}


def test_the_family_is_read_from_the_gguf(gemma3: Path) -> None:
    head = LMHead.from_checkpoint(gemma3, dtype=torch.float32, mapping=None)
    assert (head.vocab_size, head.hidden_size) == (262144, 640)
    assert head.head_ops.is_identity  # Gemma 3 270M sets no final_logit_softcapping
    emb = VocabParallelEmbedding.from_head(head)
    assert emb.embedding_ops == EmbeddingOps(scale=math.sqrt(640))


def test_embedding_rows_equal_transformers_scaled_rows(gemma3: Path, reference: dict) -> None:
    """transformers' Gemma3TextScaledWordEmbedding: the Q8_0 rows times sqrt(640) in float32, bitwise."""
    emb = VocabParallelEmbedding.from_checkpoint(gemma3, dtype=torch.float32)
    rows = emb(reference["ids"])
    assert torch.equal(rows, reference["rows"])
    plain = VocabParallelEmbedding.from_checkpoint(gemma3, dtype=torch.float32)
    plain.embedding_ops = EmbeddingOps()
    assert float((plain(reference["ids"]) * math.sqrt(640) - rows).abs().max()) < 1e-3  # the scale is the change


def test_head_logits_equal_transformers(gemma3: Path, reference: dict) -> None:
    head = LMHead.from_checkpoint(gemma3, dtype=torch.float32)
    got = torch.log_softmax(head(reference["hidden"]).double(), -1)
    want = torch.log_softmax(reference["logits"].double(), -1)
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.ranks  # generate at tp 3 launches its ranks
def test_generate_equals_transformers_greedy(gemma3: Path, loaded, reference: dict) -> None:
    """trtvocab generate's greedy tokens = transformers' at tp 1, tp 3 (uneven: 3 x 87381 + 1), tp 3 with
    attention DP."""
    for tp, adp in ((1, False), (3, False), (3, True)):
        spec, _ = G.prepare(gemma3, [PROMPT], tp=tp, max_new_tokens=K, attention_dp=adp)
        run = G.generate(spec, loaded)
        assert run.results[0].token_ids == reference["tokens"], (tp, adp, run.results[0].text)
    assert loaded.tokenizer.decode(reference["tokens"]).startswith(" the capital of")


@pytest.mark.ranks
def test_generate_with_an_onnx_artifact_equals_transformers(gemma3: Path, loaded, reference: dict,
                                                           tmp_path: Path) -> None:
    """The head from a built tp 3 artifact (ONNX on onnxruntime; the embedding graph with its sqrt(640)
    checked against the module), inside the loop: transformers' greedy tokens."""
    pytest.importorskip("onnxruntime")
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    recipe = parse_recipe({"checkpoint": {"model": "gemma3"}, "mapping": {"tp_size": 3},
                           "lm_head": {"dtype": "float32", "gather_output": False},
                           "embedding": {"export": True},
                           # standard TensorRT: where it is missing the engine is skipped (RTX engines of this
                           # 262144-wide head are built by `trtvocab build builders/gemma3.toml`)
                           "engine": {"compiler": "tensorrt"}, "output": {"dir": str(tmp_path / "art")}})
    out, manifest = build(recipe, tmp_path / "art")
    assert manifest.head.family.embedding == EmbeddingOps(scale=math.sqrt(640))
    assert all(e.embedding_verify is not None and e.embedding_verify.ok for e in manifest.ranks)
    spec, _ = G.prepare(gemma3, [PROMPT], tp=3, max_new_tokens=K, backend="onnx", artifact=out)
    run = G.generate(spec, loaded)
    assert run.results[0].token_ids == reference["tokens"]
