"""Print the import graph of the ``trtvocab`` package, imports inside functions included.

    python tools/import_graph.py            # edges, then any cycles and any import of a higher layer
    python tools/import_graph.py --layers   # line count per layer
    python tools/import_graph.py --check    # only the problems (what `make lint` runs)
    python tools/import_graph.py --local    # every import inside a function, with the reason it is there

Counts every ``import trtvocab.x`` / ``from trtvocab.x import y`` / ``from trtvocab import x``
anywhere in a module (top level, function bodies, ``TYPE_CHECKING`` blocks), so a lazy import
that closes a cycle is reported too. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trtvocab"

# The layers, lowest first: a module may import its own layer and those below it, never one above.
# Each entry is a folder (or a top-level module) of the package; the package's ``__init__`` is the
# public facade and is exempt. The data flows checkpoint -> gating -> shard load -> layers -> sampler,
# layers -> export -> artifact -> backends -> pipeline (build, runtime) -> commands.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "version", "base"),  # names, dtypes, units, input checks, safe file handling
    ("parallel",),  # Mapping, shard math, collectives and the handshake, process launch
    ("checkpoints",),  # safetensors / HF folders / GGUF, row readers, provenance
    ("quant",),  # FP8 / NVFP4 numerics, the lm_head gating rule, checkpoint writers
    ("kernels",),  # the fused C++ CPU kernels and their loader
    ("weights",),  # one strategy per stored format; the shard loader
    ("vocab_parallel", "lm_head", "embedding", "logits"),  # the layers a model uses
    ("sampling",),  # gather-free sampling over the vocab shards
    ("accuracy",),  # statistics of quantization accuracy
    ("export",),  # ONNX graphs and TensorRT engines
    ("artifact",),  # the recipe, the manifest, the artifact folder
    ("backends",),  # per-rank runners: torch, onnx, tensorrt
    ("pipeline",),  # build (recipe -> artifact), runtime (artifact -> logits)
    ("commands",),  # the command-line programs
]


# Where a ``trtvocab`` import may sit inside a function, and why (``--local`` prints them; ``--check`` fails on
# one anywhere else). Everything else imports at the top of its module.
LOCAL_REASONS: dict[str, str] = {
    "trtvocab.commands.cli": "start-up: `trtvocab --help` and argument errors import no torch "
                             "(tests/commands/test_cli_help.py); each command imports the library it runs",
    "trtvocab.backends": "optional runtimes: onnxruntime / TensorRT are imported for the backend asked for only",
    "trtvocab.pipeline.build": "optional exporters: onnx / onnxruntime / TensorRT are imported for the stages the "
                               "recipe asks for only",
    "trtvocab.export.tensorrt": "onnx (optional) is read only where an FP4 graph is dequantized for the builder",
    "trtvocab.export.contract": "onnx (optional) is read only where a built graph's header is described",
    "trtvocab.checkpoints.checkpoint": "the gguf package is imported for a .gguf file only",
}


def local_imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(module, line, imported module)`` of every ``trtvocab`` import inside a function body."""
    found: list[tuple[str, int, str]] = []

    def walk(node: ast.AST, mod: str, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import):
                found.extend((mod, child.lineno, a.name) for a in child.names if a.name.split(".")[0] == PACKAGE)
            elif inside and isinstance(child, ast.ImportFrom) and (child.level or
                                                                   (child.module or "").split(".")[0] == PACKAGE):
                found.append((mod, child.lineno, "." * child.level + (child.module or "")))
            walk(child, mod, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for mod, path in modules(root).items():
        walk(ast.parse(path.read_text(), str(path)), mod, False)
    return found


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` names or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's ``__init__`` is the package)."""
    known = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # "from pkg import sub" imports the submodule when one exists.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                if t.split(".")[0] != PACKAGE:
                    continue
                dep = _resolve(t, known)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (each one is a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    """The index in ``layers`` of the folder or top-level module holding ``module`` (None: the facade)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, names in enumerate(layers):
        if parts[1] in names:
            return i
    raise KeyError(f"{module} is in no layer: add its folder to LAYERS in tools/import_graph.py")


def upward(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import of a higher layer, as ``"a (layer) -> b (layer)"``."""
    out = []
    for mod in sorted(graph):
        low = layer_of(mod, layers)
        if low is None:
            continue
        for dep in sorted(graph[mod]):
            high = layer_of(dep, layers)
            if high is not None and high > low:
                out.append(f"{mod} ({'/'.join(layers[low])}) -> {dep} ({'/'.join(layers[high])})")
    return out


def layer_lines(root: Path = ROOT) -> dict[str, int]:
    """Lines per layer, in layer order."""
    out: dict[str, int] = {"/".join(names): 0 for names in LAYERS}
    for mod, path in modules(root).items():
        i = layer_of(mod)
        key = "/".join(LAYERS[i]) if i is not None else f"{PACKAGE} (facade)"
        out[key] = out.get(key, 0) + len(path.read_text().splitlines())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", action="store_true", help="print line counts per layer instead")
    parser.add_argument("--check", action="store_true", help="print only cycles and upward imports")
    parser.add_argument("--local", action="store_true", help="print the imports inside functions, with their reasons")
    args = parser.parse_args()
    local = local_imports()
    unexplained = sorted({m for m, _, _ in local if m not in LOCAL_REASONS})
    if args.local:
        for mod in sorted({m for m, _, _ in local}):
            lines = [f"{line} {target}" for m, line, target in local if m == mod]
            print(f"{mod} ({len(lines)}): {LOCAL_REASONS.get(mod, 'NO REASON: import it at the top')}")
            print("".join(f"    {x}\n" for x in lines), end="")
        print(f"{len(local)} function-local import(s) in {len({m for m, _, _ in local})} module(s)")
        return 1 if unexplained else 0
    if args.layers:
        counts = layer_lines()
        for layer, n in counts.items():
            print(f"{n:6d}  {layer}")
        print(f"{sum(counts.values()):6d}  total")
        return 0
    graph = edges()
    for mod in sorted(graph) if not args.check else ():
        deps = sorted(d.removeprefix(PACKAGE + ".") for d in graph[mod])
        print(f"{mod.removeprefix(PACKAGE + '.') or PACKAGE}: {', '.join(deps) or '-'}")
    found = cycles(graph)
    print(f"\n{len(found)} cycle(s)" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    up = upward(graph)
    print(f"{len(up)} import(s) of a higher layer" + "".join(f"\n  {u}" for u in up))
    print(f"{len(unexplained)} module(s) importing inside a function without a reason in LOCAL_REASONS"
          + "".join(f"\n  {m}" for m in unexplained))
    return 1 if found or up or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
