"""`trtvocab generate --attention-dp --lm-head-tp N`: the bodies data-parallel as with `--attention-dp`, the
head (and its tied table) split over groups of N of the `--tp` ranks (`Mapping.lm_head_tp_size`; the groups
made by `distributed.lm_head_group`), each group decoding every row over its own split. The tokens equal
the same request at tp 1, greedy and seeded; bad values are ConfigErrors naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trtvocab.errors import ConfigError
from trtvocab.pipeline import generate as G
from trtvocab.sampling import SamplingParams

PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,"]


@pytest.mark.model
@pytest.mark.ranks
def test_tp4_as_two_head_groups_of_two_equals_tp1(smollm2: Path) -> None:
    pytest.importorskip("transformers")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    want = G.run(smollm2, PROMPTS, max_new_tokens=4, params=params)
    got = G.run(smollm2, PROMPTS, max_new_tokens=4, params=params, tp=4, attention_dp=True, body_ranks=2,
                lm_head_tp=2)
    assert got.attention_dp and got.tp == 4
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


@pytest.mark.parametrize(("fields", "words"), [
    ({"tp": 4, "attention_dp": True, "lm_head_tp": 3}, ["`lm_head_tp` 3", "divides", "tp 4"]),
    ({"tp": 4, "lm_head_tp": 2}, ["`lm_head_tp` 2", "needs `attention_dp`"]),
    ({"tp": 4, "attention_dp": True, "lm_head_tp": 0}, ["`lm_head_tp`", ">= 1"]),
    ({"tp": 4, "attention_dp": True, "lm_head_tp": True}, ["`lm_head_tp`", "got True"]),
    ({"attention_dp": True, "lm_head_tp": 2}, ["`lm_head_tp` 2", "tp None"]),
])
def test_bad_lm_head_tp_is_a_config_error_naming_the_field(fields: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        G.GenerateOptions(prompts=("x",), **fields)
    for word in words:
        assert word in str(info.value)
