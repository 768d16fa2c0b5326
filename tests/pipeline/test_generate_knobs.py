"""``trtvocab generate``'s serving knobs on SmolLM2-135M-Instruct (its flags and ``--json`` logprobs).

* ``--repetition-penalty``, ``--logit-bias``, ``--bad-words`` and ``--min-tokens`` at tp 1 give
  transformers' own greedy ``generate`` with its processors (``RepetitionPenaltyLogitsProcessor``,
  ``SequenceBiasLogitsProcessor``, ``NoBadWordsLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``),
  token for token; ``--logprobs 3`` returns docs/generate.md's shape, its values a float64 log-softmax of
  transformers' raw logits.
* The same knobs, seeded typical-p, stop ids and stop strings give the same tokens and logprobs at tp 2 and 3.
* Bad flag values are one ``error:`` line naming the flag.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from trtvocab.commands.cli import app
from trtvocab.errors import InputError
from trtvocab.sampling import SamplingParams

G = pytest.importorskip("trtvocab.pipeline.generate")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="trtvocab generate needs transformers")
A = "The capital of France is"
K = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(smollm2: Path):
    pytest.importorskip("accelerate")
    return G.load_model(smollm2)


def cli(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


@pytest.mark.model
def test_cli_knobs_equal_transformers_generate_and_return_logprobs(loaded, smollm2: Path) -> None:
    tlp = pytest.importorskip("transformers.generation.logits_process")
    tok, model = loaded.tokenizer, loaded.model
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    bad = G.words_token_ids(tok, ["the"])
    res = cli(str(smollm2), "--prompt", A, "--max-new-tokens", str(K), "--repetition-penalty", "1.3",
              "--logit-bias", f"{paris}=-100", "--logit-bias", "11=0.5", "--bad-words", "the", "--min-tokens", str(K),
              "--logprobs", "3", "--json")
    assert res.exit_code == 0, res.output
    (out,) = json.loads(res.stdout)["results"]
    enc = tok([A], return_tensors="pt")
    eos = model.generation_config.eos_token_id
    processors = [tlp.MinNewTokensLengthLogitsProcessor(enc["input_ids"].shape[1], K, eos),
                  tlp.NoBadWordsLogitsProcessor(bad, eos_token_id=None),
                  tlp.SequenceBiasLogitsProcessor({(paris,): -100.0, (11,): 0.5}),
                  tlp.RepetitionPenaltyLogitsProcessor(1.3)]
    with torch.no_grad():
        ref = model.generate(**enc, do_sample=False, max_new_tokens=K, logits_processor=processors,
                             output_logits=True, return_dict_in_generate=True)
    want = ref.sequences[0, enc["input_ids"].shape[1]:].tolist()
    assert out["token_ids"] == want and paris not in want
    assert len(out["logprobs"]) == len(want)
    for step, (entries, sampled) in enumerate(zip(out["logprobs"], want, strict=True)):
        assert set(entries[0]) == {"id", "token", "logprob", "rank"}
        assert [e["rank"] for e in entries[:3]] == [1, 2, 3]
        assert entries[-1]["id"] == sampled or sampled in [e["id"] for e in entries[:3]]
        lsm = torch.log_softmax(ref.logits[step][0].double(), 0)
        for e in entries:
            assert abs(e["logprob"] - float(lsm[e["id"]])) < 1e-4
            assert e["token"] == tok.decode([e["id"]])
        assert [e["id"] for e in entries[:3]] == torch.topk(lsm, 3).indices.tolist()


@pytest.mark.model
@pytest.mark.ranks
def test_knobs_give_the_same_tokens_and_logprobs_at_tp_2_and_3(loaded, smollm2: Path) -> None:
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5, logprobs=2,
                             prompt_logprobs=2),
              SamplingParams(temperature=0.9, typical_p=0.7, frequency_penalty=0.6, seed=3, logprobs=1,
                             logprobs_mode="processed_logprobs", stop_token_ids=[13], n=2)]
    runs = {}
    for tp in (1, 2, 3):
        spec, _ = G.prepare(smollm2, [A, "def add(a, b):"], tp=tp, max_new_tokens=K, params=params,
                            deterministic=True, stop=["\n\n"])
        runs[tp] = G.generate(spec, loaded).as_json(loaded.tokenizer)
    assert runs[1] == runs[2] == runs[3]
    results = runs[1]["results"]
    assert "prompt_logprobs" in results[0] and "prompt_logprobs" not in results[1]
    assert [r.get("index") for r in results] == [0, 0, 1]  # n = 2 for the second prompt: two completions
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in runs[1]["results"])


@pytest.mark.model
def test_cli_prompt_logprobs_equal_a_float64_log_softmax(loaded, smollm2: Path) -> None:
    tok, model = loaded.tokenizer, loaded.model
    res = cli(str(smollm2), "--prompt", A, "--max-new-tokens", "1", "--prompt-logprobs", "2", "--json")
    assert res.exit_code == 0, res.output
    (out,) = json.loads(res.stdout)["results"]
    ids = tok([A], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lsm = torch.log_softmax(model(ids).logits[0].double(), -1)
    plp = out["prompt_logprobs"]
    assert len(plp) == ids.shape[1] and plp[0] is None and "logprobs" not in out
    for t in range(1, ids.shape[1]):
        entries, token = plp[t], int(ids[0, t])
        assert [e["id"] for e in entries[:2]] == torch.topk(lsm[t - 1], 2).indices.tolist()
        assert token in [e["id"] for e in entries]
        for e in entries:
            assert abs(e["logprob"] - float(lsm[t - 1, e["id"]])) < 1e-4


@pytest.mark.model
def test_prompt_logprobs_past_the_vocabulary_are_the_whole_vocabulary(smollm2: Path) -> None:
    """``--prompt-logprobs 1000000`` (hostile round 4): the top-N clamps to the vocabulary, as ``--logprobs``
    does, instead of failing after the model load in the streamed sampler."""
    res = cli(str(smollm2), "--prompt", "Hello world", "--max-new-tokens", "1", "--prompt-logprobs", "1000000",
              "--json")
    assert res.exit_code == 0, res.output
    (out,) = json.loads(res.stdout)["results"]
    later = out["prompt_logprobs"][1:]
    assert later and all(len({e["id"] for e in entries}) == 49152 for entries in later)


@pytest.mark.model
def test_n_completions_each_their_own_seed_stream(smollm2: Path) -> None:
    args = [str(smollm2), "--prompt", A, "--max-new-tokens", "6", "--temperature", "1.2", "--seed", "5", "--json"]
    one = json.loads(cli(*args).stdout)["results"]
    res = cli(*args, "--n", "3")
    assert res.exit_code == 0, res.output
    many = json.loads(res.stdout)["results"]
    assert [r["index"] for r in many] == [0, 1, 2] and "index" not in one[0]
    assert many[0]["token_ids"] == one[0]["token_ids"]  # completion 0 keeps the request's own seed
    assert len({tuple(r["token_ids"]) for r in many}) > 1
    p = SamplingParams(seed=5, n=3)
    assert p.sample_seed(0) == 5 and len({p.sample_seed(i) for i in range(3)}) == 3
    assert SamplingParams(n=2).sample_seed(1) is None


def test_flag_parsing_and_stop_strings() -> None:
    assert G.parse_logit_bias(["5=1.5", "7=-100"]) == {5: 1.5, 7: -100.0}
    with pytest.raises(InputError, match="`logit_bias`"):
        G.parse_logit_bias(["5:1"])
    with pytest.raises(InputError, match="`typical_p`"):
        G.sampling_params(typical_p=0.0)
    with pytest.raises(InputError, match="`presence_penalty`"):
        G.sampling_params(presence_penalty=3.0)
    assert G.cut_at_stop("a, b. c", ("b", ".")) == ("a, ", True)
    assert G.cut_at_stop("abc", ("x",)) == ("abc", False)
    fake = SimpleNamespace(encode=lambda text, add_special_tokens: {"bad": [1, 2], " bad": [3, 2]}[text])
    assert G.words_token_ids(fake, ["bad"]) == [[1, 2], [3, 2]]


@pytest.mark.model
@pytest.mark.parametrize(("args", "named"), [
    (["--logit-bias", "x"], "--logit-bias"), (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--min-tokens", "-1"], "--min-tokens"), (["--logprobs-mode", "raw"], "--logprobs-mode"), (["--n", "0"], "--n"),
    (["--beam-width", "0"], "--beam-width"), (["--beam-width", "4", "--temperature", "0.5"], "--beam-width"),
])
def test_bad_flag_values_are_one_error_line_naming_the_flag(args: list[str], named: str, smollm2: Path) -> None:
    res = cli(str(smollm2), "--prompt", A, *args)
    assert res.exit_code == 2, res.output
    assert named in res.output and "Traceback" not in res.output


@pytest.mark.model
@pytest.mark.ranks
def test_knobs_with_a_bitmask_through_an_artifact_under_attention_dp(smollm2: Path, tmp_path: Path) -> None:
    """Penalties, bad words, min tokens and logprobs with a regex's bitmask, on a tp 3 artifact's
    PyTorch fallback under attention DP: the tokens of the plain tp 1 run, logprobs within 5e-5."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build
    from trtvocab.sampling.grammar import grammar_spec

    out = tmp_path / "smollm2-tp3"
    build(parse_recipe({"checkpoint": {"path": str(smollm2)}, "mapping": {"tp_size": 3},
                        "lm_head": {"dtype": "float32", "gather_output": False}, "output": {"onnx": False}},
                       "tp3.toml"), out)
    prompts = [A, "Water boils at", "Count: one, two,"]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
              SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=4, logprobs=1,
                             logit_bias={13: -5.0}),
              SamplingParams(temperature=0.7, seed=2, presence_penalty=1.0, logprobs=0)]
    grammars = [None, None, grammar_spec(regex="( [a-z]+,){1,4}")]
    options = {"max_new_tokens": 6, "params": params, "grammars": grammars, "bad_words": ["the"]}
    want = G.run(smollm2, prompts, **options)
    got = G.run(smollm2, prompts, artifact=out, backend="torch", attention_dp=True, body_ranks=2, **options)
    assert got.tp == 3 and got.attention_dp
    for g, w in zip(got.results, want.results, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs is not None and w.logprobs is not None
        for gs, ws in zip(g.logprobs, w.logprobs, strict=True):
            assert [e[0] for e in gs] == [e[0] for e in ws] and [e[2] for e in gs] == [e[2] for e in ws]
            # Two heads with other chains (tp 1: the GGUF Q8_0 blocks; the artifact: float32 dense shards): 1.05e-5
            # apart on an Intel AVX-512 VM (below 1e-5 on Zen 4), so a bound with room for the CPU's paths.
            assert max(abs(a[1] - b[1]) for a, b in zip(gs, ws, strict=True)) < 5e-5


@pytest.mark.model
@pytest.mark.ranks
def test_beam_search_equals_transformers_num_beams_4_at_tp_1_and_3(loaded, smollm2: Path) -> None:
    """``--beam-width 4``: the best finished beam of each prompt equals transformers' ``generate(num_beams=4,
    do_sample=False)`` (its ``_beam_search``: finished hypotheses, length penalty 1, the early-stop
    heuristic), at tp 1 and tp 3 (the candidates merged across the shards), one prompt ending on eos."""
    tok, model = loaded.tokenizer, loaded.model
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                                   tokenize=False, add_generation_prompt=True)
    prompts, k = [A, "def add(a, b):", chat], 16
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, num_beams=4, max_new_tokens=k)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    want = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        want.append(row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    assert want[2][-1] in eos  # the chat answer finished before max_new_tokens
    for tp in (1, 3):
        spec, _ = G.prepare(smollm2, prompts, tp=tp, max_new_tokens=k,
                            params=SamplingParams(temperature=0.0, beam_width=4))
        assert [r.token_ids for r in G.generate(spec, loaded).results] == want, tp
