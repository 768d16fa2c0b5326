"""The decode loop: ``ids -> embedding -> body -> last rows -> head -> sampler -> ids``, every step.

The transformer body (attention, MLPs, the final norm) runs in ``transformers`` with its KV
cache, whole and unsplit, on every rank. The vocabulary dimension runs in trtvocab on the
``tp`` ranks, and that is where the ranks meet::

    input ids [B, S]  -> VocabParallelEmbedding       masked lookup of own rows, all-reduce (SUM)
    inputs_embeds     -> model.model(...)             the body, KV cache, on every rank (no collective)
    last rows [B, H]  -> LogitsProcessor + LMHead     this rank's columns, float32 [B, V_local]
                         (or an artifact's backend: open_backend(...).rank_logits)
    (xgrammar)        -> apply_token_bitmask          each rank masks its own columns
    next ids [B]      -> sample                       Gumbel race: [tp, B] (score, id) pairs cross

so per step exactly two things cross ranks: the embedding rows of the new ids and each rank's
best ``(score, id)`` per row; the ``[B, V]`` logits are never gathered. Every rank ends up with
the same ids, feeds them to its own body, and the next step starts.

Batching (as ``transformers.generate`` does it, so that greedy output is token-identical):
prompts are left-padded; prefill positions are ``cumsum(mask) - 1`` (0 on padding) and the
mask is dropped when nothing is padded; each decode step extends the mask by one and the
positions by one. The head sees the packed non-padding rows of the prefill with their
``seq_lens`` (the LogitsProcessor takes each sequence's last row), then one row per
unfinished prompt. A prompt stops at an end-of-sequence id (the model's generation config,
else the tokenizer's; the id is kept in ``token_ids``) or after ``max_new_tokens``; a finished
prompt stays in the body's batch (fed padding, as ``generate`` does) but produces no more tokens.

Structured output: one ``xgrammar.GrammarMatcher`` per constrained prompt on every rank,
compiled against the tokenizer with the model's config vocab (the CLI constrains every prompt;
the Python API takes one grammar per prompt, or none); each step fills the bitmask of the
unfinished rows (all ones for an unconstrained row) and every rank applies it to its own
columns. JSON schemas compile with ``any_whitespace=False`` (:data:`JSON_ANY_WHITESPACE`):
compact JSON, no runaway whitespace.

``tp == 1`` runs in this process (a replicated head); ``tp > 1`` starts ``tp`` gloo ranks with
:func:`trtvocab.launch.run_ranks`, which receive the loaded body in shared memory (it is not
loaded again); each rank reads only its own rows of the vocabulary matrix (``load_tied``).
Everything that can be refused is refused before any rank starts (:func:`prepare`): typed
errors naming the argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from trtvocab import distributed as D
from trtvocab.errors import ArtifactError, CheckpointError, ConfigError, DistributedError, GrammarError, InputError
from trtvocab.mapping import Mapping
from trtvocab.sampling import SamplingParams
from trtvocab.sharding import calc_shard

JSON_ANY_WHITESPACE = False  # xgrammar JSON: compact separators, no free whitespace
RAN_ON = ("torch", "onnxruntime", "onnx.reference", "tensorrt")
# What the ranks agree on once their setup is done, and after every artifact-backend step
# (protocol: trtvocab.distributed.Handshake): a rank whose setup or backend failed stops the others.
SETUP_HANDSHAKE = D.Handshake("generate", (D.Field("vocab_size"), D.Field("hidden_size"), D.Field("prompts")))
STEP_HANDSHAKE = D.Handshake("generate.head", (D.Field("rows"), D.Field("ran_on", RAN_ON, per_rank=True)))
_PARAM_OPTIONS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "seed": "--seed"}


# ---- what a run is ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A constraint for xgrammar: ``kind`` ``"json_schema"`` (``source`` is the schema text) or
    ``"regex"`` (``source`` is the pattern); ``label`` is what reports call it."""

    kind: Literal["json_schema", "regex"]
    source: str
    label: str


@dataclasses.dataclass(frozen=True)
class ArtifactSpec:
    """A built head artifact the loop runs instead of the model's own head."""

    root: str
    backend: str  # canonical, chosen (torch | onnx | tensorrt)
    tp: int
    note: str | None = None  # why auto did not take the artifact's TensorRT engines


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """One validated run (picklable: it travels to the ranks)."""

    model: str
    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    tp: int
    max_new_tokens: int
    params: tuple[SamplingParams, ...]  # one per prompt
    grammars: tuple[GrammarSpec | None, ...] = ()  # one per prompt (empty: none)
    artifact: ArtifactSpec | None = None
    deterministic: bool = False
    # Attention DP (tp > 1): rank r runs the body for its own block of prompts only; the last
    # hidden rows are gathered and the vocabulary stays split (TensorRT-LLM's
    # enable_lm_head_tp_in_adp). Off: every rank runs the whole body on every prompt.
    attention_dp: bool = False


@dataclasses.dataclass
class GenerateResult:
    """One prompt's answer: the generated ids only (an end-of-sequence id included) and their text."""

    prompt: str
    token_ids: list[int]
    text: str


@dataclasses.dataclass
class GenerateReport:
    """What :func:`generate` returns."""

    results: list[GenerateResult]
    tp: int
    head: str  # what computed the logits: "torch" (the model's head) or the artifact's runtime(s)
    new_tokens: int
    prefill_s: float
    decode_s: float
    deterministic: bool  # whether the head really ran in deterministic mode
    grammar: str | None = None
    attention_dp: bool = False  # tp > 1: the body ran data-parallel (else every rank ran all of it)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """``{"results": [{"prompt", "token_ids", "text"}, ...]}``: what ``generate --json`` prints."""
        return {"results": [{"prompt": r.prompt, "token_ids": r.token_ids, "text": r.text} for r in self.results]}


@dataclasses.dataclass
class _RankOutput:
    token_ids: list[list[int]]
    ran_on: list[str]
    prefill_s: float
    decode_s: float
    deterministic: bool


# ---- loading the model -----------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedModel:
    """A causal LM from ``transformers`` (float32, eval mode) and its tokenizer."""

    path: str
    model: Any
    tokenizer: Any

    @property
    def config(self) -> Any:
        return self.model.config


def model_path(model: str | Path) -> Path:
    """MODEL as given: an HF causal-LM directory or a ``.gguf`` file; :class:`InputError` otherwise."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"MODEL {path}: a folder without config.json (expected an HF causal-LM directory)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.exists():
        raise InputError(f"MODEL {path}: expected an HF causal-LM directory or a .gguf file")
    raise InputError(f"MODEL {path}: no such file or directory")


def _quiet_transformers() -> Any:
    """``transformers``, offline and quiet (:func:`trtvocab.hf_loader.quiet_transformers`)."""
    from trtvocab.hf_loader import quiet_transformers

    return quiet_transformers()


def _cache_key(path: Path) -> tuple[str, int, int]:
    st = path.stat() if path.is_file() else (path / "config.json").stat()
    return str(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _load_cached(key: tuple[str, int, int]) -> LoadedModel:
    """The model at ``key[0]`` through :func:`trtvocab.hf_loader.load_causal_lm` (the loader ``hidden``
    uses: offline, safetensors or GGUF only, never a pickle; a model that is not a causal LM is refused
    by name), float32, in eval mode, with the decoder stack ``model.model`` the loop drives."""
    from trtvocab.hf_loader import load_causal_lm

    path = Path(key[0])
    tokenizer, model = load_causal_lm(path, dtype=torch.float32, label="MODEL")
    if not hasattr(model, "model"):
        raise CheckpointError(f"MODEL {path}: loads as {type(model).__name__}, which has no decoder stack "
                              "`.model` (expected a Llama-style *ForCausalLM: embed_tokens, layers, norm)")
    model.eval()
    return LoadedModel(str(path), model, tokenizer)


def load_model(model: str | Path) -> LoadedModel:
    """The model and tokenizer at ``model`` (offline), loaded once per process and file version."""
    return _load_cached(_cache_key(model_path(model)))


# ---- validation ---------------------------------------------------------------------------------------
def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None) -> SamplingParams:
    """:class:`SamplingParams` from the CLI's options; an error names the option (``--top-p``)."""
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    except InputError as exc:
        text = str(exc)
        for field, option in _PARAM_OPTIONS.items():
            if text.startswith(f"SamplingParams.{field}:"):
                raise InputError(f"{option}:{text.split(':', 1)[1]}") from None
        raise


def _xgrammar() -> Any:
    try:
        return importlib.import_module("xgrammar")
    except ImportError as exc:  # pragma: no cover - the generate extra is missing
        raise ConfigError(f"--json-schema / --regex need xgrammar (pip install 'trtvocab[generate]'): {exc}") from None


# ---- grammar limits -----------------------------------------------------------------------------------
# xgrammar's compile time grows faster than the grammar: an enum of 20k strings takes ~30 s against
# SmolLM2's 49k-token vocabulary, one of 500k never ends. So a constraint is bounded before xgrammar
# sees it (size, nesting), and its conversion and compile run under a time limit.
MAX_SCHEMA_BYTES = 1 << 20  # --json-schema: at most 1 MiB of JSON text
MAX_REGEX_CHARS = 1 << 14  # --regex: at most 16384 characters
MAX_GRAMMAR_DEPTH = 128  # nesting: of the schema's JSON arrays / objects, of a regex's groups
GRAMMAR_TIMEOUT_S = 30.0  # conversion + compile against the tokenizer; TRTVOCAB_GRAMMAR_TIMEOUT_S overrides
GRAMMAR_TIMEOUT_ENV = "TRTVOCAB_GRAMMAR_TIMEOUT_S"
RANK_GRAMMAR_TIMEOUT_FACTOR = 4  # a rank's compile of a grammar prepare() compiled: more time, still bounded
# JSON Schema keywords that constrain but that xgrammar (0.2.x) ignores: the answer would not obey them.
UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                               "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                               "$dynamicRef", "$recursiveRef")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "not", "if", "then", "else", "contains", "propertyNames", "contentSchema")


def grammar_timeout() -> float:
    """Seconds xgrammar may take to convert and compile one constraint (:data:`GRAMMAR_TIMEOUT_S`, or
    ``$TRTVOCAB_GRAMMAR_TIMEOUT_S``: a finite number > 0)."""
    raw = os.environ.get(GRAMMAR_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return GRAMMAR_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{GRAMMAR_TIMEOUT_ENV}={raw[:40]!r}: expected a number of seconds > 0")
    return value


def _json_depth(text: str) -> int:
    """The deepest nesting of arrays / objects in JSON ``text`` (strings skipped), without recursion."""
    depth = deepest = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text, flags=re.DOTALL):
        token = m.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _regex_depth(pattern: str) -> int:
    """The deepest nesting of groups in ``pattern`` (escapes and character classes skipped)."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                i += 1  # "[]...]": a leading "]" is a member
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _schema_problem(schema: Any) -> str | None:
    """What makes a parsed schema unusable (an ignored keyword, a choice among nothing), or None.
    Walks only schema positions (a property *named* "not" is fine), without recursion."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in UNSUPPORTED_SCHEMA_KEYWORDS:
            if key in node:
                return (f"keyword {key!r} at {where or '/'}{key} is not supported by xgrammar (it would be ignored "
                        f"and the answer not held to it); remove it or express it without "
                        f"{', '.join(UNSUPPORTED_SCHEMA_KEYWORDS)}")
        if node.get("uniqueItems") is True:
            return f"uniqueItems: true at {where or '/'} is not supported by xgrammar (it would be ignored)"
        for key in ("anyOf", "oneOf", "enum", "type"):
            if node.get(key) == []:
                return f"{key}: [] at {where or '/'} matches nothing"
        for key in _SUBSCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend((f"{where}/{key}/{name}/", sub) for name, sub in value.items())
        for key in _SUBSCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend((f"{where}/{key}/{i}/", sub) for i, sub in enumerate(value))
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), dict):
                stack.append((f"{where}/{key}/", node[key]))
    return None


def _within(what: str, value: int, counted: str, limit: int, name: str) -> None:
    """GrammarError naming ``what``, the measured ``value`` (``counted`` says of what) and the limit."""
    if value > limit:
        unit = " levels" if "deep" in counted else ""
        raise GrammarError(f"{what}: {counted.format(value)}, more than the {limit}{unit} allowed ({name})")


def check_grammar(spec: GrammarSpec, what: str | None = None) -> None:
    """The checks that need no xgrammar: size, nesting, and for a JSON schema valid JSON without
    keywords xgrammar would ignore or choices among nothing (:class:`GrammarError`, naming the limit)."""
    what = what or ("--json-schema" if spec.kind == "json_schema" else f"--regex {spec.source[:60]!r}")
    if not isinstance(spec.source, str):
        raise GrammarError(f"{what}: expected the grammar as text, got {type(spec.source).__name__}")
    if spec.kind == "regex":
        if not spec.source:
            raise GrammarError("--regex: the pattern is empty")
        _within(what, len(spec.source), "{} characters", MAX_REGEX_CHARS, "MAX_REGEX_CHARS")
        _within(what, _regex_depth(spec.source), "groups nested {} deep", MAX_GRAMMAR_DEPTH, "MAX_GRAMMAR_DEPTH")
        return
    if spec.kind != "json_schema":
        raise GrammarError(f"{what}: unknown grammar kind {spec.kind!r} (expected json_schema or regex)")
    size = len(spec.source.encode("utf-8", errors="surrogatepass"))
    _within(what, size, "{} bytes of schema", MAX_SCHEMA_BYTES, "MAX_SCHEMA_BYTES")
    _within(what, _json_depth(spec.source), "nested {} deep", MAX_GRAMMAR_DEPTH, "MAX_GRAMMAR_DEPTH")
    try:
        schema = json.loads(spec.source)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(f"{what}: not valid JSON: {exc}"[:400]) from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{what}: a JSON schema is an object (or true / false), got {type(schema).__name__}")
    if schema is False:
        raise GrammarError(f"{what}: the schema false matches nothing")
    problem = _schema_problem(schema)
    if problem is not None:
        raise GrammarError(f"{what}: {problem}")


@contextlib.contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """Capture file descriptor 2 while xgrammar runs: its C++ code logs warnings there ("Escape sequence '\\x'
    is not recognized", "Lookahead ... is ignored", "allOf ... still ongoing") and goes on with a grammar
    other than the one asked for. Yields the list the captured ``Warning:`` lines land in; other output
    is passed through to stderr."""
    found: list[str] = []
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to capture: run uncaptured
        yield found
        return
    with tempfile.TemporaryFile() as tmp:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield found
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read(1 << 16).decode("utf-8", errors="replace")
            rest = []
            for line in text.splitlines():
                if "Warning:" in line:
                    found.append(line.split("Warning:", 1)[1].strip())
                elif line.strip():
                    rest.append(line)
            if rest:
                with contextlib.suppress(Exception):
                    print("\n".join(rest), file=sys.stderr)


def _bounded(what: str, fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` (xgrammar work, which releases the GIL) under ``timeout`` seconds, its warnings as errors.

    On a timeout the worker thread cannot be stopped: it is a daemon, left to finish (or to end with
    the process), and the caller gets a :class:`GrammarError` at once."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    with _native_stderr() as warned:
        worker = threading.Thread(target=work, name="trtvocab-grammar", daemon=True)
        worker.start()
        worker.join(timeout)
    if worker.is_alive():
        raise GrammarError(f"{what}: xgrammar did not compile it within {timeout:g} s (the limit; "
                           f"{GRAMMAR_TIMEOUT_ENV} sets it): give a smaller grammar (fewer enum values or "
                           "alternatives)")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, RuntimeError | ValueError | TypeError):
            raise GrammarError(f"{what}: xgrammar refuses it: {_first_line(exc)}") from None
        raise exc
    if warned:
        raise GrammarError(f"{what}: xgrammar would not apply it as written: {warned[0][:300]}"
                           + (f" (and {len(warned) - 1} more warning(s))" if len(warned) > 1 else ""))
    return box["value"]


def _convert(spec: GrammarSpec, what: str, timeout: float | None = None) -> Any:
    """``xgrammar.Grammar`` of ``spec`` (checked, bounded in time, warnings refused)."""
    check_grammar(spec, what)
    xgr = _xgrammar()
    if spec.kind == "json_schema":
        def fn() -> Any:
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=JSON_ANY_WHITESPACE)
    else:
        def fn() -> Any:
            return xgr.Grammar.from_regex(spec.source)
    return _bounded(what, fn, grammar_timeout() if timeout is None else timeout)


_COMPILERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any, Any]] = {}


def _compiler(tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> tuple[Any, Any]:
    """``(TokenizerInfo, GrammarCompiler)`` of a tokenizer, one per process (xgrammar's compile cache
    then makes the ranks' compile of a grammar :func:`prepare` compiled free at tp 1)."""
    key = (id(tokenizer), int(vocab_size), tuple(sorted(stop_ids)))
    if key not in _COMPILERS:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_ids) or None)
        compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(4, os.cpu_count() or 1)))
        if len(_COMPILERS) >= 4:
            _COMPILERS.pop(next(iter(_COMPILERS)))
        _COMPILERS[key] = (tokenizer, info, compiler)  # the tokenizer is kept: its id stays its own
    _, info, compiler = _COMPILERS[key]
    return info, compiler


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int, stop_ids: set[int], *,
                    timeout: float | None = None, what: str | None = None) -> Any:
    """``spec`` compiled by xgrammar against the tokenizer, refused (:class:`GrammarError`) when it is
    too large or too deep (:func:`check_grammar`), uses what xgrammar would ignore or reinterpret (its
    warnings), takes longer than :func:`grammar_timeout`, or lets the model say nothing: no first token
    allowed, or only a stop token (the grammar matches nothing, or only the empty answer)."""
    what = what or ("--json-schema" if spec.kind == "json_schema" else f"--regex {spec.source[:60]!r}")
    limit = grammar_timeout() if timeout is None else timeout
    check_grammar(spec, what)
    xgr = _xgrammar()
    info, compiler = _compiler(tokenizer, vocab_size, stop_ids)

    def compile_it() -> Any:  # by source: xgrammar's compiler caches these (a second compile is free)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, any_whitespace=JSON_ANY_WHITESPACE)
        return compiler.compile_regex(spec.source)

    compiled = _bounded(what, compile_it, limit)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    allowed = torch.nonzero(bits.reshape(-1)[:info.vocab_size]).reshape(-1).tolist()
    if not allowed:
        raise GrammarError(f"{what}: matches nothing this tokenizer can write (no first token is allowed)")
    if set(allowed) <= set(stop_ids):
        raise GrammarError(f"{what}: matches only the empty answer (the first token allowed is a stop token)")
    return compiled


def grammar_spec(json_schema: str | Path | None = None, regex: str | None = None) -> GrammarSpec | None:
    """The grammar of ``--json-schema FILE`` or ``--regex PATTERN`` (at most one), checked: bounded in
    size (:data:`MAX_SCHEMA_BYTES`, :data:`MAX_REGEX_CHARS`) and nesting (:data:`MAX_GRAMMAR_DEPTH`), free
    of what xgrammar would ignore or reinterpret, converted by xgrammar within :func:`grammar_timeout`."""
    if json_schema is not None and regex is not None:
        raise InputError("--json-schema and --regex: give at most one of them (one grammar per run)")
    if json_schema is None and regex is None:
        return None
    from trtvocab.fsutil import read_regular

    if json_schema is not None:
        path = Path(json_schema)
        what = f"--json-schema {path}"
        raw = read_regular(path, "--json-schema", max_bytes=MAX_SCHEMA_BYTES, error=GrammarError)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GrammarError(f"{what}: cannot read it: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        spec = GrammarSpec("json_schema", text, f"json-schema {path.name}")
    else:
        assert regex is not None
        if not regex:
            raise GrammarError("--regex: the pattern is empty")
        what = f"--regex {regex[:60]!r}"
        spec = GrammarSpec("regex", regex, f"regex {regex[:60]!r}")
    _convert(spec, what)
    return spec


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message.
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:300]


def _model_shape(path: Path) -> tuple[int, int]:
    """``(vocab, hidden)`` from the checkpoint's header (no weights read)."""
    from trtvocab.checkpoint import open_checkpoint

    config = open_checkpoint(path).config
    try:
        return int(config["vocab_size"]), int(config["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"MODEL {path}: its config has no vocab_size / hidden_size") from None


def artifact_spec(root: str | Path, backend: str, model: Path, tp: int | None,
                  allow_other_checkpoint: bool = False) -> ArtifactSpec:
    """Check an artifact against the model and pick its backend (:class:`ArtifactError`, naming ``--artifact``).

    The artifact must have been built from ``model``'s head (the manifest's ``checkpoint_sha256``,
    :func:`trtvocab.provenance.head_digest`); ``allow_other_checkpoint`` runs it anyway, and the
    report says so."""
    from trtvocab import artifacts
    from trtvocab.backends import canonical, pick_backend

    canonical(backend)
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"--artifact {root}: no such folder (build one with `trtvocab build RECIPE`)")
    manifest = artifacts.read_manifest(root)
    if not manifest.complete:
        raise ArtifactError(f"--artifact {root}: holds ranks {manifest.ranks_built} of tp {manifest.mapping.tp_size}; "
                            "generate needs all of them")
    if manifest.head.context_logits:
        raise ArtifactError(f"--artifact {root}: built with context_logits = true (all rows); generate needs "
                            "last-token logits")
    if manifest.mapping.enable_attention_dp:
        raise ArtifactError(f"--artifact {root}: built for attention DP (ranks hold different requests); generate "
                            "runs one TP group over one batch")
    vocab, hidden = _model_shape(model)
    h = manifest.head
    if (h.vocab_size, h.hidden_size) != (vocab, hidden):
        raise ArtifactError(f"--artifact {root}: its head is vocab {h.vocab_size} x hidden {h.hidden_size}, the model "
                            f"{model.name} is vocab {vocab} x hidden {hidden}")
    note = _provenance(root, manifest, model, allow_other_checkpoint)
    art_tp = manifest.mapping.tp_size
    if tp is not None and tp != art_tp:
        raise ConfigError(f"--tp {tp}: the artifact {root} is built for tp {art_tp} (omit --tp, or pass --tp {art_tp})")
    chosen, usable = pick_backend(manifest, backend)
    notes = [note] if note else []
    if chosen != "tensorrt" and manifest.backends.tensorrt and usable["tensorrt"] is not None:
        notes.append(f"TensorRT engines not run: {usable['tensorrt']}; the head ran on {chosen} instead")
    return ArtifactSpec(str(root.resolve()), chosen, art_tp, "; ".join(notes) or None)


def _provenance(root: Path, manifest: Any, model: Path, allow: bool) -> str | None:
    """None when the artifact's head is ``model``'s; else refuse (or, allowed, say so)."""
    from trtvocab.provenance import head_digest

    if manifest.checkpoint_sha256 is None:
        why = ("was built from synthetic weights" if manifest.checkpoint == "synthetic"
               else "records no checkpoint digest")
    else:
        mine = head_digest(model, manifest.head.tensor)
        if mine == manifest.checkpoint_sha256:
            return None
        why = (f"was built from another checkpoint ({manifest.checkpoint}, head sha256 "
               f"{manifest.checkpoint_sha256[:12]}...; {model.name}'s is {mine[:12]}...)")
    if not allow:
        raise ArtifactError(f"--artifact {root} {why}: its logits are not {model.name}'s head; rebuild it from "
                            "the model, or pass --allow-other-checkpoint to run it anyway")
    return f"WARNING: the artifact {why}; running it anyway (--allow-other-checkpoint)"


def check_options(*, max_new_tokens: int, tp: int | None, prompts: list[str] | tuple[str, ...] | None,
                  backend: str, artifact: str | Path | None, deterministic: bool) -> None:
    """The checks that need nothing loaded."""
    from trtvocab.backends import CHOICES, canonical

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: must be an int >= 1, got {max_new_tokens!r}")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ConfigError(f"--tp: must be an int >= 1 (local gloo ranks), got {tp!r}")
    if not prompts:
        raise InputError("--prompt: give at least one prompt")
    name = canonical(backend)
    if name != "torch" and artifact is None:
        raise ConfigError(f"--backend {backend}: runs a built head; give --artifact DIR (trtvocab build RECIPE), "
                          f"or use --backend torch for the model's own head (choices: {CHOICES})")
    if deterministic and artifact is not None:
        raise ConfigError("--deterministic: applies to the head loaded from MODEL; an artifact's head is fixed at "
                          "build time (drop --artifact or --deterministic)")


def encode_prompts(tokenizer: Any, prompts: list[str] | tuple[str, ...], chat: bool) -> list[list[int]]:
    """Each prompt's ids: as the tokenizer encodes it, or through its chat template (``--chat``)."""
    out = []
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat: the tokenizer has no chat template")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise InputError(f"--prompt {i + 1}: expected text, got {type(text).__name__}")
        if chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise InputError(f"--prompt {i + 1} ({text!r}): encodes to no tokens")
        out.append([int(t) for t in ids])
    return out


def prepare(
    model: str | Path,
    prompts: list[str] | tuple[str, ...],
    *,
    chat: bool = False,
    tp: int | None = None,
    max_new_tokens: int = 32,
    params: SamplingParams | list[SamplingParams] | None = None,
    json_schema: str | Path | None = None,
    regex: str | None = None,
    grammars: list[GrammarSpec | None] | None = None,
    deterministic: bool = False,
    backend: str = "torch",
    artifact: str | Path | None = None,
    allow_other_checkpoint: bool = False,
    attention_dp: bool = False,
) -> tuple[GenerateSpec, LoadedModel]:
    """Validate everything, then load the model: the run's spec and the loaded model.

    ``params``: one :class:`SamplingParams` for every prompt, or one per prompt; default greedy.
    ``json_schema`` / ``regex`` constrain every prompt; ``grammars`` (from :func:`grammar_spec`)
    gives one grammar (or None) per prompt instead.
    Cheap checks (options, the grammar, the artifact's manifest against the checkpoint's
    header) come before the model is loaded.
    """
    check_options(max_new_tokens=max_new_tokens, tp=tp, prompts=prompts, backend=backend, artifact=artifact,
                  deterministic=deterministic)
    path = model_path(model)
    per_prompt = _per_prompt(params, len(prompts))
    grammar = grammar_spec(json_schema, regex)
    if grammars is not None:
        if grammar is not None:
            raise InputError("grammars: give either one grammar per prompt or --json-schema / --regex, not both")
        if len(grammars) != len(prompts) or not all(g is None or isinstance(g, GrammarSpec) for g in grammars):
            raise InputError(f"grammars: expected one GrammarSpec or None per prompt ({len(prompts)})")
        for i, g in enumerate(grammars):
            if g is not None:
                check_grammar(g, f"grammars[{i}] ({g.label})")
        per_grammar = tuple(grammars)
    else:
        per_grammar = (grammar,) * len(prompts) if grammar is not None else ()
    art = artifact_spec(artifact, backend, path, tp, allow_other_checkpoint) if artifact is not None else None
    ranks = art.tp if art is not None else (tp or 1)
    if attention_dp and ranks == 1:
        raise ConfigError("--attention-dp splits the prompts over the ranks: it needs --tp > 1 (or a tp > 1 "
                          "--artifact)")
    vocab, _ = _model_shape(path)
    if ranks > vocab:
        raise ConfigError(f"--tp {ranks}: more ranks than the vocabulary has ids ({vocab})")
    loaded = load_model(path)
    # Every distinct grammar compiled once against the tokenizer, before any rank starts: bounded in time,
    # refused when it lets the model say nothing (the ranks' compile is then xgrammar's cache at tp 1).
    stops = _eos_ids(loaded.model, loaded.tokenizer)
    for g in dict.fromkeys(g for g in per_grammar if g is not None):
        compile_grammar(g, loaded.tokenizer, int(loaded.config.vocab_size), stops,
                        what=f"--{g.kind.replace('_', '-')} ({g.label})")
    ids = encode_prompts(loaded.tokenizer, prompts, chat)
    limit = getattr(loaded.config, "max_position_embeddings", None)
    longest = max(len(p) for p in ids)
    if isinstance(limit, int) and longest + max_new_tokens > limit:
        raise InputError(f"--max-new-tokens {max_new_tokens}: the longest prompt has {longest} tokens and the model "
                         f"holds at most {limit} positions")
    spec = GenerateSpec(str(path), tuple(prompts), tuple(tuple(p) for p in ids), ranks, max_new_tokens,
                        tuple(per_prompt), per_grammar, art, deterministic, bool(attention_dp))
    return spec, loaded


def _per_prompt(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(temperature=0.0)] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, list | tuple) and len(params) == n and all(isinstance(p, SamplingParams) for p in params):
        return list(params)
    raise InputError(f"params: expected a SamplingParams or one per prompt ({n}), got {params!r}"[:300])


# ---- running it ---------------------------------------------------------------------------------------
def generate(spec: GenerateSpec, loaded: LoadedModel) -> GenerateReport:
    """Run the decode loop of ``spec``: in this process at tp 1, on ``spec.tp`` gloo ranks otherwise."""
    if spec.tp == 1:
        out = _decode(spec, loaded.model, loaded.tokenizer, rank=0)
    else:
        from trtvocab.launch import run_ranks

        # Attention DP: a rank that owns no prompt runs no body, so it is not sent the model
        # (the largest argument by far; unpickling it also imports transformers there).
        owns = [calc_shard(len(spec.prompts), spec.tp, r + 1) > calc_shard(len(spec.prompts), spec.tp, r)
                for r in range(spec.tp)]
        facts = _ModelFacts.of(loaded.model, loaded.tokenizer)
        models = [(loaded.model if owns[r] or not spec.attention_dp else None,) for r in range(spec.tp)]
        outs = run_ranks(_rank_main, spec.tp, spec, loaded.tokenizer, facts, rank_args=models)
        out = outs[0]
        for r, other in enumerate(outs[1:], start=1):
            if other.token_ids != out.token_ids:  # the sampler promises the same ids everywhere
                raise DistributedError(f"generate: rank {r} produced other token ids than rank 0")
        out.ran_on = sorted({name for o in outs for name in o.ran_on})
    tok = loaded.tokenizer
    results = [GenerateResult(p, ids, tok.decode(ids, skip_special_tokens=True))
               for p, ids in zip(spec.prompts, out.token_ids, strict=True)]
    head = ", ".join(out.ran_on) if spec.artifact is not None else "torch"
    labels = {g.label for g in spec.grammars if g is not None}
    grammar = None if not labels else labels.pop() if len(labels) == 1 and None not in spec.grammars else \
        "per-prompt grammars"
    return GenerateReport(results, spec.tp, head, sum(len(r) for r in out.token_ids), out.prefill_s, out.decode_s,
                          out.deterministic, grammar, spec.attention_dp)


def _rank_main(rank: int, world: int, spec: GenerateSpec, tokenizer: Any, facts: _ModelFacts,
               model: Any) -> _RankOutput:
    """One rank of a tp > 1 run (spawned by run_ranks: the model arrives in shared memory; None on an
    attention-DP rank that owns no prompt)."""
    _quiet_transformers()
    return _decode(spec, model, tokenizer, rank=rank, facts=facts)


@dataclasses.dataclass(frozen=True)
class _ModelFacts:
    """What every rank needs of the model besides its body (a rank without a body has only this)."""

    vocab_size: int
    hidden_size: int
    eos: frozenset[int]
    pad: int

    @classmethod
    def of(cls, model: Any, tokenizer: Any) -> _ModelFacts:
        eos = _eos_ids(model, tokenizer)
        return cls(int(model.config.vocab_size), int(model.config.hidden_size), frozenset(eos),
                   _pad_id(model, tokenizer, eos))


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def _pad_id(model: Any, tokenizer: Any, eos: set[int]) -> int:
    for pad in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return min(eos) if eos else 0


class _Body:
    """``model.model`` (the decoder stack + final norm) with its KV cache, under either kwarg name."""

    def __init__(self, model: Any) -> None:
        self.body = model.model
        names = inspect.signature(self.body.forward).parameters
        self.cache_kw = "cache" if "cache" in names else "past_key_values"
        self.cache: Any = None

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        out = self.body(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self.cache_kw: self.cache})
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else out.past_key_values
        return out.last_hidden_state


def _load_vocab_ends(spec: GenerateSpec, rank: int, mapping: Mapping | None) -> tuple[Any, Any, bool]:
    """``(embedding, head, deterministic)`` of this rank, the artifact's layout where there is one."""
    from trtvocab.embedding import load_tied

    layout: Any = "uneven"
    pad_to = 64
    manifest = None
    if spec.artifact is not None:
        from trtvocab import artifacts

        manifest = artifacts.read_manifest(Path(spec.artifact.root), verify=False)  # verified by prepare
        layout, pad_to = manifest.head.vocab_layout, manifest.head.pad_to
    # LMHead refuses deterministic=True for a quantized head (a ConfigError naming it).
    embedding, head = load_tied(spec.model, mapping=mapping, dtype=torch.float32, vocab_layout=layout, pad_to=pad_to,
                                gather_output=False, deterministic=spec.deterministic)
    deterministic = spec.deterministic
    if manifest is not None:
        entry = manifest.entry(rank)
        if (entry.start, entry.end) != (head.vocab_start, head.vocab_end):
            raise ArtifactError(f"--artifact: rank {rank} holds columns [{entry.start}, {entry.end}), the model's "
                                f"shard is [{head.vocab_start}, {head.vocab_end})")
    return embedding, head, deterministic


def _decode(spec: GenerateSpec, model: Any, tokenizer: Any, rank: int, facts: _ModelFacts | None = None) -> _RankOutput:
    from trtvocab.logits import LogitsProcessor
    from trtvocab.sampling import apply_token_bitmask, decode, sample

    split = spec.tp > 1
    mapping = Mapping(world_size=spec.tp, rank=rank, tp_size=spec.tp) if split else None
    error: Exception | None = None
    try:
        embedding, head, deterministic = _load_vocab_ends(spec, rank, mapping)
        backend = None
        if spec.artifact is not None:
            from trtvocab import artifacts
            from trtvocab.backends import open_backend
            from trtvocab.dtypes import head_dtype

            manifest = artifacts.read_manifest(Path(spec.artifact.root), verify=False)
            backend = open_backend(spec.artifact.backend, Path(spec.artifact.root), manifest, rank)
            backend_dtype = head_dtype(manifest.head.dtype)
        facts = facts or _ModelFacts.of(model, tokenizer)
        grammar = _Grammar(spec.grammars, tokenizer, facts.vocab_size, set(facts.eos)) \
            if any(g is not None for g in spec.grammars) else None
    except Exception as exc:
        if not split:
            raise
        error = exc
    if split:
        values = None if error is not None else {"vocab_size": head.vocab_size, "hidden_size": head.hidden_size,
                                                 "prompts": len(spec.prompts)}
        SETUP_HANDSHAKE.exchange(values, error, None, world=spec.tp, what="generate (setup)")

    facts = facts or _ModelFacts.of(model, tokenizer)
    eos, pad, config_vocab = set(facts.eos), facts.pad, facts.vocab_size
    vocab_limit = len(tokenizer) if len(tokenizer) < config_vocab else None
    processor = LogitsProcessor()
    body = _Body(model) if model is not None else None
    batch = len(spec.prompt_ids)
    longest = max(len(p) for p in spec.prompt_ids)
    ids = torch.full((batch, longest), pad, dtype=torch.int64)
    mask = torch.zeros((batch, longest), dtype=torch.int64)
    for b, p in enumerate(spec.prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, longest - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    padded = not bool(mask.all())
    generated: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))
    ran_on: set[str] = set()
    # The prompts whose body this rank runs: all of them, or (attention DP) its own block.
    adp = spec.attention_dp and split
    lo, hi = (calc_shard(batch, spec.tp, rank), calc_shard(batch, spec.tp, rank + 1)) if adp else (0, batch)
    body_mask = mask[lo:hi]

    def head_logits(hidden: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        if backend is None:
            return processor(hidden, head, seq_lens)
        err: Exception | None = None
        local: Any = None
        try:
            local = backend.rank_logits(hidden.to(backend_dtype), seq_lens)
        except Exception as exc:
            if not split:
                raise
            err = exc
        if split:
            values = None if err is not None else {"rows": local.logits.shape[0], "ran_on": local.ran_on}
            STEP_HANDSHAKE.exchange(values, err, None, world=spec.tp, what="generate (artifact head)")
        ran_on.add(local.ran_on)
        return local.logits

    def gathered_last(hidden: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """Attention DP: the last hidden row of each prompt in ``rows`` (global ids, sorted), gathered
        from the ranks that ran their body (every rank gets all of them, in prompt order)."""
        mine = [b - lo for b in rows if lo <= b < hi]
        local = hidden[mine, -1, :] if hidden is not None and mine else \
            torch.zeros((0, facts.hidden_size), dtype=torch.float32)
        counts = [sum(1 for b in rows if calc_shard(batch, spec.tp, r) <= b < calc_shard(batch, spec.tp, r + 1))
                  for r in range(spec.tp)]
        return D.all_gather_rows(local.float().contiguous(), counts, None)

    def run_body(embeds: torch.Tensor, positions_now: torch.Tensor) -> torch.Tensor | None:
        if hi == lo or body is None:
            return None  # no prompt of this rank's block: it only takes part in the vocab dimension
        return body(embeds[lo:hi], body_mask if padded else None, positions_now[lo:hi])

    start = time.perf_counter()
    prefill_s = 0.0
    step = 0
    with torch.inference_mode():
        embeds = embedding(ids)  # every rank looks up all prompts' ids: the vocab dimension stays split
        hidden = run_body(embeds, positions)
        logits: torch.Tensor | None
        if adp:
            # Left padding: the last column is every prompt's last token.
            last = gathered_last(hidden, active)
            logits = None if backend is None else head_logits(last, torch.ones(batch, dtype=torch.int64))
        else:
            assert hidden is not None
            rows = hidden[mask.bool()]  # packed non-padding rows, prompt after prompt
            logits = head_logits(rows, mask.sum(-1))
            last = rows
        while True:
            bitmask = grammar.bitmask(active) if grammar is not None and grammar.constrains(active) else None
            rows_params = [spec.params[b] for b in active]
            if logits is None:
                # A torch-path decode step: head + bitmask + draw validated together, one collective
                # per steady step (trtvocab.sampling.decode).
                next_ids = decode(last, head, rows_params, step=step, vocab_limit=vocab_limit,
                                  bitmask=bitmask).tolist()
            else:
                if bitmask is not None:
                    apply_token_bitmask(logits, bitmask, head)
                next_ids = sample(logits, head, rows_params, step=step, vocab_limit=vocab_limit).tolist()
            if step == 0:
                prefill_s = time.perf_counter() - start
            feed = torch.full((batch, 1), pad, dtype=torch.int64)
            still = []
            for b, tok in zip(active, next_ids, strict=True):
                generated[b].append(tok)
                feed[b, 0] = tok
                done = tok in eos or len(generated[b]) >= spec.max_new_tokens
                if grammar is not None:
                    done = grammar.accept(b, tok) or done
                if not done:
                    still.append(b)
            active = still
            step += 1
            if not active:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.int64)], dim=-1)
            body_mask = mask[lo:hi]
            positions = positions[:, -1:] + 1
            hidden = run_body(embedding(feed), positions)
            if adp:
                last = gathered_last(hidden, active)
            else:
                assert hidden is not None
                last = hidden[active, -1, :]
            logits = None if backend is None else head_logits(last, torch.ones(len(active), dtype=torch.int64))
    decode_s = time.perf_counter() - start - prefill_s
    return _RankOutput(generated, sorted(ran_on) or ["torch"], prefill_s, decode_s, deterministic)


class _Grammar:
    """One xgrammar matcher per constrained prompt (on every rank) and the bitmask of the unfinished rows."""

    def __init__(self, specs: tuple[GrammarSpec | None, ...], tokenizer: Any, vocab_size: int,
                 stop_ids: set[int]) -> None:
        xgr = _xgrammar()
        info, _ = _compiler(tokenizer, vocab_size, stop_ids)
        compiled: dict[GrammarSpec, Any] = {}
        self.matchers: list[Any] = []
        for spec in specs:
            if spec is None:
                self.matchers.append(None)
                continue
            if spec not in compiled:
                # prepare() compiled it within the limit already; a rank may share the cores with its
                # peers, so it gets more time (still bounded: a GrammarSpec made by hand is checked here).
                compiled[spec] = compile_grammar(spec, tokenizer, vocab_size, stop_ids,
                                                 timeout=RANK_GRAMMAR_TIMEOUT_FACTOR * grammar_timeout())
            self.matchers.append(xgr.GrammarMatcher(compiled[spec]))
        self._mask = xgr.allocate_token_bitmask(len(specs), info.vocab_size)  # all ones: everything allowed

    def constrains(self, rows: list[int]) -> bool:
        return any(self.matchers[b] is not None for b in rows)

    def bitmask(self, rows: list[int]) -> torch.Tensor:
        """The ``int32 [len(rows), W]`` mask of ``rows`` (xgrammar's layout; unconstrained rows allow every id)."""
        for b in rows:
            if self.matchers[b] is not None:
                self.matchers[b].fill_next_token_bitmask(self._mask, b)
        return self._mask[rows]

    def accept(self, row: int, token: int) -> bool:
        """Advance ``row``'s matcher by ``token``; True when its grammar has terminated (a stop token)."""
        matcher = self.matchers[row]
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            raise InputError(f"grammar: prompt {row + 1}: token {token} was drawn but the grammar does not accept it")
        return bool(matcher.is_terminated())


def run(model: str | Path, prompts: list[str], **options: Any) -> GenerateReport:
    """:func:`prepare` then :func:`generate`: the Python twin of ``trtvocab generate``."""
    spec, loaded = prepare(model, prompts, **options)
    return generate(spec, loaded)


__all__ = ["GRAMMAR_TIMEOUT_ENV", "GRAMMAR_TIMEOUT_S", "JSON_ANY_WHITESPACE", "MAX_GRAMMAR_DEPTH", "MAX_REGEX_CHARS",
           "MAX_SCHEMA_BYTES", "SETUP_HANDSHAKE", "STEP_HANDSHAKE", "UNSUPPORTED_SCHEMA_KEYWORDS", "ArtifactSpec",
           "GenerateReport", "GenerateResult", "GenerateSpec", "GrammarSpec", "LoadedModel", "artifact_spec",
           "check_grammar", "check_options", "compile_grammar", "encode_prompts", "generate", "grammar_spec",
           "grammar_timeout", "load_model", "model_path", "prepare", "run", "sampling_params"]
