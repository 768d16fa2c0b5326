"""The llama.cpp perplexity anchor on a short text: SmolLM2's Q8_0 head in its stored blocks against
llama.cpp itself on the same GGUF file, the same token ids and ``llama-perplexity``'s windows.

Optional: llama.cpp runs in its own venv (``llama-cpp-python``; ``$TRTVOCAB_LLAMACPP_PYTHON``, default
``/work/llamacpp-venv/bin/python``); without that interpreter every test here is skipped, saying so.
``benchmarks/perplexity_anchor.py`` is run as a program (a fresh interpreter, which starts the llama.cpp
child), on the first 4 chunks of 256 ids of ``benchmarks/data/alice_ch1_2.txt`` (508 scored tokens).
The references are independent of the code under test: llama.cpp's own logits, and transformers' own
float32 ``lm_head`` of the same file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.model, pytest.mark.subprocess]  # every test here (docs/testing.md)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "perplexity_anchor.py"
LLAMACPP_PYTHON = os.environ.get("TRTVOCAB_LLAMACPP_PYTHON", "/work/llamacpp-venv/bin/python")
CTX, CHUNKS = 256, 4


@pytest.fixture(scope="module")
def anchor(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not Path(LLAMACPP_PYTHON).is_file():
        pytest.skip(f"llama.cpp's interpreter is absent ({LLAMACPP_PYTHON}; set TRTVOCAB_LLAMACPP_PYTHON, or "
                    "python3 -m venv /work/llamacpp-venv && /work/llamacpp-venv/bin/pip install "
                    "llama-cpp-python==0.3.36 numpy)")
    out = tmp_path_factory.mktemp("anchor") / "anchor.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2), "--ctx", str(CTX), "--chunks",
                           str(CHUNKS), "--threads", "1", "--peer-python", LLAMACPP_PYTHON, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


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
