"""``re:`` patterns from a checkpoint's config, matched in bounded time.

compressed-tensors (and vLLM) match a ``re:`` target or ``ignore`` entry with ``re.match``: a
backtracking matcher whose time a pattern such as ``(.|.|...)*Z`` makes exponential in the name's
length. The patterns are file content, so they are bounded here and evaluated by a matcher that
cannot backtrack: every node of the parsed pattern is evaluated once per position of the name
(memoized sets of end positions), under a step budget. The answer is ``re.match``'s for every
construct it runs (literals, classes, ``.``, groups, alternation, greedy and lazy repeats, anchors,
``\\b``, lookarounds, the ``s`` / ``m`` / ``a`` / ``x`` flags); back-references, conditionals, atomic
groups, possessive repeats and case-insensitive matching are refused (:class:`PatternError`), as
are patterns longer than :data:`MAX_PATTERN_CHARS` or nested deeper than :data:`MAX_PATTERN_DEPTH`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from re import _constants as sre  # type: ignore[attr-defined]  # the parser's opcodes (3.11+)
from re import _parser as sre_parse  # type: ignore[attr-defined]

from trtvocab.errors import PatternError

MAX_PATTERN_CHARS = 4096  # real targets are tens of characters
MAX_PATTERN_DEPTH = 32  # groups nested (counted by a loop before the parser recurses)
MAX_STEPS = 200_000  # node evaluations per (pattern, name); real patterns take under a thousand
# The flags as ints (RegexFlag arithmetic costs more than the rest of a short pattern's compile).
_DOTALL, _MULTILINE, _ASCII = int(re.DOTALL), int(re.MULTILINE), int(re.ASCII)
_FLAGS_RUN = _DOTALL | _MULTILINE | _ASCII | int(re.VERBOSE) | int(re.UNICODE)


class _Node:
    """One parsed element: ``ends(ctx, pos)`` is the set of positions where a match starting at ``pos`` may end."""

    __slots__ = ("index",)

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        raise NotImplementedError


class _Context:
    """One match: the name, the memo of ``(node, pos) -> ends`` and the step budget."""

    __slots__ = ("memo", "steps", "text")

    def __init__(self, text: str) -> None:
        self.text, self.memo, self.steps = text, {}, 0

    def ends(self, node: _Node, pos: int) -> frozenset[int]:
        key = (node.index, pos)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        self.tick()
        out = node.compute(self, pos)
        self.memo[key] = out
        return out

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Budget

    def step(self, node: _Node, starts: frozenset[int] | set[int]) -> frozenset[int]:
        out: set[int] = set()
        for p in starts:
            out |= self.ends(node, p)
        return frozenset(out)


class _Budget(Exception):
    """The step budget ran out (turned into a :class:`PatternError` by :func:`match`)."""


class _Char(_Node):
    __slots__ = ("test",)

    def __init__(self, test: Callable[[str], bool]) -> None:
        self.test = test

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        text = ctx.text
        return frozenset((pos + 1,)) if pos < len(text) and self.test(text[pos]) else frozenset()


class _Literal(_Node):
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        return frozenset((pos + len(self.text),)) if ctx.text.startswith(self.text, pos) else frozenset()


class _Seq(_Node):
    __slots__ = ("items",)

    def __init__(self, items: list[_Node]) -> None:
        self.items = items

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        cur: frozenset[int] = frozenset((pos,))
        for item in self.items:
            if not cur:
                break
            cur = ctx.step(item, cur)
        return cur


class _Alt(_Node):
    __slots__ = ("options",)

    def __init__(self, options: list[_Node]) -> None:
        self.options = options

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        out: set[int] = set()
        for option in self.options:
            out |= ctx.ends(option, pos)
        return frozenset(out)


class _Repeat(_Node):
    __slots__ = ("body", "high", "low")

    def __init__(self, low: int, high: int | None, body: _Node) -> None:
        self.low, self.high, self.body = low, high, body

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        cur: frozenset[int] = frozenset((pos,))
        for _ in range(self.low):  # exactly `low` times first
            ctx.tick()
            nxt = ctx.step(self.body, cur)
            if nxt == cur or not nxt:  # a fixed point stays one; nothing left ends the repeat
                cur = nxt
                break
            cur = nxt
        if not cur:
            return cur
        seen, frontier, count = set(cur), set(cur), self.low
        while frontier and (self.high is None or count < self.high):  # then breadth first, each end once
            ctx.tick()
            frontier = set(ctx.step(self.body, frontier)) - seen
            seen |= frontier
            count += 1
        return frozenset(seen)


class _At(_Node):
    __slots__ = ("test",)

    def __init__(self, test: Callable[[str, int], bool]) -> None:
        self.test = test

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        return frozenset((pos,)) if self.test(ctx.text, pos) else frozenset()


class _Look(_Node):
    __slots__ = ("ahead", "body", "negate")

    def __init__(self, ahead: bool, negate: bool, body: _Node) -> None:
        self.ahead, self.negate, self.body = ahead, negate, body

    def compute(self, ctx: _Context, pos: int) -> frozenset[int]:
        if self.ahead:
            found = bool(ctx.ends(self.body, pos))
        else:  # a lookbehind: some start before pos whose match ends exactly at pos
            found = any(pos in ctx.ends(self.body, start) for start in range(pos, -1, -1))
        return frozenset((pos,)) if found != self.negate else frozenset()


def _word(ch: str, ascii_only: bool) -> bool:
    return (ch.isascii() or not ascii_only) and (ch.isalnum() or ch == "_")


def _category(code: object, ascii_only: bool) -> Callable[[str], bool]:
    def asc(test: Callable[[str], bool]) -> Callable[[str], bool]:
        return (lambda ch: ch.isascii() and test(ch)) if ascii_only else test

    digit = asc(str.isdecimal)
    space = (lambda ch: ch in " \t\n\r\f\v") if ascii_only else str.isspace

    def word(ch: str) -> bool:
        return _word(ch, ascii_only)

    table: dict[object, Callable[[str], bool]] = {
        sre.CATEGORY_DIGIT: digit, sre.CATEGORY_NOT_DIGIT: lambda ch: not digit(ch),
        sre.CATEGORY_SPACE: space, sre.CATEGORY_NOT_SPACE: lambda ch: not space(ch),
        sre.CATEGORY_WORD: word, sre.CATEGORY_NOT_WORD: lambda ch: not word(ch),
    }
    if code not in table:
        raise _Unsupported(f"the character category {code}")
    return table[code]


class _Unsupported(Exception):
    """A construct the bounded matcher does not run."""


def _char_set(items: list[tuple[object, object]], flags: int) -> Callable[[str], bool]:
    negate, tests = False, []
    for op, av in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            tests.append(lambda ch, c=chr(av): ch == c)  # type: ignore[arg-type]
        elif op is sre.RANGE:
            lo, hi = av  # type: ignore[misc]
            tests.append(lambda ch, lo=lo, hi=hi: lo <= ord(ch) <= hi)
        elif op is sre.CATEGORY:
            tests.append(_category(av, bool(flags & _ASCII)))
        else:
            raise _Unsupported(f"{op} inside a character class")
    return lambda ch: any(t(ch) for t in tests) != negate


def _at(code: object, flags: int) -> Callable[[str, int], bool]:
    multiline, ascii_only = bool(flags & _MULTILINE), bool(flags & _ASCII)

    def boundary(text: str, pos: int) -> bool:
        before = pos > 0 and _word(text[pos - 1], ascii_only)
        after = pos < len(text) and _word(text[pos], ascii_only)
        return before != after

    def end(text: str, pos: int) -> bool:
        n = len(text)
        if multiline:
            return pos == n or text[pos] == "\n"
        return pos == n or (pos == n - 1 and text[pos] == "\n")

    table: dict[object, Callable[[str, int], bool]] = {
        sre.AT_BEGINNING: (lambda t, p: p == 0 or (multiline and t[p - 1] == "\n")),
        sre.AT_BEGINNING_STRING: lambda t, p: p == 0,
        sre.AT_END: end,
        sre.AT_END_STRING: lambda t, p: p == len(t),
        sre.AT_BOUNDARY: boundary,
        sre.AT_NON_BOUNDARY: lambda t, p: bool(t) and not boundary(t, p),  # sre: never in an empty string
    }
    if code not in table:
        raise _Unsupported(f"the anchor {code}")
    return table[code]


@dataclass(frozen=True)
class Compiled:
    """A bounded, parsed ``re:`` pattern (:func:`compile_pattern`)."""

    source: str
    root: _Node


def _depth(source: str) -> int:
    """How deeply groups nest (escapes skipped; a ``(`` in a class counts, which only over-counts)."""
    depth = deepest = 0
    i = 0
    while i < len(source):
        ch = source[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


@functools.lru_cache(maxsize=4096)
def compile_pattern(source: str) -> Compiled:
    """Parse ``source`` (the text after ``re:``) into the bounded matcher's nodes.

    Raises :class:`PatternError` (without the file: the caller names it) for a pattern that is too long,
    too deep, invalid for ``re`` or uses a construct the bounded matcher does not run.
    """
    if len(source) > MAX_PATTERN_CHARS:
        raise PatternError(f"the pattern has {len(source)} characters (at most {MAX_PATTERN_CHARS})")
    if _depth(source) > MAX_PATTERN_DEPTH:
        raise PatternError(f"its groups nest {_depth(source)} deep (at most {MAX_PATTERN_DEPTH})")
    try:
        parsed = sre_parse.parse(source, 0)
    except re.error as exc:
        raise PatternError(f"not a valid regular expression ({exc})") from None
    except (RecursionError, OverflowError, MemoryError) as exc:
        raise PatternError(f"not a regular expression it can parse ({type(exc).__name__})") from None
    nodes: list[_Node] = []

    def add(node: _Node) -> _Node:
        node.index = len(nodes)
        nodes.append(node)
        return node

    def build(sub: object, flags: int) -> _Node:
        if flags & ~_FLAGS_RUN:
            raise _Unsupported("case-insensitive or locale matching")
        items: list[_Node] = []
        run: list[str] = []  # consecutive literal characters become one node
        for op, av in sub:  # type: ignore[attr-defined]
            if op is sre.LITERAL:
                run.append(chr(av))
                continue
            if run:
                items.append(add(_Literal("".join(run))))
                run = []
            items.append(one(op, av, flags))
        if run:
            items.append(add(_Literal("".join(run))))
        return items[0] if len(items) == 1 else add(_Seq(items))

    def one(op: object, av: object, flags: int) -> _Node:
        if op is sre.LITERAL:
            return add(_Char(lambda ch, c=chr(av): ch == c))  # type: ignore[arg-type]
        if op is sre.NOT_LITERAL:
            return add(_Char(lambda ch, c=chr(av): ch != c))  # type: ignore[arg-type]
        if op is sre.ANY:
            dotall = bool(flags & _DOTALL)
            return add(_Char(lambda ch: dotall or ch != "\n"))
        if op is sre.IN:
            return add(_Char(_char_set(av, flags)))  # type: ignore[arg-type]
        if op is sre.BRANCH:
            return add(_Alt([build(b, flags) for b in av[1]]))  # type: ignore[index]
        if op is sre.SUBPATTERN:
            _group, add_flags, del_flags, body = av  # type: ignore[misc]
            return build(body, (flags | int(add_flags)) & ~int(del_flags))
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # greedy or lazy: the same matches exist
            low, high, body = av  # type: ignore[misc]
            return add(_Repeat(low, None if high is sre.MAXREPEAT else high, build(body, flags)))
        if op is sre.AT:
            return add(_At(_at(av, flags)))
        if op in (sre.ASSERT, sre.ASSERT_NOT):
            direction, body = av  # type: ignore[misc]
            return add(_Look(direction > 0, op is sre.ASSERT_NOT, build(body, flags)))
        names = {sre.GROUPREF: "a back-reference", sre.GROUPREF_EXISTS: "a conditional group",
                 sre.ATOMIC_GROUP: "an atomic group", sre.POSSESSIVE_REPEAT: "a possessive repeat"}
        raise _Unsupported(names.get(op, str(op)))  # type: ignore[call-overload]

    try:
        root = build(parsed, int(parsed.state.flags))
    except _Unsupported as exc:
        raise PatternError(f"uses {exc}, which trtvocab's bounded matcher does not run") from None
    except RecursionError:
        raise PatternError("nests too deeply") from None
    return Compiled(source, root)


def match(compiled: Compiled, name: str) -> bool:
    """``re.match(pattern, name) is not None``, in at most :data:`MAX_STEPS` node evaluations."""
    ctx = _Context(name)
    try:
        return bool(ctx.ends(compiled.root, 0))
    except _Budget:
        raise PatternError(f"needs more than {MAX_STEPS} steps to match {name!r}") from None
    except RecursionError:
        raise PatternError(f"nests too deeply to match {name!r}") from None


__all__ = ["MAX_PATTERN_CHARS", "MAX_PATTERN_DEPTH", "MAX_STEPS", "Compiled", "compile_pattern", "match"]
