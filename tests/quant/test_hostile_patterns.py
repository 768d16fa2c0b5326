"""Hostile ``re:`` patterns (``trtvocab/quant/patterns.py``): a catastrophic pattern in a compressed-tensors
``ignore`` or target list is answered in bounded time; a too deep, too long or unsupported one is a
PatternError naming the file and the entry. For the patterns real configs use, and for 1500 random ones,
the bounded matcher answers as ``re.match``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from tests.hostile import deadline
from trtvocab import LMHead
from trtvocab.errors import PatternError
from trtvocab.quant import patterns
from trtvocab.quant.config import resolve_lm_head_quant

pytest.importorskip("compressed_tensors")
from tests.quant import ct_writer as ctw

CATASTROPHIC = "re:(" + "|".join(["."] * 24) + ")*Z"  # re.match: minutes on 'lm_head', hours at 48


# ==== re: patterns in config.json =============================================================================
def test_c25_catastrophic_ignore_pattern_is_answered_in_seconds(tmp_path: Path) -> None:
    """c25: ``ignore = ["re:(.|.|...24...)*Z"]`` hung every command that opens the checkpoint; the bounded
    matcher answers it (no match: no ``Z`` in ``lm_head``), so the head loads quantized."""
    path = ctw.head_checkpoint(tmp_path, "c25")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", [CATASTROPHIC]))
    with deadline(20):
        head = LMHead.from_checkpoint(path)
    assert head.weight_format.value == "FP8"


def test_c25b_catastrophic_target_pattern_matches_in_bounded_time(tmp_path: Path) -> None:
    """c25b: the same pattern as a config group's target: answered (no match), not hung."""
    path = ctw.head_checkpoint(tmp_path, "c25b")
    ctw.edit_config(path, lambda qc: qc["config_groups"]["group_0"]["targets"].append(CATASTROPHIC))
    with deadline(20):
        decision = resolve_lm_head_quant(path)
    assert decision.config is not None and decision.config.quant_algo.value == "FP8"


@pytest.mark.parametrize(("pattern", "needle"), [
    ("re:" + "(" * 1200 + "x" + ")" * 1200, "nest 1200 deep"),  # c27: RecursionError in re's parser
    ("re:" + "a" * 70000, "70000 characters"),
    ("re:(a)\\1|x", "back-reference"),
    ("re:(", "not a valid regular expression"),
])
def test_c27_deep_long_or_unsupported_patterns_name_the_file_and_entry(tmp_path: Path, pattern: str,
                                                                       needle: str) -> None:
    """c27 (and neighbours): a typed PatternError naming config.json, ``ignore`` and the entry."""
    path = ctw.head_checkpoint(tmp_path, "c27")
    ctw.edit_config(path, lambda qc: qc.__setitem__("ignore", [pattern]))
    with deadline(20), pytest.raises(PatternError) as err:
        resolve_lm_head_quant(path)
    text = str(err.value)
    for part in (str(path / "config.json"), "ignore entry", repr(pattern[:20])[:-1], needle):
        assert part in text, (part, text)


# ==== the bounded matcher answers as re.match =================================================================
REAL_PATTERNS = [r".*lm_head", r".*lm_head$", r"lm_hea", r"lm_head|", r".*", r".*self_attn.*",
                 r"model.layers.\d+.mlp.*", r".*mlp\.(gate|up|down)_proj$", r".*(q|k|v)_proj$", r"^lm_head$",
                 r"(?!.*lm_head).*", r".*(?<!lm_)head", r".*embed.*", r"[^.]+$", r"(?s).*head", r"lm_head\b",
                 r"(?:lm_){1,2}head", r".*layers\.(?!0\.).*", r"(?P<x>lm)_head", r".*?head", r"\Alm_head\Z",
                 r"(lm|model)(_head|\.embed_tokens)$", r"(?m)^lm", r"[\w.]*tokens", r".{7}", r".{8}", r"(?a)\w+$",
                 r"(?x) lm _ head", r"(?<=model\.)embed", r"(a|ab)(c|bcd)(d*)", r"x*", r"lm_head\n?$"]
NAMES = ["lm_head", "model.embed_tokens", "transformer.wte", "model.layers.0.mlp.gate_proj", "", "lm_head\n",
         "model.layers.1.self_attn.q_proj", "LM_HEAD"]


def test_bounded_matcher_answers_as_re_match_for_real_patterns() -> None:
    """The semantics kept: for the patterns real checkpoints use, the bounded matcher is ``re.match``."""
    for pattern in REAL_PATTERNS:
        compiled = patterns.compile_pattern(pattern)
        for name in NAMES:
            assert patterns.match(compiled, name) == (re.match(pattern, name) is not None), (pattern, name)


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", "_", r"\.", "[ab]", "[^a]", r"\w", r"\d", "1", "^", "$", r"\b", r"\B"]
    k = rng.random()
    if depth > 3 or k < 0.35:
        return rng.choice(atoms)
    if k < 0.55:
        return "".join(_random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3)))
    if k < 0.7:
        return "(" + "|".join(_random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"
    if k < 0.8:
        return f"(?:{_random_pattern(rng, depth + 1)})" + rng.choice(["*", "+", "?", "{0,2}", "{2}", "*?", "{1,}"])
    if k < 0.88:
        return rng.choice(["(?=", "(?!"]) + _random_pattern(rng, depth + 1) + ")"
    if k < 0.93:
        return rng.choice(["(?<=", "(?<!"]) + rng.choice(["a", "ab", r"\.", "[ab]"]) + ")"
    return _random_pattern(rng, depth + 1) + rng.choice(["*", "+", "?"])


def test_bounded_matcher_answers_as_re_match_on_random_patterns() -> None:
    """A differential check on 1500 random small patterns (anchors, ``\\b`` / ``\\B``, lookarounds, nested
    and lazy repeats) against every short name: the bounded matcher's answer is ``re.match``'s."""
    rng = random.Random(37)
    names = ["", "a", "b", "ab", "ba", "a.b", "a_1", "lm_head", "aab", "b.a.", "1a", "a\n"]
    checked = 0
    for _ in range(1500):
        pattern = _random_pattern(rng)
        try:
            compiled_re = re.compile(pattern)
        except re.error:
            continue
        try:
            compiled = patterns.compile_pattern(pattern)
        except PatternError:  # a possessive repeat ('a?+'): refused, not run
            continue
        for name in names:
            assert patterns.match(compiled, name) == (compiled_re.match(name) is not None), (pattern, name)
            checked += 1
    assert checked > 10_000


def test_bounded_matcher_stays_bounded_on_nested_repeats() -> None:
    """Nested and alternated repeats (exponential for a backtracking matcher) take a few hundred steps."""
    for pattern in ["(" + "|".join(["."] * 48) + ")*Z", "(a*)*" * 20 + "b", "((a|aa)+)+c", "(.*)*" * 8 + "Z"]:
        assert not patterns.match(patterns.compile_pattern(pattern), "a" * 30 + "lm_head")
