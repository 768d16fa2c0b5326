"""Constraints for the decode loop: ``json_schema`` / ``regex`` through xgrammar, bounded.

xgrammar's compile time grows faster than the grammar (an enum of 20k strings takes ~30 s against
SmolLM2's 49k-token vocabulary, one of 500k never ends), and it silently ignores or reinterprets
what it does not support. So a constraint is checked before xgrammar sees it (size, nesting,
keywords), converted and compiled under a time limit with xgrammar's warnings turned into errors,
and refused when it lets the model say nothing. :class:`RowGrammars` holds one matcher per
constrained prompt on every rank and fills the bitmask of the unfinished rows. Limits and
refusals: ``docs/generate.md`` ("Structured output").
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from trtvocab.base.limits import (  # the limits live torch-free, for the CLI's help text
    GRAMMAR_TIMEOUT_ENV,
    GRAMMAR_TIMEOUT_S,
    MAX_GRAMMAR_DEPTH,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_BYTES,
    RANK_GRAMMAR_TIMEOUT_FACTOR,
    UNSUPPORTED_SCHEMA_KEYWORDS,
)
from trtvocab.base.safe_read import read_regular
from trtvocab.errors import ConfigError, GrammarError, InputError, first_line

JSON_ANY_WHITESPACE = False  # xgrammar JSON: compact separators, no free whitespace


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A constraint for xgrammar: ``kind`` ``"json_schema"`` (``source`` is the schema text) or
    ``"regex"`` (``source`` is the pattern); ``label`` is what reports call it."""

    kind: Literal["json_schema", "regex"]
    source: str
    label: str



def _xgrammar() -> Any:
    try:
        return importlib.import_module("xgrammar")
    except ImportError as exc:  # pragma: no cover - the generate extra is missing
        raise ConfigError(f"`json_schema` / `regex` need xgrammar (pip install 'trtvocab[generate]'): {exc}") from None


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
    what = what or ("`json_schema`" if spec.kind == "json_schema" else f"`regex` {spec.source[:60]!r}")
    if not isinstance(spec.source, str):
        raise GrammarError(f"{what}: expected the grammar as text, got {type(spec.source).__name__}")
    if spec.kind == "regex":
        if not spec.source:
            raise GrammarError("`regex`: the pattern is empty")
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
            raise GrammarError(f"{what}: xgrammar refuses it: {_xgrammar_message(exc)}") from None
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
    what = what or ("`json_schema`" if spec.kind == "json_schema" else f"`regex` {spec.source[:60]!r}")
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
    """The grammar of ``json_schema`` (a file) or ``regex`` (a pattern) (at most one), checked: bounded in
    size (:data:`MAX_SCHEMA_BYTES`, :data:`MAX_REGEX_CHARS`) and nesting (:data:`MAX_GRAMMAR_DEPTH`), free
    of what xgrammar would ignore or reinterpret, converted by xgrammar within :func:`grammar_timeout`."""
    if json_schema is not None and regex is not None:
        raise InputError("`json_schema` and `regex`: give at most one of them (one grammar per run)")
    if json_schema is None and regex is None:
        return None

    if json_schema is not None:
        path = Path(json_schema)
        what = f"`json_schema` {path}"
        raw = read_regular(path, "`json_schema`", max_bytes=MAX_SCHEMA_BYTES, error=GrammarError)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GrammarError(f"{what}: cannot read it: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        spec = GrammarSpec("json_schema", text, f"json-schema {path.name}")
    else:
        assert regex is not None
        if not regex:
            raise GrammarError("`regex`: the pattern is empty")
        what = f"`regex` {regex[:60]!r}"
        spec = GrammarSpec("regex", regex, f"regex {regex[:60]!r}")
    _convert(spec, what)
    return spec


def _xgrammar_message(exc: BaseException) -> str:
    """xgrammar's refusal in one line (``trtvocab.errors.first_line``), without its source-location prefix."""
    text = first_line(exc, limit=None).strip() or type(exc).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message.
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:300]



class RowGrammars:
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


__all__ = ["GRAMMAR_TIMEOUT_ENV", "GRAMMAR_TIMEOUT_S", "JSON_ANY_WHITESPACE", "MAX_GRAMMAR_DEPTH", "MAX_REGEX_CHARS",
           "MAX_SCHEMA_BYTES", "RANK_GRAMMAR_TIMEOUT_FACTOR", "UNSUPPORTED_SCHEMA_KEYWORDS", "GrammarSpec",
           "RowGrammars", "check_grammar", "compile_grammar", "grammar_spec", "grammar_timeout"]
