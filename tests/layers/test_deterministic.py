"""LMHead(deterministic=True): bitwise the same logits alone or in any batch, at tp 1, 2, 3, 5 and
padded 4; logsumexp / logprobs bitwise the same across tp (the fixed tree on global ids);
output_dtype=float32 gives the float32 accumulation. (Measured on this CPU with MKL, a default
float32 head is not batch-invariant: a row's logits differ between a batch of 1 and of 4.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sampling.draw_rank_fns import deterministic_cases
from trtvocab import LMHead
from trtvocab.errors import ConfigError
from trtvocab.parallel.launch import run_ranks
from trtvocab.quant.config import QuantAlgo, QuantConfig


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return run_ranks(deterministic_cases, 5, 13, timeout_s=90)[0]


@pytest.mark.ranks
def test_logits_are_bitwise_the_same_at_every_tp_and_batch(records: list[dict]) -> None:
    by_dtype: dict[str, list[dict]] = {}
    for r in records:
        by_dtype.setdefault(r["case"].split(" tp=")[0], []).append(r)
    assert len(by_dtype) == 3 and all(len(v) == 5 for v in by_dtype.values())
    for group in by_dtype.values():
        first = group[0]
        for r in group:
            assert r["alone_ok"] and r["mixed_ok"], r["case"]
            assert np.array_equal(r["batch"], first["batch"]), r["case"]
            assert np.array_equal(r["lse"], first["lse"]), r["case"]  # the tree sum: same bits at every tp
            assert np.array_equal(r["picks"], first["picks"]), r["case"]
            assert r["ids"] == first["ids"], r["case"]
            assert np.abs(r["lsm_sum"] - 1).max() < 1e-6, r["case"]
    assert all(r["dtype"] == "torch.float32" for r in by_dtype["torch.bfloat16 out=torch.float32"])


def test_output_dtype_float32_is_the_float32_accumulation() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 48, generator=gen).bfloat16()
    x = torch.randn(5, 48, generator=gen).bfloat16()
    head = LMHead(300, 48, dtype=torch.bfloat16, output_dtype=torch.float32)
    head.load_weights({"weight": w})
    got = head(x)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32
    rounded = LMHead(300, 48, dtype=torch.bfloat16)
    rounded.load_weights({"weight": w})
    # float32 accumulation is far closer to the float64 product than the bf16-rounded logits
    assert (got.double() - want).abs().max() < 1e-4 < (rounded(x).double() - want).abs().max()


def test_deterministic_refuses_quantized_heads_and_bad_output_dtypes() -> None:
    with pytest.raises(ConfigError, match="deterministic"):
        LMHead(64, 32, deterministic=True, quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, activation="none"))
    with pytest.raises(ConfigError, match="output_dtype"):
        LMHead(64, 32, dtype=torch.bfloat16, output_dtype=torch.float16)


def test_float32_logits_build_exports_them_and_the_graph_matches(tmp_path) -> None:
    """`[lm_head] output_dtype = "float32"`: the fallback returns the float32 accumulation; the exported
    graph keeps the 16-bit GEMM (so TensorRT holds no float32 copy of the weight) and rounds each logit
    to bf16 once, so it matches the fallback to one bf16 rounding (checked at build time too)."""
    from trtvocab.artifact.recipe import parse_recipe
    from trtvocab.backends.onnx import run_onnx
    from trtvocab.backends.torch import head_from_artifact
    from trtvocab.pipeline.build import build

    recipe = parse_recipe({"checkpoint": {"synthetic": {"vocab_size": 700, "hidden_size": 64, "seed": 1}},
                           "mapping": {"tp_size": 2}, "lm_head": {"output_dtype": "float32", "deterministic": True},
                           "output": {"dir": str(tmp_path / "a")}}, "f.toml")
    root, manifest = build(recipe)
    assert all(e.verify.ok for e in manifest.ranks)
    x = torch.randn(5, 64).bfloat16()
    for entry in manifest.ranks:
        head = head_from_artifact(root, manifest, entry.rank)
        assert head.output_dtype == torch.float32 and head.deterministic
        want = head.local_logits(x[-1:])[:, : head.local_vocab_size]
        got = torch.from_numpy(run_onnx(root / entry.files.onnx, x).logits)
        assert want.dtype == torch.float32
        assert torch.equal(got, got.bfloat16().float())  # each logit is a bf16 value
        torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-5)  # half a bf16 ulp of rounding
