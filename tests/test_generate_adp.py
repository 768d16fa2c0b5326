"""`trtvocab generate --attention-dp`: each rank runs the body for its own block of prompts, the
vocabulary stays split (hidden rows gathered, each rank its vocab slice, gather-free sampling).

The reference is the same request at tp 1 (in this process): the tokens must be identical,
greedy and seeded (the sampler's noise is keyed by token id, so the draw cannot depend on which
rank ran a prompt's body), with the model's head and with a built artifact's head, including
ranks that own no prompt at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trtvocab.commands import generate as G
from trtvocab.errors import ConfigError
from trtvocab.sampling import SamplingParams

pytest.importorskip("transformers")
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "My favourite colour is"]


def test_attention_dp_tp3_equals_tp1_greedy_and_seeded(smollm2: Path) -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    want = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params)
    got = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params, tp=3, attention_dp=True)
    assert got.attention_dp and got.tp == 3 and not want.attention_dp
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    assert all(len(r.token_ids) >= 1 for r in got.results)


def test_attention_dp_with_an_artifact_and_idle_ranks(smollm2: Path, tmp_path: Path) -> None:
    """tp 5, two prompts: ranks 2, 3 and 4 run no body at all, yet hold their vocab slices."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    out = tmp_path / "smollm2-tp5"
    build(parse_recipe({"checkpoint": {"path": str(smollm2)}, "mapping": {"tp_size": 5},
                        "lm_head": {"dtype": "float32", "gather_output": False}, "output": {"onnx": False}},
                       "tp5.toml"), out)
    want = G.run(smollm2, PROMPTS[:2], max_new_tokens=4)
    got = G.run(smollm2, PROMPTS[:2], max_new_tokens=4, artifact=out, backend="torch", attention_dp=True)
    assert got.tp == 5 and got.attention_dp
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


def test_attention_dp_needs_more_than_one_rank(smollm2: Path) -> None:
    with pytest.raises(ConfigError, match=r"--attention-dp .* needs --tp > 1"):
        G.prepare(smollm2, PROMPTS[:1], max_new_tokens=1, attention_dp=True)
