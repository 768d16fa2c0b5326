"""A built artifact's per-rank heads gather as ``LMHead`` does (docs/architecture.md, "Gather strategies"):
``GatheredBackend`` / ``open_gathered`` and ``infer(..., gather_output=, gather_chunk_rows=)`` take the same
modes (True, False, "rank0", chunked), validated by the same rule (a ConfigError naming the choices) and moved
by the same code (``distributed.gather_by_mode``).

A tp 2 artifact (V = 1001: 501 + 500 columns, uneven; and a padded one) runs on gloo ranks: the torch
fallback's logits in every mode are ``LMHead``'s bits at tp 2 over the same shards (its own forward and
gather through the ``LogitsProcessor``), and every backend's are its one-collective all-gather's bits in every
mode; both are checked against a float64 recomputation from the synthetic checkpoint's rows. A NaN on one
rank raises there and PeerRankError on the other, and the group goes on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.artifact.backend_gather_rank_fns import MODES, backend_gather_cases
from trtvocab.artifact import store as artifacts
from trtvocab.artifact.recipe import parse_recipe
from trtvocab.backends.gathered import GatheredBackend
from trtvocab.checkpoints.synthetic import SyntheticRows
from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import run_ranks
from trtvocab.pipeline.build import build
from trtvocab.pipeline.infer import infer

V, H, TP, SEED, STD = 1001, 32, 2, 7, 0.5
LENS = [3, 1, 4]


def _recipe(out: Path, layout: str) -> dict:
    return {"checkpoint": {"synthetic": {"vocab_size": V, "hidden_size": H, "seed": SEED, "std": STD}},
            "mapping": {"tp_size": TP}, "lm_head": {"dtype": "float32", "vocab_layout": layout, "pad_to": 64},
            "engine": {"compiler": "tensorrt"}, "output": {"dir": str(out)}}


@pytest.fixture(scope="module", params=["uneven", "padded"])
def artifact(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gather") / request.param
    root, _ = build(parse_recipe(_recipe(out, request.param), "gather.toml"))
    return Path(root)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(sum(LENS), H, generator=torch.Generator().manual_seed(3)), torch.tensor(LENS)


def _float64(hidden: torch.Tensor) -> torch.Tensor:
    w = SyntheticRows(V, H, SEED, STD)[0:V].double()
    last = torch.tensor(LENS).cumsum(0) - 1
    return hidden.double()[last] @ w.T


@pytest.mark.ranks
def test_every_gather_mode_of_the_artifact_heads_is_lmheads(artifact: Path) -> None:
    hidden, lens = _inputs()
    backends = ["torch", "onnx"]
    per_rank = run_ranks(backend_gather_cases, TP, str(artifact), hidden, lens, backends, timeout_s=120)
    failures = []
    for rec in per_rank:
        assert len(rec["cases"]) == len(MODES) * len(backends)
        for case in rec["cases"]:
            tag = f"rank {rec['rank']} {case['backend']} {case['mode']!r} chunk {case['chunk']}"
            if not case["own all-gather"]:
                failures.append(f"{tag}: not the backend's all-gather bits")
            if case["backend"] == "torch" and not case["lmhead"]:
                failures.append(f"{tag}: not LMHead's bits")
            if len(case["ran_on"]) != TP:
                failures.append(f"{tag}: ran_on {case['ran_on']}")
    assert not failures, "\n".join(failures)
    ref = _float64(hidden)
    for case in per_rank[0]["cases"]:
        if case["logits"] is not None:  # every backend's all-gather, against float64
            assert case["logits"].shape == (len(LENS), V)
            assert float((case["logits"].double() - ref).abs().max()) < 1e-4, case["backend"]
    assert [r["failure"][0] for r in per_rank] == ["PeerRankError", "InputError"]
    assert "rank 1's logits hold nan" in per_rank[1]["failure"][1]
    assert [r["after"][0] for r in per_rank] == ["ok", "ok"]


@pytest.mark.ranks
def test_infer_takes_the_gather_modes(artifact: Path) -> None:
    hidden, lens = _inputs()
    base = infer(artifact, hidden, lens, "torch").logits
    assert float((base.double() - _float64(hidden)).abs().max()) < 1e-4
    for mode, chunk in (("rank0", None), ("rank0", 2), (True, 1)):
        got = infer(artifact, hidden, lens, "torch", gather_output=mode, gather_chunk_rows=chunk).logits
        assert torch.equal(got.view(torch.int32), base.view(torch.int32)), (mode, chunk)
    own = infer(artifact, hidden, lens, "torch", gather_output=False).logits
    manifest = artifacts.read_manifest(artifact)
    e = manifest.entry(0)
    assert torch.equal(own, base[:, e.start: e.end])


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"gather_output": "rank1"}, ["True", "False", "'rank0'", "'rank1'"]),
    ({"gather_output": None}, ["'rank0'"]),
    ({"gather_chunk_rows": 0}, ["gather_chunk_rows", ">= 1"]),
    ({"gather_output": False, "gather_chunk_rows": 4}, ["gather_output=True or 'rank0'"]),
])
def test_a_wrong_gather_value_is_a_config_error_naming_the_choices(artifact: Path, kwargs: dict,
                                                                    words: list[str]) -> None:
    manifest = artifacts.read_manifest(artifact)
    hidden, lens = _inputs()
    for call in (lambda: GatheredBackend(None, manifest, 0, **kwargs),
                 lambda: infer(artifact, hidden, lens, "torch", **kwargs)):  # refused before any rank starts
        with pytest.raises(ConfigError) as info:
            call()
        for word in words:
            assert word in str(info.value)
