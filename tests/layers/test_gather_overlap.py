"""``LMHead(overlap_chunks=k)``: the split head's GEMM in column chunks, each chunk's all-gather overlapping the
next chunk's GEMM (docs/architecture.md, "Overlapping the GEMM with the gather"), with real gloo groups at tp 2
and 3 (one launch of 3 ranks, ``tests.parallel.rank_fns.subgroups``).

Every format (dense float32 / bfloat16, deterministic, float32 logits of a bf16 head, soft-capping with a bias,
FP8 W8A8), uneven and padded, k = 2, 3, 7 and more chunks than columns: three calls (the handshake, then steady
calls whose verdict rides on the first chunk's gather) bitwise equal to ``overlap_chunks=1``. A rank that fails
in a steady overlapped call makes its peers raise; ranks built with other chunk counts raise naming the field;
bad values are ConfigErrors.
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.overlap_rank_fns import CHUNKS, ROWS, overlap_cases
from trtvocab import LMHead, Mapping
from trtvocab.errors import ConfigError
from trtvocab.lm_head import default_overlap_chunks
from trtvocab.parallel.launch import run_ranks

FORMATS = 6


@pytest.mark.ranks
def test_overlapped_gather_is_bitwise_the_unchunked_one_at_tp2_and_tp3() -> None:
    per_rank = run_ranks(overlap_cases, 3, timeout_s=180)
    for tp in (2, 3):
        for rank in range(tp):
            records = [r for r in per_rank[rank] if r["tp"] == tp]
            cases = [r for r in records if "chunks" in r]
            assert len(cases) == 2 * FORMATS
            for rec in cases:
                assert all(rec["chunks"].values()), (rec["case"], rank, rec["chunks"])
                assert rec[f"used {CHUNKS[0]}"] == CHUNKS[0] and rec[f"used {CHUNKS[-1]}"] < CHUNKS[-1]
            failure = next(r for r in records if r["case"].endswith("failure"))["failure"]
            assert failure[0] == ("InputError" if rank == 1 else "PeerRankError"), (tp, rank, failure)
            mismatch = next(r for r in records if r["case"].endswith("mismatch"))["failure"]
            assert mismatch[0] == "RankMismatchError" and "overlap chunks" in mismatch[1], (tp, rank, mismatch)


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "2"])
def test_a_wrong_overlap_value_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match="overlap_chunks"):
        LMHead(10, 4, dtype=torch.float32, overlap_chunks=value)  # type: ignore[arg-type]
    head = LMHead(10, 4, dtype=torch.float32)
    with pytest.raises(ConfigError, match="overlap_chunks"):
        head.overlap_chunks = value  # type: ignore[assignment]


def test_where_overlap_applies() -> None:
    mapping = Mapping(world_size=2, rank=0, tp_size=2)
    assert LMHead(10, 4, dtype=torch.float32, overlap_chunks=4).overlap_for(ROWS) == 1  # replicated: no gather
    kw = {"dtype": torch.float32, "mapping": mapping, "overlap_chunks": 4}
    assert LMHead(10, 4, **kw).overlap_for(ROWS) == 4
    assert LMHead(10, 4, **kw).overlap_for(0) == 1
    assert LMHead(10, 4, **{**kw, "overlap_chunks": 9}).overlap_for(ROWS) == 5  # one chunk a column at most
    assert LMHead(10, 4, **kw, gather_output=False).overlap_for(ROWS) == 1
    assert LMHead(10, 4, **kw, gather_output="rank0").overlap_for(ROWS) == 1
    assert LMHead(10, 4, **kw, gather_chunk_rows=2).overlap_for(ROWS) == 1
    adp = Mapping(world_size=2, rank=0, tp_size=2, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
    assert LMHead(10, 4, **{**kw, "mapping": adp}).overlap_for(ROWS) == 1
    head = LMHead(10, 4, dtype=torch.float32, mapping=mapping)
    assert head.overlap_chunks is None and head.overlap_for(ROWS) == default_overlap_chunks(2, ROWS, 4, 5)


def test_the_default_is_the_measured_window_and_plan_prices_it() -> None:
    from trtvocab.lm_head import OVERLAP_WINDOWS
    from trtvocab.pipeline.plan import forward_collectives

    assert {tp: [k for _, _, k in w] for tp, w in OVERLAP_WINDOWS.items()} == {2: [4], 3: [2, 4]}
    gemma_w = 262144 // 2  # Gemma 3's head over 2 ranks: B = 64 float32 is a 32 MiB piece
    assert default_overlap_chunks(2, 64, 640, gemma_w) == 4
    assert default_overlap_chunks(2, 16, 640, gemma_w) == 1  # 8 MiB: every k was slower
    assert default_overlap_chunks(2, 256, 640, gemma_w) == 1  # 128 MiB: not faster
    assert default_overlap_chunks(4, 256, 576, 49152 // 4) == 2  # SmolLM2, tp 4: 12 MiB
    assert default_overlap_chunks(1, 64, 640, 262144) == 1
    assert default_overlap_chunks(2, 64, 640, gemma_w, element_size=2) == 1  # bf16 logits: 16 MiB at tp 2
    assert default_overlap_chunks(2, 256, 576, 49152 // 2) == 1  # SmolLM2, tp 2: 24 MiB won twice, lost twice
    assert default_overlap_chunks(3, 64, 640, -(-262144 // 3)) == 4  # Gemma 3, tp 3: 21.3 MiB
    assert default_overlap_chunks(8, 64, 640, 262144 // 8) == 1  # tp 8: the tp >= 3 windows, 8 MiB
    step = forward_collectives(262144, 640, 2, 64, logits_bytes=4)  # the default: 4 chunks of [64, 32768]
    assert [(c.kind, c.bytes) for c in step.first[1:]] == [("all_gather", 64 * 32768 * 4)] * 4
    assert step.steady[0].header and len(step.steady) == 4
    one = forward_collectives(262144, 640, 2, 64, logits_bytes=4, overlap_chunks=1)
    assert [c.bytes for c in one.first[1:]] == [64 * gemma_w * 4]
