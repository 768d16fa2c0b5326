"""The llama.cpp perplexity anchor on a short text: SmolLM2's Q8_0 head in its stored blocks against
llama.cpp itself on the same GGUF file, the same token ids and ``llama-perplexity``'s windows.

Optional: llama.cpp runs in its own venv (``llama-cpp-python``; ``$TRTVOCAB_LLAMACPP_PYTHON``, default
``../llamacpp-venv/bin/python``); without that interpreter every test here is skipped, saying so.
``benchmarks/perplexity_anchor.py`` is run as a program (a fresh interpreter, which starts the llama.cpp
child), on the first 4 chunks of 256 ids of ``benchmarks/data/alice_ch1_2.txt`` (508 scored tokens).
The references are independent of the code under test: llama.cpp's own logits, and transformers' own
float32 ``lm_head`` of the same file.

The same anchor on SmolLM2 requantized by llama.cpp's own ``llama-quantize`` so that its tied head is Q4_0,
Q4_1 or Q5_0 (``--allow-requantize --token-embedding-type T``, the rest of the file copied) runs where that
program is found too (``$TRTVOCAB_LLAMA_QUANTIZE``, else ``llama-quantize`` on the ``PATH``); the files are
made in the test's temporary folder, and the ``gguf`` package (not trtvocab) says which type the head has.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.model, pytest.mark.subprocess]  # every test here (docs/testing.md)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "perplexity_anchor.py"
LLAMACPP_PYTHON = os.environ.get("TRTVOCAB_LLAMACPP_PYTHON",  # default: the venv beside the clone
                                 str(Path(__file__).resolve().parents[3] / "llamacpp-venv" / "bin" / "python"))
LLAMA_QUANTIZE = os.environ.get("TRTVOCAB_LLAMA_QUANTIZE") or shutil.which("llama-quantize")
CTX, CHUNKS = 256, 4
HEAD_TYPES = ("Q4_0", "Q4_1", "Q5_0")  # block 32: SmolLM2's rows of 576 take them (K-quants need 256 | 576)


def need_llamacpp() -> None:
    if not Path(LLAMACPP_PYTHON).is_file():
        pytest.skip(f"llama.cpp's interpreter is absent ({LLAMACPP_PYTHON}; set TRTVOCAB_LLAMACPP_PYTHON, or "
                    "python3 -m venv ../llamacpp-venv && ../llamacpp-venv/bin/pip install "
                    "llama-cpp-python==0.3.36 numpy)")


def run_anchor(model: Path, out: Path) -> dict[str, Any]:
    """``benchmarks/perplexity_anchor.py`` on ``model`` (4 chunks of 256 ids, 1 thread); its JSON."""
    need_llamacpp()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--ctx", str(CTX), "--chunks",
                           str(CHUNKS), "--threads", "1", "--peer-python", LLAMACPP_PYTHON, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def anchor(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_anchor(smollm2, tmp_path_factory.mktemp("anchor") / "anchor.json")


@pytest.fixture(scope="module", params=HEAD_TYPES)
def requantized(request: pytest.FixtureRequest, smollm2: Path,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """SmolLM2 with its tied head requantized by ``llama-quantize`` to one type; the anchor on that file."""
    head_type = request.param
    need_llamacpp()
    if LLAMA_QUANTIZE is None or not Path(LLAMA_QUANTIZE).is_file():
        pytest.skip("llama.cpp's llama-quantize is absent (set TRTVOCAB_LLAMA_QUANTIZE, or put it on the PATH; "
                    "built from llama.cpp's source: cmake --build build --target llama-quantize)")
    work = tmp_path_factory.mktemp(f"anchor-{head_type.lower()}")
    path = work / f"smollm2-head-{head_type.lower()}.gguf"
    done = subprocess.run([LLAMA_QUANTIZE, "--allow-requantize", "--token-embedding-type", head_type.lower(),
                           str(smollm2), str(path), "Q4_1", "1"],  # Q4_1: the file's own type, its tensors copied
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import gguf  # the file's own reader: which blocks llama.cpp wrote, independent of trtvocab

    found = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert found["token_embd.weight"] == head_type and "output.weight" not in found  # tied, in the asked type
    return head_type, run_anchor(path, work / "anchor.json")


def test_same_ids_and_windows(anchor: dict[str, Any]) -> None:
    """Both sides scored llama-perplexity's windows of the same ids: n_ctx / 2 - 1 tokens a chunk."""
    assert anchor["n_chunk"] == CHUNKS
    assert anchor["scored_tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
    assert anchor["add_bos"] is False  # SmolLM2's vocabulary adds no BOS
    assert anchor["tokenization"]["equal"], anchor["tokenization"]  # transformers' tokenizer agrees


def test_stored_head_within_1pct_of_float32(anchor: dict[str, Any]) -> None:
    stored = anchor["trtvocab"]["stored"]["ppl"]
    assert anchor["head_format"]["stored"] != anchor["head_format"]["float32"]  # blocks, not a float copy
    for reference in ("float32", "transformers"):
        assert abs(stored / anchor["trtvocab"][reference]["ppl"] - 1.0) <= 0.01, (reference, anchor["trtvocab"])


def test_not_worse_than_llamacpp(anchor: dict[str, Any]) -> None:
    """Float activations: trtvocab's PPL is at most llama.cpp's (1 % slack on 508 tokens)."""
    assert anchor["trtvocab"]["stored"]["ppl"] <= anchor["llamacpp"]["ppl"] * 1.01, anchor["ratios"]


def test_requantized_heads_anchor(requantized: tuple[str, dict[str, Any]]) -> None:
    """A Q4_0 / Q4_1 / Q5_0 head made by llama.cpp stays in its blocks; both goals hold as for Q8_0."""
    head_type, r = requantized
    assert r["head_format"]["stored"] == f"GGUF_{head_type}", r["load_notes"]
    assert r["scored_tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
    stored = r["trtvocab"]["stored"]["ppl"]
    for reference in ("float32", "transformers"):
        assert abs(stored / r["trtvocab"][reference]["ppl"] - 1.0) <= 0.01, (reference, r["trtvocab"])
    assert stored <= r["llamacpp"]["ppl"] * 1.01, r["ratios"]
