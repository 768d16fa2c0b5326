"""`trtvocab generate --attention-dp`: each rank runs the body for its own block of prompts, the
vocabulary stays split (hidden rows gathered, each rank its vocab slice, gather-free sampling).

The reference is the same request at tp 1 (in this process): the tokens must be identical,
greedy and seeded (the sampler's noise is keyed by token id, so the draw cannot depend on which
rank ran a prompt's body), with the model's head and with a built artifact's head, including
ranks that own no prompt at all. By default only one rank per usable CPU core runs a body
(``choose_body_ranks``); ``body_ranks`` sets it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import usable_cores
from trtvocab.pipeline import generate as G
from trtvocab.sampling import SamplingParams

pytest.importorskip("transformers")
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "My favourite colour is"]


@pytest.mark.model
def test_attention_dp_tp3_equals_tp1_greedy_and_seeded(smollm2: Path) -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    want = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params)
    got = G.run(smollm2, PROMPTS, max_new_tokens=5, params=params, tp=3, attention_dp=True, body_ranks=3)
    assert got.attention_dp and got.tp == 3 and got.body_ranks == 3 and not want.attention_dp
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    assert all(len(r.token_ids) >= 1 for r in got.results)


@pytest.mark.model
def test_attention_dp_with_an_artifact_and_idle_ranks(smollm2: Path, tmp_path: Path) -> None:
    """tp 5, three prompts on two body ranks (blocks of 2 and 1: fewer body ranks than ranks and than
    prompts): ranks 2, 3 and 4 run no body at all, yet hold their vocab slices."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.pipeline.build import build

    out = tmp_path / "smollm2-tp5"
    build(parse_recipe({"checkpoint": {"path": str(smollm2)}, "mapping": {"tp_size": 5},
                        "lm_head": {"dtype": "float32", "gather_output": False}, "output": {"onnx": False}},
                       "tp5.toml"), out)
    want = G.run(smollm2, PROMPTS[:3], max_new_tokens=4)
    got = G.run(smollm2, PROMPTS[:3], max_new_tokens=4, artifact=out, backend="torch", attention_dp=True,
                body_ranks=2)
    assert got.tp == 5 and got.attention_dp and got.body_ranks == 2
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


@pytest.mark.model
def test_attention_dp_needs_more_than_one_rank(smollm2: Path) -> None:
    with pytest.raises(ConfigError, match=r"`attention_dp` .* needs `tp` > 1"):
        G.prepare(smollm2, PROMPTS[:1], max_new_tokens=1, attention_dp=True)


@given(batch=st.integers(1, 40), tp=st.integers(1, 9), data=st.data())
def test_prompt_blocks_cover_every_prompt_once_in_order(batch: int, tp: int, data: st.DataObject) -> None:
    bodies = data.draw(st.integers(1, tp))
    blocks = [G.prompt_block(batch, bodies, r) for r in range(tp)]
    covered = [b for lo, hi in blocks for b in range(lo, hi)]
    assert covered == list(range(batch))
    assert all(lo == hi for lo, hi in blocks[bodies:])  # no body past the body ranks
    sizes = [hi - lo for lo, hi in blocks[:bodies]]
    assert max(sizes) - min(sizes) <= 1


def test_default_body_ranks_are_bounded_by_tp_prompts_and_cores() -> None:
    cores = usable_cores()
    assert G.choose_body_ranks(5, 8) == min(5, cores)
    assert G.choose_body_ranks(5, 1) == 1
    assert G.choose_body_ranks(64, 1000) == min(64, cores)
    assert G.choose_body_ranks(5, 8, 3) == 3
    assert G.choose_body_ranks(5, 2, 4) == 2  # a body rank past the prompts would own none


@pytest.mark.model
@pytest.mark.parametrize("asked", [0, 6, -1, True, 2.0])
def test_body_ranks_out_of_range_are_refused_before_loading(smollm2: Path, asked: object,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(path: object) -> None:
        raise AssertionError("the model was loaded before --body-ranks was checked")

    monkeypatch.setattr(G, "load_model", no_loading)
    with pytest.raises(ConfigError, match=r"`body_ranks`: must be an int from 1 to the tp size \(5\)"):
        G.prepare(smollm2, PROMPTS, tp=5, max_new_tokens=1, attention_dp=True, body_ranks=asked)  # type: ignore[arg-type]


@pytest.mark.model
def test_body_ranks_need_attention_dp(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "load_model", lambda path: pytest.fail("loaded before the options were checked"))
    with pytest.raises(ConfigError, match=r"`body_ranks`: only with `attention_dp`"):
        G.prepare(smollm2, PROMPTS, tp=3, max_new_tokens=1, body_ranks=2)
