"""The bounds on a ``generate`` constraint (``json_schema`` / ``regex``), torch-free so that the
CLI's help states them without importing the decode loop; enforced by :mod:`trtvocab.sampling.grammar`."""

from __future__ import annotations

# ---- grammar limits -----------------------------------------------------------------------------------
# xgrammar's compile time grows faster than the grammar: an enum of 20k strings takes ~30 s against
# SmolLM2's 49k-token vocabulary, one of 500k never ends. So a constraint is bounded before xgrammar
# sees it (size, nesting), and its conversion and compile run under a time limit.
MAX_SCHEMA_BYTES = 1 << 20  # json_schema: at most 1 MiB of JSON text
MAX_REGEX_CHARS = 1 << 14  # regex: at most 16384 characters
MAX_GRAMMAR_DEPTH = 128  # nesting: of the schema's JSON arrays / objects, of a regex's groups
GRAMMAR_TIMEOUT_S = 30.0  # conversion + compile against the tokenizer; TRTVOCAB_GRAMMAR_TIMEOUT_S overrides
GRAMMAR_TIMEOUT_ENV = "TRTVOCAB_GRAMMAR_TIMEOUT_S"
RANK_GRAMMAR_TIMEOUT_FACTOR = 4  # a rank's compile of a grammar prepare() compiled: more time, still bounded
# JSON Schema keywords that constrain but that xgrammar (0.2.x) ignores: the answer would not obey them.
UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                               "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                               "$dynamicRef", "$recursiveRef")

# The limits as ``trtvocab generate``'s help states them.
GRAMMAR_LIMITS_HELP = (f"Limits: a schema of at most {MAX_SCHEMA_BYTES >> 20} MiB nested at most {MAX_GRAMMAR_DEPTH} "
                       f"deep, a regex of at most {MAX_REGEX_CHARS} characters with groups nested at most "
                       f"{MAX_GRAMMAR_DEPTH} deep, and {GRAMMAR_TIMEOUT_S:g} s to compile it against the tokenizer "
                       f"({GRAMMAR_TIMEOUT_ENV}); keywords xgrammar would ignore (not, if/then/else, contains, "
                       "uniqueItems, propertyNames, dependencies), anything xgrammar warns about, and a constraint "
                       "that matches nothing are refused")

__all__ = ["GRAMMAR_LIMITS_HELP", "GRAMMAR_TIMEOUT_ENV", "GRAMMAR_TIMEOUT_S", "MAX_GRAMMAR_DEPTH", "MAX_REGEX_CHARS",
           "MAX_SCHEMA_BYTES", "RANK_GRAMMAR_TIMEOUT_FACTOR", "UNSUPPORTED_SCHEMA_KEYWORDS"]
